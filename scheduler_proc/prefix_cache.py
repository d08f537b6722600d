"""Prefix caching: the admission match, the publication rule, and the keys the host tier stores blocks by.

A full block is found by the whole token prefix it ends: on the device, by an
exact walk of :class:`~scheduler_proc.prefix_tree.PrefixTree` (token bytes, no
hash); on the host KV tier, by a key chained from its parent's key and its
token ids::

    key[-1] = blake2b(model_id, key=secret)              (the root: one per model/revision)
    key[i]  = blake2b(key[i-1] || token ids of block i, key=secret)

blake2b is keyed with a per-server random secret (``os.urandom(32)``), 16-byte
digests: a client that does not know the secret cannot build two prompts
whose blocks collide (it cannot even compute a key), and accidental
collisions are out of reach (2**64 blocks for a birthday collision).  Keys are
computed only with a host tier: the device's tree needs none.

Only full blocks are published, and a block is only *published* (made findable)
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

from scheduler_proc.prefix_tree import ROOT, TOKEN_BYTES, PrefixTree
from scheduler_proc.request import Request

KEY_BYTES = 16


class PrefixCache:
    """Matches, shares and publishes requests' full blocks in a :class:`PrefixTree` (and keys them for the host)."""

    def __init__(self, blocks: PrefixTree, model_id: str, secret: Optional[bytes] = None):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self._secret = os.urandom(32) if secret is None else secret
        self.root = blake2b(model_id.encode(), key=self._secret, digest_size=KEY_BYTES).digest()
        # blake2b(data, key=secret) == keyed.copy() updated with data: copying skips the key block's compression.
        self._keyed = blake2b(key=self._secret, digest_size=KEY_BYTES)
        self.hit_tokens = 0  # prompt (+ received) tokens admissions found cached
        self.query_tokens = 0  # prompt (+ received) tokens admissions looked up
        self.host = None  # the host KV tier (HostTier.attach sets it): backs up what is published, serves misses

    def keys(self, req: Request, n: int) -> list[bytes]:
        """Keys of ``req``'s first ``n`` full blocks of known tokens (memoized on the request)."""
        keys = req.block_keys
        done = len(keys)
        if done >= n:
            return keys
        bs = self.block_size
        # The token bytes of all the new blocks (one conversion, shared with the tree), then one keyed hash each.
        step = bs * TOKEN_BYTES
        data = memoryview(self.token_bytes(req, n))[done * step:n * step]
        parent = keys[-1] if keys else self.root
        new_hash, append = self._keyed.copy, keys.append
        for off in range(0, len(data), step):
            h = new_hash()
            h.update(parent + data[off : off + step])
            parent = h.digest()
            append(parent)
        return keys

    def token_bytes(self, req: Request, n: int) -> bytearray:
        """The token ids of a prefix of ``req``'s known tokens covering its first ``n`` full blocks, as bytes
        (memoized on the request: known tokens only grow).  The prompt, then the received tokens, are
        converted whole where they can be: a slice would touch every token once more."""
        memo, prompt = req.block_bytes, req.prompt
        have, need = len(memo) // TOKEN_BYTES, n * self.block_size
        if have < need:
            if not have and need <= len(prompt):
                memo += array("I", prompt).tobytes()
            elif have == len(prompt):
                memo += array("I", req.output).tobytes()
            else:
                memo += array("I", req.known_tokens(have, req.num_known)).tobytes()
        return memo

    def match(self, req: Request) -> tuple[list[int], list[int]]:
        """Cached blocks of ``req``'s longest cached prefix, leaving at least one known token to compute:
        the device's, then the host tier's continuing the chain (empty without a tier)."""
        n = (req.num_known - 1) // self.block_size
        hit, req.cache_node = self.blocks.match(self.token_bytes(req, n), n)  # cache_node: for admit
        if self.host is None or len(hit) == n:
            return hit, []
        self.keys(req, n)
        return hit, self.host.match(req, len(hit), n)

    def admit(self, req: Request, hit: list[int]) -> None:
        """Share the blocks :meth:`match` found for ``req``; its computation starts after them."""
        if hit:
            self.blocks.share(hit)
        else:
            req.cache_node = ROOT  # (match may not have run: a request owed prompt logprobs takes no hit)
        req.blocks = list(hit)
        req.num_published = len(hit)
        req.num_computed = len(hit) * self.block_size
        self.hit_tokens += req.num_computed
        self.query_tokens += req.num_known

    def publish(self, req: Request, written: int) -> None:
        """Publish ``req``'s full blocks below ``written`` tokens: their KV writes have all come back."""
        n = min(written, req.num_known) // self.block_size
        start = req.num_published
        if n <= start:
            return
        w = self.blocks.width
        memo = req.block_bytes
        data = (memo if len(memo) >= n * w else self.token_bytes(req, n))[start * w:n * w]
        prev = req.blocks[start - 1] if start else None
        req.cache_node = self.blocks.publish(req.cache_node, prev, req.blocks[start:n], data)
        if self.host is not None:
            self.host.backup(req.blocks, self.keys(req, n), start, n)
        req.num_published = n

    def check(self, holders: list[Request]) -> None:
        """Every published or shared block is complete in each holder's view, and a published block a walk
        reaches stands for that holder's tokens up to it; so does the place each holder publishes after."""
        tree, refs = self.blocks, self.blocks.ref_counts()
        bs, w = self.block_size, tree.width
        reach: dict = {}  # what the walks found per run (the tree does not change during the check)
        for r in holders:
            assert r.num_published <= len(r.blocks), f"request {r.rid}: published beyond its blocks"
            tokens = array("I", r.known_tokens(0, r.num_known)).tobytes()
            assert tokens.startswith(r.block_bytes), f"request {r.rid}: token bytes memo"
            complete = max(r.num_computed, 0) // bs  # its blocks whose KV is all written or being written
            for b in r.blocks[complete:]:
                assert not tree.published(b) and refs[b] == 1, (
                    f"request {r.rid}: shared/published block {b} not complete")
            for i, b in enumerate(r.blocks[:complete]):
                if tree.published(b):
                    path = tree.path(b, reach)
                    assert path in (None, tokens[: (i + 1) * w]), f"request {r.rid}: block {b}: another prefix"
            run, pos = r.cache_node
            if run is not None and tree.valid(r.cache_node):
                path = tree.path(run.blocks[pos], reach)
                assert path in (None, tokens[: r.num_published * w]), f"request {r.rid}: its tree node"
