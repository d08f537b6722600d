"""The step upload's layout: every part at a 16-byte boundary, whatever the sizes before it.

Triton compiles one kernel variant per (pointer argument, 16-byte aligned or not); parts at 8-byte places
made an eager step's index arrays change alignment with the sizes of the parts before them, and a new
combination compiled a variant in the middle of serving (docs/performance.md, "Host KV tier").
"""

from __future__ import annotations

import random

from executor_proc.step.staging import layout


def test_every_part_starts_at_a_16_byte_boundary_and_none_overlap():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 4, 8, 12, 16, 20, 4 * rng.randrange(1, 500)]) for _ in range(rng.randrange(1, 12))]
        offsets, total = layout(sizes)
        assert all(off % 16 == 0 for off in offsets), (sizes, offsets)
        ends = [off + n for off, n in zip(offsets, sizes)]
        assert all(end <= nxt for end, nxt in zip(ends, offsets[1:])), (sizes, offsets)
        assert ends[-1] <= total and total % 16 == 0
