"""kernels.topn: exact two-stage top-k against a stable torch sort (ties by lowest index)."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.topn import top_candidates, top_candidates_ref  # noqa: E402

DEV = torch.device("cuda" if ON_GPU else "cpu")


@pytest.mark.parametrize("S,V,k,chunk", [(5, 1000, 20, 256), (3, 2003, 7, 512), (4, 300, 64, 4096),
                                         (2, 257, 1, 64), (3, 100, 100, 32)]
                         + ([(64, 128256, 20, 4096), (64, 128256, 64, 2048)] if ON_GPU else []))
def test_top_candidates_match_sorted(S, V, k, chunk):
    g = torch.Generator().manual_seed(V + k)
    x = (torch.randn(S, V, generator=g) * 3).to(DEV)
    vals, ids = top_candidates(x, k, chunk=chunk)
    rv, ri = top_candidates_ref(x, k)
    assert torch.equal(ids, ri) and torch.equal(vals, rv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_candidates_ties_and_specials(dtype):
    """Many ties (lowest index first, also across chunks), -0.0 == +0.0, -inf and +inf entries."""
    g = torch.Generator().manual_seed(11)
    S, V = 6, 1500
    x = ((torch.randn(S, V, generator=g) * 0.6).round() / 2)
    x[0, ::7] = -0.0
    x[1, :] = 0.0
    x[1, 1000::3] = -0.0
    x[2, 5] = float("inf")
    x[3, :] = float("-inf")
    x[3, 1499] = 1.0
    x = x.to(dtype).to(DEV)
    for k in (1, 5, 33):
        vals, ids = top_candidates(x, k, chunk=128)
        rv, ri = top_candidates_ref(x, k)
        assert torch.equal(ids, ri), (ids.tolist(), ri.tolist())
        assert torch.equal(vals, rv)
    assert ids[1].tolist() == list(range(33))


def test_top_candidates_rejects_bad_k():
    x = torch.zeros(2, 10, device=DEV)
    with pytest.raises(AssertionError, match="k=11"):
        top_candidates(x, 11)
