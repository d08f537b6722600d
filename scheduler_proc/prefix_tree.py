"""The device's KV blocks with the prefix cache's index: published blocks form a tree of token runs.

A published block stands for the whole token prefix that ends with it: its
own tokens after its parent's.  The tree stores that exactly, with no hash::

    root ─┬─ run A: [a0 a1 a2 a3]            a run: a chain of blocks and the token bytes of all of them
          │              └─ run C: [c0 c1]   a child run of a1, found there by c0's tokens
          └─ run B: [b0 b1 b2]               (the root's and each block's children: a dict by first-block bytes)

A run is what one request published in one go (a prefill chunk, its generated
blocks at drain), grown in place when a request that holds every block of it
publishes the next blocks (its own later chunks, a next turn that matched all
of it).  Publishing ``k`` blocks costs one dict insert (or none, when the run
grows) and ``k`` list stores; matching a prompt that shares nothing costs one
dict lookup; a hit compares token bytes, so it is exact, whatever a client sends.

``_keys[b]`` is the run a published block is in (``None``: not published, as
in :class:`BlockAllocator`, whose counts and LRU this class keeps).  A block is
in a run at most once: a run grows only by blocks of a request that holds all
of its blocks, so none of them was evicted.  Evicting a block unpublishes it;
walks check ``_keys[b] is run`` for every block after a run's first, so the
run's later blocks and the child runs hanging from it are unreachable from
then on (they are evicted in turn: releases put a chain's tail before its head
in the LRU), and a run whose first block goes is unlinked from its parent.
"""

from __future__ import annotations

from array import array
from typing import Optional

from scheduler_proc.block_allocator import BlockAllocator

TOKEN_BYTES = array("I").itemsize  # token ids are < 2**31 (validated): 4 bytes each, native order

Node = tuple  # (run, pos): a published block's place; ROOT: the empty prefix
ROOT: Node = (None, -1)


class Run:
    """A chain of published blocks hanging from block ``parent`` (at ``at`` in its run; -1: the root)."""

    __slots__ = ("parent", "at", "blocks", "data", "head", "children")

    def __init__(self, parent: int, at: int, blocks: list[int], data: bytearray, head: bytes):
        self.parent = parent
        self.at = at
        self.blocks = blocks
        self.data = data  # the blocks' token ids as bytes, block after block (grows with the run)
        self.head = head  # the first block's bytes: the run's key among its parent's children
        self.children: Optional[dict[int, dict[bytes, Run]]] = None  # position -> the runs hanging there


