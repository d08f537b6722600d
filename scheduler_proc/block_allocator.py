"""Free pools for KV blocks and slots.

Slots are a plain :class:`Pool`: small integers, one owner each.  KV blocks
are reference-counted so that requests with a common prefix can share them
(prefix caching, see :mod:`scheduler_proc.prefix_cache`).  A block is in one
of three states::

    free     count 0, no key              in _free (LIFO)
    cached   count 0, a key, valid KV     in _lru (oldest first): evicted when space is needed
    held     count >= 1, maybe a key      in the block tables of ``count`` requests

Blocks and slots of a request that has left are given back only after the
last in-flight step that used them has returned: that rule lives in
:mod:`scheduler_proc.planner`, these pools only count.
"""

from __future__ import annotations

from collections import OrderedDict
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


class BlockAllocator:
    """Paged KV blocks of ``block_size`` tokens, reference-counted, with an LRU of cached blocks.

    Allocation takes a free block first, then evicts the least recently
    released cached block (forgetting its key).  ``num_free`` counts both: a
    cached block nobody holds is room.  A block's key is kept in a list indexed
    by block (``None``: no key), so the per-block paths (take, release,
    publish, evict) cost a list access, not a dict operation.
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
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently released first
        self._keys: list[Optional[bytes]] = [None] * num_blocks  # published blocks' keys (held or cached)
        self._block_of: dict[bytes, int] = {}
        self.num_evictions = 0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of KV."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    def can_allocate(self, n: int = 1) -> bool:
        return len(self._free) + len(self._lru) >= n

    def take(self) -> Optional[int]:
        """One block with count 1, or None when nothing is free or evictable (the hot path)."""
        if self._free:
            b = self._free.pop()
        elif self._lru:
            b = self._lru.popitem(False)[0]
            del self._block_of[self._keys[b]]
            self._keys[b] = None
            self.num_evictions += 1
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
        elif len(free) + len(self._lru) >= n:
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
        popitem, keys, block_of = self._lru.popitem, self._keys, self._block_of
        out = []
        for _ in range(n):
            b = popitem(False)[0]
            del block_of[keys[b]]
            keys[b] = None
            out.append(b)
        self.num_evictions += n
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each of a request's blocks (in table order).

        Released in reverse so that a prefix's tail is older in the LRU than its
        head: eviction eats chains from the end, keeping the shared heads.
        """
        refs, keys, lru, free = self._refs, self._keys, self._lru, self._free
        for b in reversed(blocks):
            r = refs[b] - 1
            if r < 0:
                raise RuntimeError(f"KV block {b} released more often than it was held")
            refs[b] = r
            if r == 0:
                if keys[b] is None:
                    free.append(b)
                else:
                    lru[b] = None

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
            if refs[b] == 0:
                del self._lru[b]
            refs[b] += 1

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

    def publish_chain(self, blocks: list[int], keys: list[bytes], start: int, end: int) -> None:
        """``publish(blocks[i], keys[i])`` for i in [start, end), in one loop (the reconcile path)."""
        refs, key_of, setdefault = self._refs, self._keys, self._block_of.setdefault
        for b, k in zip(blocks[start:end], keys[start:end]):
            if refs[b] <= 0:
                raise RuntimeError(f"KV block {b} published while nobody holds it")
            if key_of[b] is None and setdefault(k, b) == b:  # the key was free (or already this block's)
                key_of[b] = k

    def key_of(self, block: int) -> Optional[bytes]:
        return self._keys[block]

    def reset(self) -> int:
        """Forget every cached block nobody holds (they become free); returns how many."""
        n = len(self._lru)
        for b in self._lru:
            del self._block_of[self._keys[b]]
            self._keys[b] = None
            self._free.append(b)
        self._lru.clear()
        return n

    # ---------------------------------------------------------- invariants

    def held(self) -> dict[int, int]:
        """Reference count of every held block."""
        return {b: r for b, r in enumerate(self._refs) if r}

    def check_integrity(self) -> None:
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "KV block: a block is free twice"
        assert not free & lru, "KV block: a block is both free and cached"
        held = self.held()
        assert all(r > 0 for r in held.values()), "KV block: a negative count"
        assert not (free | lru) & held.keys(), "KV block: a block with references is free or cached"
        assert len(free) + len(lru) + len(held) == self.size, (
            f"KV block: free {len(free)} + cached {len(lru)} + held {len(held)} != total {self.size}")
        keyed = {b: k for b, k in enumerate(self._keys) if k is not None}
        assert len(keyed) == len(self._block_of), "KV block: key maps differ in size"
        assert all(self._block_of.get(k) == b for b, k in keyed.items()), "KV block: key maps disagree"
        assert lru <= keyed.keys(), "KV block: a cached block without a key"
        assert not free & keyed.keys(), "KV block: a free block with a key"
