"""Prefix caching: keys for full KV blocks, the admission match, the publication rule.

A full block's key is chained from its parent's key and its token ids::

    key[-1] = blake2b(model_id, key=secret)              (the root: one per model/revision)
    key[i]  = blake2b(key[i-1] || token ids of block i, key=secret)

blake2b is keyed with a per-server random secret (``os.urandom(32)``), 16-byte
digests: a client that does not know the secret cannot build two prompts
whose blocks collide (it cannot even compute a key), and accidental
collisions are out of reach (2**64 blocks for a birthday collision).

Only full blocks get keys, and a block is only *published* (made findable)
once every step that writes it has come back from the executor, never while
in flight: :meth:`PrefixCache.publish` is called at the reconcile of a prefill
chunk's step, and for blocks of generated tokens (whose tokens are known only
once received) when the request drains.  A request that
arrives while the block is in flight computes the block itself (into its own
block): waiting for it would tie one request's admission to another's step,
and at depth <= 2 the copy costs at most two steps of recompute.  The first of
two equal blocks to be published wins; the other stays private and returns
to the free list.  Since shared blocks are full and complete, nobody writes to
them again: copy-on-write is never needed.
"""

from __future__ import annotations

import os
from array import array
from hashlib import blake2b
from typing import Optional

from scheduler_proc.block_allocator import BlockAllocator
from scheduler_proc.host_tier import HostTier
from scheduler_proc.request import Request

KEY_BYTES = 16
TOKEN_BYTES = array("I").itemsize  # token ids are < 2**31 (validated): 4 bytes each, native order


class PrefixCache:
    """Keys requests' full blocks and matches, shares and publishes them in a :class:`BlockAllocator`."""

    def __init__(self, blocks: BlockAllocator, model_id: str, secret: Optional[bytes] = None):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self._secret = os.urandom(32) if secret is None else secret
        self.root = blake2b(model_id.encode(), key=self._secret, digest_size=KEY_BYTES).digest()
        # blake2b(data, key=secret) == keyed.copy() updated with data: copying skips the key block's compression.
        self._keyed = blake2b(key=self._secret, digest_size=KEY_BYTES)
        self.hit_tokens = 0  # prompt (+ received) tokens admissions found cached
        self.query_tokens = 0  # prompt (+ received) tokens admissions looked up
        self.host: Optional[HostTier] = None  # the host KV tier: backs up what is published, serves misses

    def keys(self, req: Request, n: int) -> list[bytes]:
        """Keys of ``req``'s first ``n`` full blocks of known tokens (memoized on the request)."""
        keys = req.block_keys
        done = len(keys)
        if done >= n:
            return keys
        bs = self.block_size
        # One conversion to bytes for all the new blocks, then one keyed hash per block.
        data = memoryview(array("I", req.known_tokens(done * bs, n * bs)).tobytes())
        step = bs * TOKEN_BYTES
        parent = keys[-1] if keys else self.root
        new_hash, append = self._keyed.copy, keys.append
        for off in range(0, len(data), step):
            h = new_hash()
            h.update(parent + data[off : off + step])
            parent = h.digest()
            append(parent)
        return keys

    def match(self, req: Request) -> tuple[list[int], list[int]]:
        """Cached blocks of ``req``'s longest cached prefix, leaving at least one known token to compute:
        the device's, then the host tier's continuing the chain (empty without a tier)."""
        n = (req.num_known - 1) // self.block_size
        hit = self.blocks.match(self.keys(req, n)[:n])
        if self.host is None or len(hit) == n:
            return hit, []
        return hit, self.host.match(req, len(hit), n)

    def admit(self, req: Request, hit: list[int]) -> None:
        """Share the matched blocks with ``req``; its computation starts after them."""
        self.blocks.share(hit)
        req.blocks = list(hit)
        req.num_published = len(hit)
        req.num_computed = len(hit) * self.block_size
        self.hit_tokens += req.num_computed
        self.query_tokens += req.num_known

    def publish(self, req: Request, written: int) -> None:
        """Publish ``req``'s full blocks below ``written`` tokens: their KV writes have all come back."""
        n = min(written, req.num_known) // self.block_size
        if n <= req.num_published:
            return
        keys = self.keys(req, n)
        self.blocks.publish_chain(req.blocks, keys, req.num_published, n)
        if self.host is not None:
            self.host.backup(req.blocks, keys, req.num_published, n)
        req.num_published = n

    def check(self, holders: list[Request]) -> None:
        """Every keyed or shared block is complete in each holder's view and carries that holder's key."""
        refs = self.blocks.held()
        bs = self.block_size
        for r in holders:
            assert r.num_published <= len(r.blocks), f"request {r.rid}: published beyond its blocks"
            for i, b in enumerate(r.blocks):
                key = self.blocks.key_of(b)
                if key is None and refs[b] == 1:
                    continue
                assert (i + 1) * bs <= r.num_computed, f"request {r.rid}: shared/keyed block {b} not complete"
                if key is not None:
                    assert i < len(r.block_keys) and r.block_keys[i] == key, f"request {r.rid}: block {b} key"
