"""The grammar mask kernel against its torch reference (CPU interpreter, or CUDA when present)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels.grammar_mask import apply_grammar_mask  # noqa: E402
from kernels.grammar_mask_ref import apply_grammar_mask_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _table(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    words = -(-vocab // 32)
    t = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int64, generator=gen).to(torch.int32)
    t[0] = -1  # a slot without a constraint: every token allowed
    t[1] = 0  # nothing allowed
    t[2] = 0
    t[2, 0] = 1 << 2  # one token allowed
    return t


@pytest.mark.parametrize("vocab,dtype", [(100, torch.float32), (4099, torch.bfloat16), (2048 + 32 * 3, torch.float32)])
def test_grammar_mask_matches_reference(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    table = _table(6, vocab, gen)
    slots = torch.tensor([3, 0, 1, 2, 5, 3], dtype=torch.int64)
    logits = torch.randn(len(slots), vocab, generator=gen).to(dtype)
    want = apply_grammar_mask_ref(logits.clone(), table, slots)
    got = apply_grammar_mask(logits.clone().to(DEVICE), table.to(DEVICE), slots.to(DEVICE)).cpu()
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1])  # the unconstrained row is untouched
    assert torch.isinf(got[2]).all() and got[3].isfinite().sum() == 1 and got[3, 2] == logits[3, 2]


def test_grammar_mask_table_narrower_than_logits():
    """Columns past the bitmask's words (a tokenizer smaller than the logits) are never allowed."""
    table = torch.full((2, 2), -1, dtype=torch.int32)
    slots = torch.tensor([1, 0], dtype=torch.int64)
    logits = torch.zeros(2, 100)
    got = apply_grammar_mask(logits.clone().to(DEVICE), table.to(DEVICE), slots.to(DEVICE)).cpu()
    assert torch.equal(got, apply_grammar_mask_ref(logits.clone(), table, slots))
    assert got[:, :64].isfinite().all() and torch.isinf(got[:, 64:]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_grammar_mask_captured_in_a_graph_equals_eager():
    """Captured once, replayed over new logits, a new table and new slots: the eager result each time (the
    sampling head's graph binds the table between the forward and the replay)."""
    vocab, rows, num_slots = 128256, 64, 80
    gen = torch.Generator().manual_seed(0)
    logits = torch.zeros(rows, vocab, device="cuda")
    table = _table(num_slots, vocab, gen).cuda()
    slots = torch.zeros(rows, dtype=torch.int64, device="cuda")
    apply_grammar_mask(logits, table, slots)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_grammar_mask(logits, table, slots)
    for trial in range(3):
        fresh = torch.randn(rows, vocab, generator=gen).cuda()
        new_table = _table(num_slots, vocab, gen).cuda()
        new_slots = torch.randint(0, num_slots, (rows,), generator=gen).cuda()
        new_slots[:3] = torch.tensor([0, 1, 2])
        logits.copy_(fresh)
        table.copy_(new_table)
        slots.copy_(new_slots)
        graph.replay()
        want = apply_grammar_mask(fresh.clone(), new_table, new_slots)
        assert torch.equal(logits, want), trial
        assert torch.equal(want.cpu(), apply_grammar_mask_ref(fresh.cpu(), new_table.cpu(), new_slots.cpu()))
