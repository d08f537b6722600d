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
