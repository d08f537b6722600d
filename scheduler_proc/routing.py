"""Which data-parallel replica serves a request: the one where it costs least, its cached prefix against its queue.

Pure functions and one small index, used by the router (``scheduler_proc/replica_router.py``):

* a prompt is named by the chained hashes of its full blocks (``--block-size`` tokens each), as the replicas'
  prefix caches name what they can share: ``h[i] = hash((h[i-1], *block i))``, so ``h[i]`` stands for the whole
  prefix up to block ``i``;
* the router keeps, per replica, a bounded LRU of the hashes it sent there (prompts at routing, prompt plus
  output at the finish: a chat's next turn starts with both).  It is a guess about the replica's cache, never
  a promise: a collision or an eviction on the replica costs a recompute, not a wrong token;
* a request goes to the replica where it costs least: the prompt tokens that replica would compute (those past
  its matched blocks) plus ``REQUEST_TOKENS`` for each request it has in flight, among the replicas no more than
  ``slack`` requests (a whole batch) busier than the least loaded.  So a long shared prefix (a RAG document, a
  chat's history) stays where it is cached while the queue it joins is short against the prefill it saves, and a
  short one (a chat template's opening, a brief system prompt) follows the load: concurrent requests sharing it
  spread over the replicas, each of which then holds it too.  Ties go to the longer match, then to the lower
  load, then to the lowest index.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

# Hashes remembered per replica: ~100 bytes each; 64K blocks of 16 tokens is 1M tokens of prefixes.
INDEX_CAPACITY = 1 << 16
# Prompt tokens one more request in flight is worth when choosing a replica: a cached prefix this long is worth
# queueing behind one more request (a request holds its slot for its whole decode; a prefill of 128 tokens is a
# fraction of one step).
REQUEST_TOKENS = 128


def prefix_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of the full blocks of ``tokens`` (Python's int-tuple hash: the same in every process)."""
    hashes, h = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, *tokens[start:start + block_size]))
        hashes.append(h)
    return hashes


class PrefixIndex:
    """The block-prefix hashes sent to one replica, least recently used first, at most ``capacity``."""

    def __init__(self, capacity: int = INDEX_CAPACITY) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[int, None] = OrderedDict()

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt with these hashes the replica is thought to hold."""
        entries, n = self.entries, 0
        for h in hashes:
            if h not in entries:
                break
            n += 1
        return n

    def add(self, hashes: Sequence[int]) -> None:
        entries = self.entries
        for h in hashes:
            entries[h] = None
            entries.move_to_end(h)
        while len(entries) > self.capacity:
            entries.popitem(last=False)

    def clear(self) -> None:
        self.entries.clear()


def choose(matched: Sequence[int], loads: Sequence[int], slack: int, blocks: int, block_size: int) -> int:
    """The position of the chosen candidate, given each one's matched blocks and requests in flight, the prompt's
    full blocks and their size in tokens (module docstring)."""
    least = min(loads)
    fits = [i for i in range(len(loads)) if loads[i] - least <= slack]
    return min(fits, key=lambda i: ((blocks - matched[i]) * block_size + REQUEST_TOKENS * loads[i], -matched[i],
                                    loads[i], i))
