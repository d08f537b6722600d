"""The device's prefix index (a tree of token runs) and the LRU queue, against small reference models.

The planner-level cases (sharing under run-ahead, preemption, aborts, the host
tier) are in tests/test_prefix_cache.py and tests/test_host_kv_tier.py; these
drive :class:`PrefixTree` and :class:`Lru` directly, with ``check_integrity()``
after every operation.
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict

from scheduler_proc.block_allocator import BlockAllocator
from scheduler_proc.prefix_tree import ROOT, PrefixTree

BS = 2  # tokens per block


def data(tokens: list[int]) -> bytearray:
    return bytearray(array("I", tokens).tobytes())


def publish(tree: PrefixTree, tokens: list[int], node=ROOT, prev=None, blocks=None):
    """Allocate (unless given) and publish blocks for ``tokens`` under ``node``; returns (blocks, node)."""
    blocks = tree.allocate(len(tokens) // BS) if blocks is None else blocks
    node = tree.publish(node, prev, list(blocks), data(tokens))  # (the tree keeps the list it is given)
    tree.check_integrity()
    return blocks, node


def match(tree: PrefixTree, tokens: list[int]) -> list[int]:
    return tree.match(data(tokens), len(tokens) // BS)[0]


def test_match_is_exact_at_every_block_and_finds_child_runs():
    tree = PrefixTree(16, BS)
    a, node = publish(tree, [1, 2, 3, 4, 5, 6, 7, 8])
    assert match(tree, [1, 2, 3, 4, 5, 6, 7, 8]) == a
    for k in range(4):  # a change in block k: the first k blocks match
        tokens = [1, 2, 3, 4, 5, 6, 7, 8]
        tokens[2 * k + 1] = 99
        assert match(tree, tokens) == a[:k]
    c, _ = publish(tree, [9, 9, 7, 7], node=tree.match(data([1, 2, 3, 4]), 2)[1])  # hangs from a1
    assert match(tree, [1, 2, 3, 4, 9, 9, 7, 7]) == a[:2] + c
    assert match(tree, [1, 2, 3, 4, 5, 6, 9, 9]) == a[:3], "c hangs from a1, not a2"
    assert match(tree, [9, 9]) == [], "a child run is not a root"


def test_copies_lose_and_what_follows_hangs_from_the_winner():
    tree = PrefixTree(16, BS)
    a, _ = publish(tree, [1, 2, 3, 4])
    b, node = publish(tree, [1, 2, 3, 4, 5, 6])  # computed again by another request: its first two are copies
    assert [tree.published(x) for x in b] == [False, False, True]
    assert node == tree.match(data([1, 2, 3, 4, 5, 6]), 3)[1]
    assert match(tree, [1, 2, 3, 4, 5, 6]) == a + b[2:]
    tree.release(b[:2])
    assert tree.num_cached == 0 and tree.num_free == 16 - 3, "private copies go back to the free list"


def test_a_run_grows_only_for_a_publisher_that_holds_all_of_it():
    tree = PrefixTree(16, BS)
    a, node = publish(tree, [1, 2, 3, 4])
    more, node = publish(tree, [5, 6], node=node, prev=a[-1])  # the same request, its next chunk
    assert node[0].blocks == a + more, "the run grew"
    x, x_node = publish(tree, [1, 2, 3, 4, 5, 6])  # another request computed the same blocks: copies
    assert x_node == node and not any(tree.published(b) for b in x)
    y, y_node = publish(tree, [7, 8], node=x_node, prev=x[-1])  # its next block: it holds none of the run
    assert y_node[0] is not node[0] and y_node[0].parent == more[0], "a child run, not a longer run"
    assert match(tree, [1, 2, 3, 4, 5, 6, 7, 8]) == a + more + y


def test_eviction_cuts_a_run_and_unlinks_it_with_its_first_block():
    tree = PrefixTree(4, BS)
    a, _ = publish(tree, [1, 2, 3, 4, 5, 6])
    tree.release([a[1]])  # the oldest in the LRU
    tree.release([a[0], a[2]])  # then a2, then a0 (tail first)
    assert match(tree, [1, 2, 3, 4, 5, 6]) == a
    x = tree.allocate(2)  # the free block, then the oldest cached one
    assert x[1] == a[1] and tree.num_evictions == 1
    assert match(tree, [1, 2, 3, 4, 5, 6]) == a[:1], "the run is cut where its block was evicted"
    publish(tree, [7, 8, 9, 9], blocks=x)  # a1, reused in another run, is not found at its old place
    assert match(tree, [1, 2, 3, 4, 5, 6]) == a[:1] and match(tree, [7, 8, 9, 9]) == x
    assert tree.allocate(2) == [a[2], a[0]]
    assert match(tree, [1, 2]) == [] and len(tree._roots) == 1, "a run whose first block goes is unlinked"
    tree.check_integrity()


def test_reset_forgets_cached_blocks_and_keeps_held_ones():
    tree = PrefixTree(8, BS)
    a, _ = publish(tree, [1, 2, 3, 4])
    b, _ = publish(tree, [5, 6, 7, 8])
    tree.release(a)
    assert tree.reset() == 2 and match(tree, [1, 2, 3, 4]) == [] and match(tree, [5, 6, 7, 8]) == b
    tree.check_integrity()


def test_random_runs_match_only_their_own_prefix():
    """Random prompts over a small vocabulary (so prefixes repeat), published, shared, released and evicted in
    a small pool: every match returns blocks whose path is the matched tokens, and hits happen."""
    rng = random.Random(5)
    tree = PrefixTree(24, BS)
    held: list[tuple[list[int], list[int], tuple]] = []  # (tokens, blocks, node) of live "requests"
    hits = 0
    for _ in range(3000):
        if held and (rng.random() < 0.45 or tree.num_free < 8):
            tokens, blocks, _ = held.pop(rng.randrange(len(held)))
            tree.release(blocks)
        else:
            tokens = [rng.randrange(3) for _ in range(2 * rng.randint(1, 6))]
            hit, node = tree.match(data(tokens), len(tokens) // BS)
            hits += len(hit)
            for i, b in enumerate(hit):
                assert tree.path(b) == data(tokens[: 2 * (i + 1)])
            tree.share(hit)
            new = tree.allocate(len(tokens) // BS - len(hit))
            prev = hit[-1] if hit else None
            if new:
                node = tree.publish(node, prev, list(new), data(tokens[2 * len(hit):]))
            held.append((tokens, hit + new, node))
        tree.check_integrity()
    assert hits > 500 and tree.num_evictions > 100


# ------------------------------------------------------------------ LRU queue


def test_lru_queue_against_an_ordered_dict():
    """Releases, shares of cached blocks (stale entries), evictions in any amount and resets, in a pool small
    enough that stale entries are compacted: the queue evicts exactly what an ordered dict would."""
    rng = random.Random(3)
    size = 12
    a = BlockAllocator(size, 1)
    model: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently released first
    held: dict[int, int] = {}
    for step in range(6000):
        op = rng.random()
        if op < 0.3 and a.num_free:
            n = rng.randint(1, a.num_free)
            want = [b for b in list(model)[: max(0, n - len(a._free))]]
            got = a.allocate(n)
            evicted = [b for b in got if b in model]
            assert evicted == want, (step, evicted, want)
            for b in got:
                model.pop(b, None)
                held[b] = 1
                a.publish(b, bytes([b, step % 256, step // 256]))
        elif op < 0.6 and held:
            blocks = rng.sample(sorted(held), rng.randint(1, len(held)))
            a.release(blocks)
            for b in reversed(blocks):
                held[b] -= 1
                if not held[b]:
                    del held[b]
                    model[b] = None
        elif op < 0.95 and model:
            blocks = rng.sample(sorted(model), rng.randint(1, len(model)))
            a.share(blocks)  # hits: their entries stay behind, stale
            for b in blocks:
                del model[b]
                held[b] = 1
        elif op >= 0.99:
            assert a.reset() == len(model)
            model.clear()
        a.check_integrity()
        assert a.num_cached == len(model)
    assert a.num_evictions > 1000
