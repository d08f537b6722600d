"""Free pools for KV blocks and slots.

Slots are a plain :class:`Pool`: small integers, one owner each.  KV blocks
are reference-counted so that requests with a common prefix can share them
(prefix caching, see :mod:`scheduler_proc.prefix_cache`).  A block is in one
of three states::

    free     count 0, no key              in _free (LIFO)
    cached   count 0, a key, valid KV     in _lru (oldest first): evicted when space is needed
    held     count >= 1, maybe a key      in the block tables of ``count`` requests

A key is what makes a block findable: a bytes key here (the host tier's
blocks), the block's run in the device's :class:`~scheduler_proc.prefix_tree.PrefixTree`.

Blocks and slots of a request that has left are given back only after the
last in-flight step that used them has returned: that rule lives in
:mod:`scheduler_proc.planner`, these pools only count.
"""

from __future__ import annotations

from collections import Counter, deque
from itertools import chain, compress, repeat
from operator import eq, is_not, sub
from typing import Optional


class Pool:
    """A LIFO free list of ``0..size-1`` with an owner per handed-out id."""

    def __init__(self, size: int, name: str):
        if size <= 0:
            raise ValueError(f"{name} pool size must be positive, got {size}")
        self.name = name
        self.size = size
        # LIFO so that recently freed (cache-warm) ids are reused first.
        self._free = list(range(size - 1, -1, -1))
        self._owner: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) >= n

    def allocate(self, owner: int, n: int = 1) -> list[int]:
        if len(self._free) < n:
            raise RuntimeError(f"{self.name} pool exhausted: asked for {n}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._owner[i] = owner
        return ids

    def free(self, owner: int, ids: list[int]) -> None:
        for i in ids:
            if self._owner.get(i) != owner:
                raise RuntimeError(f"{self.name} {i} freed by {owner} but owned by {self._owner.get(i)}")
            del self._owner[i]
            self._free.append(i)

    def owned_by(self) -> dict[int, int]:
        return dict(self._owner)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: an id is free twice"
        assert not free & self._owner.keys(), f"{self.name}: an id is both free and owned"
        assert len(free) + len(self._owner) == self.size, (
            f"{self.name}: free {len(free)} + owned {len(self._owner)} != total {self.size}"
        )


class Lru:
    """Cached blocks, least recently released first: a queue of releases (each a list of blocks, in the
    order they were released), evicted from the front.

    Sharing a cached block leaves its entry behind, stale (``stale[b]`` counts a
    block's): entries are first in, first out, so a block's stale entries all
    come before its live one, and popping skips as many of its entries as it has
    stale ones.  While there are none (no cached block was shared since the
    last compaction) a pop takes whole releases or slices of one, with no work
    per block.  Stale entries are compacted away once they outnumber the blocks.
    """

    def __init__(self, size: int):
        self.size = size
        self._releases: deque[list[int]] = deque()
        self.stale = [0] * size
        self.num_stale = 0

    def push(self, blocks: list[int]) -> None:
        """Blocks released just now, in release order (a non-empty list the queue keeps)."""
        self._releases.append(blocks)

    def taken(self, block: int) -> None:
        """A cached block was shared: its entry stays behind, stale."""
        self.stale[block] += 1
        self.num_stale += 1
        if self.num_stale > self.size:
            self.compact()

    def pop(self, n: int) -> list[int]:
        """The ``n`` oldest live entries (there must be that many)."""
        releases, out = self._releases, []
        if not self.num_stale:
            while n:
                first = releases[0]
                if len(first) <= n:
                    out += first
                    n -= len(first)
                    releases.popleft()
                else:
                    out += first[:n]
                    del first[:n]
                    n = 0
            return out
        stale, append = self.stale, out.append
        while n:
            first, i = releases[0], 0
            for b in first:
                i += 1
                if stale[b]:
                    stale[b] -= 1
                    self.num_stale -= 1
                else:
                    append(b)
                    n -= 1
                    if not n:
                        break
            if i == len(first):
                releases.popleft()
            else:
                del first[:i]
        return out

    def compact(self) -> None:
        """Drop the stale entries: one release holding every live entry, in order."""
        stale, live = self.stale, []
        for release in self._releases:
            for b in release:
                if stale[b]:
                    stale[b] -= 1
                else:
                    live.append(b)
        self.num_stale = 0
        self._releases = deque([live] if live else [])

    def clear(self) -> list[int]:
        """Empty the queue; returns the live entries, oldest first."""
        self.compact()
        live = self._releases[0] if self._releases else []
        self._releases.clear()
        return live

    def entries(self) -> list[int]:
        """Every entry, stale or live, oldest first (for checks)."""
        return list(chain.from_iterable(self._releases))

    def live(self) -> set[int]:
        """The blocks with a live entry, asserting that each block has at most one (its entries less its stale
        ones) and that the stale counts add up (for checks)."""
        entries, stale = self.entries(), self.stale
        assert sum(stale) == self.num_stale, "KV block: stale LRU entries"
        if not any(stale):  # every entry is live: one per block
            live = set(entries)
            assert len(live) == len(entries), "KV block: LRU entries"
            return live
        counts = Counter(entries)
        per_block = list(map(counts.get, range(self.size), repeat(0)))
        assert sum(per_block) == len(entries), "KV block: an LRU entry is no block"
        live_counts = list(map(sub, per_block, stale))
        assert min(live_counts) >= 0 and max(live_counts) <= 1, "KV block: LRU entries"
        return set(compress(range(self.size), live_counts))


class BlockAllocator:
    """Paged KV blocks of ``block_size`` tokens, reference-counted, with an LRU of cached blocks.

    Allocation takes a free block first, then evicts the least recently
    released cached block (forgetting its key).  ``num_free`` counts both: a
    cached block nobody holds is room.  A block's key is kept in a list indexed
    by block (``None``: no key), so the per-block paths (take, release,
    publish, evict) cost a list access, not a dict operation.

    The LRU is an :class:`Lru` queue: a release appends one list, an eviction
    pops from the front, a share leaves a stale entry (an ordered dict's move
    per block cost three times a queue's).
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0:
            raise ValueError(f"KV block pool size must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.size = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # LIFO: recently freed blocks first
        self._refs = [0] * num_blocks
        self._lru = Lru(num_blocks)  # cached blocks, least recently released first
        self._num_cached = 0  # published blocks nobody holds (the LRU's live entries)
        # What makes a published block (held or cached) findable: its key here, its run in a PrefixTree.
        self._keys: list[Optional[object]] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of KV."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones and cached ones nobody holds."""
        return len(self._free) + self._num_cached

    @property
    def num_cached(self) -> int:
        return self._num_cached

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) + self._num_cached >= n

    def take(self) -> Optional[int]:
        """One block with count 1, or None when nothing is free or evictable (the hot path)."""
        if self._free:
            b = self._free.pop()
        elif self._num_cached:
            b = self._evict(1)[0]
        else:
            return None
        self._refs[b] = 1
        return b

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with count 1: free ones first (LIFO), then the oldest cached ones."""
        free = self._free
        if len(free) >= n:
            ids = free[len(free) - n:]
            del free[len(free) - n:]
            ids.reverse()  # the order n pops would give
        elif len(free) + self._num_cached >= n:
            ids = free[::-1]
            free.clear()
            ids += self._evict(n - len(ids))
        else:
            raise RuntimeError(f"KV block pool exhausted: asked for {n}, {self.num_free} free")
        refs = self._refs
        for b in ids:
            refs[b] = 1
        return ids

    def _evict(self, n: int) -> list[int]:
        """The ``n`` least recently released cached blocks, their keys forgotten."""
        out = self._lru.pop(n)
        self._num_cached -= n
        self._forget(out)
        self.num_evictions += n
        return out

    def _forget(self, blocks: list[int]) -> None:
        """Unpublish cached ``blocks`` (evicted or reset): they stop being findable."""
        keys, block_of = self._keys, self._block_of
        for b in blocks:
            del block_of[keys[b]]
            keys[b] = None

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of a request's blocks (in table order).

        Released in reverse so that a prefix's tail is older in the LRU than its
        head: eviction eats chains from the end, keeping the shared heads.
        """
        refs, keys, free, cached = self._refs, self._keys, self._free, []
        for b in reversed(blocks):
            r = refs[b] - 1
            if r < 0:
                raise RuntimeError(f"KV block {b} released more often than it was held")
            refs[b] = r
            if r == 0:
                if keys[b] is None:
                    free.append(b)
                else:
                    cached.append(b)
        if cached:
            self._lru.push(cached)
            self._num_cached += len(cached)

    # ------------------------------------------------------------ sharing

    def match(self, keys: list[bytes]) -> list[int]:
        """The published blocks of the longest prefix of ``keys``."""
        out = []
        block_of = self._block_of
        for k in keys:
            b = block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` are cached with count 0 (they stop being room once shared)."""
        refs = self._refs
        return sum(1 for b in blocks if refs[b] == 0)

    def num_held_once(self, blocks: list[int]) -> int:
        """How many of ``blocks`` have count 1 (they return to the pool when that one holder releases them)."""
        refs = self._refs
        return sum(1 for b in blocks if refs[b] == 1)

    def share(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (matched, published blocks)."""
        refs = self._refs
        for b in blocks:
            r = refs[b]
            if not r:  # out of the LRU: its entry is left behind
                self._lru.taken(b)
                self._num_cached -= 1
            refs[b] = r + 1

    def publish(self, block: int, key: bytes) -> bool:
        """Make a held, fully written block findable by ``key``.

        False (and nothing changes) when the block already has a key or another
        block has this one: two requests computed the same block at once, the
        first one published wins and the other copy stays private.
        """
        if self._refs[block] <= 0:
            raise RuntimeError(f"KV block {block} published while nobody holds it")
        if key in self._block_of or self._keys[block] is not None:
            return False
        self._keys[block] = key
        self._block_of[key] = block
        return True

    def key_of(self, block: int) -> Optional[bytes]:
        return self._keys[block]

    def published(self, block: int) -> bool:
        """Whether ``block`` is findable (held or cached), not a private or free one."""
        return self._keys[block] is not None

    def reset(self) -> int:
        """Forget every cached block nobody holds (they become free); returns how many."""
        blocks = self._lru.clear()
        self._forget(blocks)
        self._free += blocks
        self._num_cached = 0
        return len(blocks)

    # ---------------------------------------------------------- invariants

    def held(self) -> dict[int, int]:
        """Reference count of every held block."""
        refs = self._refs
        return {b: refs[b] for b in compress(range(self.size), refs)}

    def ref_counts(self) -> list[int]:
        """Every block's reference count, by block (a copy)."""
        return self._refs.copy()

    def _published(self) -> list[int]:
        """Every block with a key (cached or held), in order."""
        return list(compress(range(self.size), map(is_not, self._keys, repeat(None))))

    def check_integrity(self) -> None:
        """Free + cached + held == total, the LRU is exactly the published blocks nobody holds, and the index.

        (Tests run it after every step of thousands of cases: the scans over every block are C loops.)"""
        refs = self._refs
        free = set(self._free)
        assert len(free) == len(self._free), "KV block: a block is free twice"
        lru = self._lru.live()
        assert len(lru) == self._num_cached, "KV block: cached count"
        assert not any(map(refs.__getitem__, lru)), "KV block: a block in the LRU is held"
        assert not free & lru, "KV block: a block is both free and cached"
        assert min(refs, default=0) >= 0, "KV block: a negative count"
        held = set(compress(range(self.size), refs))
        assert not (free | lru) & held, "KV block: a block with references is free or cached"
        assert len(free) + len(lru) + len(held) == self.size, (
            f"KV block: free {len(free)} + cached {len(lru)} + held {len(held)} != total {self.size}")
        published = set(self._published())
        assert lru <= published, "KV block: a cached block without a key"
        assert not free & published, "KV block: a free block with a key"
        self._check_index(published)

    def _check_index(self, published: set[int]) -> None:
        """Keys and blocks map one to one."""
        blocks = list(published)
        assert len(blocks) == len(self._block_of), "KV block: key maps differ in size"
        mapped = map(self._block_of.get, map(self._keys.__getitem__, blocks))
        assert all(map(eq, mapped, blocks)), "KV block: key maps disagree"
