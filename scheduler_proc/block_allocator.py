"""Free pools for KV blocks and slots.

Both pools hand out small integers and take them back.  Ownership is tracked so
that ``check_integrity()`` can prove no block or slot is owned twice and that
free + owned == total.  Blocks and slots of a request that has left are given
back only after the last in-flight step that used them has returned: that rule
lives in :mod:`scheduler_proc.planner`, these pools only count.
"""

from __future__ import annotations

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

    def take(self, owner: int) -> Optional[int]:
        """One id for ``owner``, or None when the pool is empty (the hot path of ``allocate``)."""
        if not self._free:
            return None
        i = self._free.pop()
        self._owner[i] = owner
        return i

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


class BlockAllocator(Pool):
    """Paged KV blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        super().__init__(num_blocks, "KV block")
        self.block_size = block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of KV."""
        return -(-num_tokens // self.block_size)