class PrefixTree(BlockAllocator):
    """Reference-counted KV blocks with an LRU (:class:`BlockAllocator`) whose published blocks form a tree."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.width = block_size * TOKEN_BYTES  # bytes of one block's token ids
        self._roots: dict[bytes, Run] = {}

    def valid(self, node: Node) -> bool:
        """Whether ``node`` still names a published block (or is the root)."""
        run, pos = node
        return run is None or self._keys[run.blocks[pos]] is run

    def match(self, data: bytes, n: int, node: Node = ROOT) -> tuple[list[int], Node]:
        """The published blocks continuing a valid ``node`` with the first ``n`` blocks of token bytes in
        ``data``, as far as they match, and the place of the last one (``node`` if none)."""
        keys, w = self._keys, self.width
        run, pos = node
        kids = self._roots
        out = []
        for off in range(0, n * w, w):
            if run is not None:
                nxt = pos + 1  # the run's next block, if it is still published and holds these tokens
                if nxt < len(run.blocks):
                    b = run.blocks[nxt]
                    if keys[b] is run and run.data.startswith(data[off:off + w], nxt * w):
                        out.append(b)
                        pos = nxt
                        continue
                kids = run.children.get(pos) if run.children else None
            if not kids:
                break
            child = kids.get(bytes(data[off:off + w]))
            if child is None:
                break
            run, pos = child, 0
            out.append(child.blocks[0])
        return out, (run, pos)

    def publish(self, node: Node, prev: Optional[int], blocks: list[int], data: bytearray) -> Node:
        """Publish held, fully written ``blocks`` (their token bytes: ``data``; the tree keeps both objects) as
        the continuation of ``node``, the place of the publisher's block ``prev`` or of its copy; returns the
        place of the last block.

        Blocks whose tokens the tree already has there stay private: the first
        copy published wins, and what follows hangs from the winner.  Nothing
        is published when ``node`` is no longer valid (an evicted winner).
        """
        keys, w = self._keys, self.width
        run, pos = node
        if run is None:
            kids, end = self._roots, False
        else:
            if keys[run.blocks[pos]] is not run:
                return node
            kids = run.children.get(pos) if run.children else None
            end = pos == len(run.blocks) - 1
        grow = end and run.blocks[pos] == prev  # the publisher holds the whole run: it may grow
        i = 0
        if grow and not kids:
            head = None  # nothing else hangs there: no copy to find
        else:
            head = bytes(data[:w])
            if (run is not None and not end) or (kids and head in kids):
                found, node = self.match(data, len(blocks), node)  # the tree has the first blocks: these lose
                i = len(found)
                if i == len(blocks):
                    return node
                run, pos = node
                grow, head = False, bytes(data[i * w:i * w + w])
        new = blocks[i:] if i else blocks
        if grow:
            run.blocks += new
            run.data += data
        else:
            child = Run(-1 if run is None else run.blocks[pos], pos, new, data[i * w:] if i else data, head)
            if run is None:
                self._roots[head] = child
            elif run.children is None:
                run.children = {pos: {head: child}}
            else:
                run.children.setdefault(pos, {})[head] = child  # no valid child has these tokens: match took it
            run, pos = child, -1
        for b in new:  # (held and unpublished: PrefixCache publishes a request's own blocks past its last)
            keys[b] = run
        return run, pos + len(new)

    def _forget(self, blocks: list[int]) -> None:
        """Unpublish cached ``blocks``: drop the runs hanging from them, unlink the runs they were first of."""
        keys, roots = self._keys, self._roots
        for b in blocks:
            run = keys[b]
            keys[b] = None
            if run.children:
                run.children.pop(run.blocks.index(b), None)
            if run.blocks[0] == b:
                if run.parent < 0:
                    kids = roots
                else:
                    parent = keys[run.parent]
                    kids = parent.children.get(run.at) if parent is not None and parent.children else None
                if kids is not None and kids.get(run.head) is run:
                    del kids[run.head]

    # ---------------------------------------------------------- invariants

    def path(self, block: int, reach: Optional[dict] = None) -> Optional[bytes]:
        """The token bytes from the root to a published ``block``, or None if a walk cannot reach it.

        ``reach`` (for many calls on a tree that does not change) keeps what :meth:`_reach` found per run."""
        run = self._keys[block]
        if run is None:
            return None
        found = reach.get(run) if reach is not None else None
        valid, head = self._reach(run, reach) if found is None else found
        pos = run.blocks.index(block)
        if head is None or pos > valid:  # unlinked, or a block before it in its run was evicted
            return None
        return head + run.data[: (pos + 1) * self.width]

    def _reach(self, run: Run, reach: Optional[dict]) -> tuple[int, Optional[bytes]]:
        """How many of ``run``'s first blocks are still its own, and the token bytes from the root to its
        parent block (None if a walk cannot reach the run)."""
        keys = self._keys
        valid = next((i for i, b in enumerate(run.blocks) if keys[b] is not run), len(run.blocks))
        if self._siblings(run).get(run.head) is not run:
            head = None
        else:
            head = b"" if run.parent < 0 else self.path(run.parent, reach)
        if reach is not None:
            reach[run] = valid, head
        return valid, head

    def _siblings(self, run: Run) -> dict[bytes, Run]:
        """The dict ``run`` is (or was) linked in: its parent's children at its place, or the roots."""
        if run.parent < 0:
            return self._roots
        parent = self._keys[run.parent]
        if parent is None or not parent.children:
            return {}
        return parent.children.get(run.at, {})  # (another run's if the parent block was reused: not run's)

    def _check_index(self, published: set[int]) -> None:
        """Every published block is in its run once; every linked run's first block is valid and its key."""
        w, keys = self.width, self._keys
        for b in published:
            assert keys[b].blocks.count(b) == 1, f"KV block {b}: not once in its run"
        assert not self._block_of, "KV block: a key in the prefix tree"
        linked = [(-1, -1, self._roots)]  # (parent block, its place, the runs hanging there)
        for run in set(map(keys.__getitem__, published)):
            assert len(run.data) == len(run.blocks) * w, "KV block: a run's bytes and blocks differ"
            if run.children:
                for pos, kids in run.children.items():
                    assert keys[run.blocks[pos]] is run, "KV block: runs hang from an unpublished block"
                    linked.append((run.blocks[pos], pos, kids))
        for parent, at, kids in linked:
            for head, run in kids.items():
                assert run.parent == parent and run.at == at, "KV block: a run's parent"
                assert head == run.head == run.data[:w], "KV block: a run's key"
                assert keys[run.blocks[0]] is run, "KV block: a linked run's first block is not published"
