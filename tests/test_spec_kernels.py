"""Speculation's device pieces on small shapes: the n-gram kernel (CPU interpreter, or CUDA when present)
against its torch reference and a plain Python statement of the rule, and greedy acceptance."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from executor_proc.step.speculate import accept_prefix  # noqa: E402
from kernels.ngram import ngram_drafts  # noqa: E402
from kernels.ngram_ref import ngram_drafts_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rule(seq: list[int], k: int, nmin: int, nmax: int) -> list[int]:
    """The longest suffix (nmax down to nmin) that ends earlier, the most recent end, proposes what followed (the
    copy repeating itself past the end)."""
    n = len(seq)
    for m in range(min(nmax, n), nmin - 1, -1):
        for e in range(n - 1, m - 1, -1):
            if seq[e - m:e] == seq[n - m:]:
                return [seq[e + i % (n - e)] for i in range(k)]
    return [0] * k


@pytest.mark.parametrize("nmin,nmax,k", [(1, 4, 4), (2, 3, 8), (1, 1, 3)])
def test_ngram_drafts_match_the_rule(nmin, nmax, k):
    rng = random.Random(nmin * 10 + nmax)
    num_slots, width = 6, 300  # a row longer than the kernel's block of 256 ends
    tokens = torch.tensor([[rng.randrange(5) for _ in range(width)] for _ in range(num_slots)], dtype=torch.int32)
    slots = torch.tensor([3, 0, 5, 1, 2, 4])
    lengths = torch.tensor([1, 2, 7, 40, 299, 257])
    tokens[4, 280:299] = torch.arange(100, 119)  # a fresh tail: no match for nmin > 1
    want = torch.tensor([rule(tokens[s, :n].tolist(), k, nmin, nmax) for s, n in zip(slots.tolist(), lengths.tolist())])
    assert torch.equal(ngram_drafts_ref(tokens, slots, lengths, k, nmin, nmax), want)
    got = ngram_drafts(tokens.to(DEVICE), slots.to(DEVICE), lengths.to(DEVICE), k, nmin, nmax).cpu()
    assert torch.equal(got, want)


def test_accept_prefix_is_the_longest_agreeing_prefix():
    drafts = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7, 8]])
    target = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9]])
    ks = torch.tensor([4, 2, 4, 4, 0])
    assert accept_prefix(drafts, target, ks).tolist() == [4, 2, 0, 2, 0]
