"""kernels.sampling_select (the default sampler path when rows filter) against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after TRITON_INTERPRET)
import triton.language as tl  # noqa: E402

from kernels.sampling import sample  # noqa: E402
from kernels.sampling_ref import sample as sample_ref  # noqa: E402
from kernels.sampling_select import _bucket, _edge, sample_select  # noqa: E402

DEV = torch.device("cuda" if ON_GPU else "cpu")


def _mixed(S, V, g, k_range=40):
    """Rows cycling through greedy, temperature, min-p, top-k, top-p (incl. tiny / 1), both, top-k 1 / >= V."""
    temp = torch.rand(S, generator=g) * 1.5 + 0.2
    top_k = torch.zeros(S, dtype=torch.int64)
    top_p = torch.ones(S)
    min_p = torch.zeros(S)
    for i in range(S):
        kind = i % 11
        if kind == 0:
            temp[i] = 0.0
        elif kind == 1:
            min_p[i] = 0.05
        elif kind == 2:
            top_k[i] = int(torch.randint(1, k_range, (1,), generator=g))
        elif kind == 3:
            top_p[i] = float(torch.rand(1, generator=g))
        elif kind == 4:
            top_k[i], top_p[i] = 50, 0.9
        elif kind == 5:
            top_p[i], min_p[i] = 0.99, 0.1
        elif kind == 6:
            top_k[i] = 1
        elif kind == 7:
            top_k[i] = V + int(torch.randint(0, 3, (1,), generator=g))  # >= V: off
        elif kind == 8:
            top_p[i] = 1e-6
        elif kind == 9:
            top_k[i], min_p[i] = 30, 0.2
    seed = torch.randint(-(2**62), 2**62, (S,), generator=g, dtype=torch.int64)
    pos = torch.randint(0, 2**40, (S,), generator=g, dtype=torch.int64)
    return [t.to(DEV) for t in (temp, top_k, top_p, min_p, seed, pos)]


def _select(logits, params, capacity, **knobs):
    S = logits.shape[0]
    out = torch.full((S,), -7, dtype=torch.int64, device=DEV)
    done = torch.full((S,), -7, dtype=torch.int32, device=DEV)
    sample_select(logits, *params, out, done, capacity=capacity, **knobs)
    return out, done


# the interpreter's tl.sort is slow: small windows on the CPU
CAP = 2048 if ON_GPU else 256


@pytest.mark.parametrize("S,V", [(11, 1000), (6, 5003)] + ([(64, 128256), (8, 32000)] if ON_GPU else []))
def test_select_matches_reference_many_seeds(S, V):
    """Fresh logits and seeds per draw; every finished row equals the reference, and so does sample()."""
    g = torch.Generator().manual_seed(V)
    left = 0
    for draw in range(4 if ON_GPU else 2):
        logits = (torch.randn(S, V, generator=g) * (2 + 2 * draw)).to(DEV)
        params = _mixed(S, V, g)
        ref = sample_ref(logits, *params)
        out, done = _select(logits, params, CAP)
        assert set(done.tolist()) <= {0, 1}
        fin = done.bool()
        assert torch.equal(out[fin], ref[fin]), (out.tolist(), ref.tolist())
        left += int((~fin).sum())
        assert torch.equal(sample(logits, *params, capacity=CAP), ref)
    assert left <= S  # the window settles nearly every row (wide nuclei at T ~1.7 may not)


@pytest.mark.parametrize("knobs", [{}, dict(buckets=128, rank=(4, 8), block=512)])
def test_select_window_outcomes_and_fallback(knobs):
    """A small window: some filtered rows settle, some go to the row kernel; the result is exact either way."""
    g = torch.Generator().manual_seed(3)
    S, V = 22, 1500
    logits = (torch.randn(S, V, generator=g) * 3).to(DEV)
    params = _mixed(S, V, g)
    ref = sample_ref(logits, *params)
    out, done = _select(logits, params, 16, **knobs)
    filt = (params[1] > 0) & (params[1] < V) | (params[2] < 1)
    assert done[~filt].all()
    assert done[filt].any() and not done[filt].all()
    assert torch.equal(out[done.bool()], ref[done.bool()])
    assert torch.equal(sample(logits, *params, capacity=16), ref)
    # batch independence: each row alone
    alone = torch.cat([sample(logits[i: i + 1], *[p[i: i + 1] for p in params]) for i in range(0, S, 3)])
    assert torch.equal(alone, ref[0::3])


@pytest.mark.parametrize("dtype,buckets", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 128)])
def test_select_ties_inf_and_flat(dtype, buckets):
    """Equal logits at the thresholds (and -0.0 vs +0.0), -inf logits (logit_bias), an all-equal row."""
    g = torch.Generator().manual_seed(77)
    S, V = 12, 300
    x = (torch.randn(S, V, generator=g) * 0.6).round() / 2
    x[1, ::5] = -0.0
    x[2, :] = 0.25  # all equal: every threshold ties the whole row
    x[3, 100:] = float("-inf")  # logit_bias -inf on most of the vocabulary
    x[4, :] = float("-inf")
    x[4, 250] = 2.0
    x[6, 3:] = float("-inf")  # top_k = 1 with few finite logits
    x = x.to(dtype).to(DEV)
    params = _mixed(S, V, g, k_range=V // 2)
    params[0][params[0] > 0] = 0.5
    ref = sample_ref(x.float(), *params)
    for cap in (8, 512):
        out, done = _select(x, params, cap, buckets=buckets, block=128, rank=(cap // 2, 4))
        assert torch.equal(out[done.bool()], ref[done.bool()])
        if cap == 512:  # the whole row fits: every row settles in the window
            assert done.all()
        assert torch.equal(sample(x, *params, capacity=cap), ref)


def test_select_unfiltered_rows_skip_the_window():
    """filtered=False: greedy / temperature / min-p rows settle without the histogram and window."""
    g = torch.Generator().manual_seed(5)
    S, V = 9, 1500
    logits = (torch.randn(S, V, generator=g) * 2).to(DEV)
    params = _mixed(S, V, g)
    params[1].zero_()
    params[2].fill_(1.0)
    ref = sample_ref(logits, *params)
    out = torch.empty(S, dtype=torch.int64, device=DEV)
    done = torch.empty(S, dtype=torch.int32, device=DEV)
    sample_select(logits, *params, out, done, filtered=False)
    assert done.all() and torch.equal(out, ref)



@triton.jit
def _probe_buckets(d_ptr, b_ptr, e_ptr, N: tl.constexpr, NB: tl.constexpr, LIN: tl.constexpr, LOG0: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(b_ptr + i, _bucket(tl.load(d_ptr + i), NB, LIN, LOG0))
    j = tl.arange(0, NB)
    tl.store(e_ptr + j, _edge(j, LIN, LOG0))


@pytest.mark.parametrize("nb", [64, 128])
def test_bucket_edges(nb):
    """Edges increase, each edge is its bucket's start, every distance lands between its bucket's edges."""
    lin = nb * 3 // 4
    log0 = (127 + (lin // 3).bit_length() - 1) << 2
    n = 1024
    e = torch.empty(nb, device=DEV)
    _probe_buckets[(1,)](torch.zeros(n, device=DEV), torch.empty(n, dtype=torch.int32, device=DEV), e, N=n, NB=nb,
                         LIN=lin, LOG0=log0)
    e = e.cpu()
    assert bool((e[1:] > e[:-1]).all()) and e[0] == 0 and e[lin] == lin / 4
    g = torch.Generator().manual_seed(nb)
    d = torch.cat([e[:-1], torch.rand(n - (nb - 1), generator=g) * e[-1].item() * 1.5])
    d[-3:] = torch.tensor([float("inf"), float("nan"), 0.0])
    b = torch.empty(n, dtype=torch.int32, device=DEV)
    _probe_buckets[(1,)](d.to(DEV), b, torch.empty(nb, device=DEV), N=n, NB=nb, LIN=lin, LOG0=log0)
    b = b.cpu().long()
    assert torch.equal(b[: nb - 1], torch.arange(nb - 1))
    assert b[-3] == nb - 1 and b[-2] == nb - 1 and b[-1] == 0
    fin = torch.isfinite(d)
    assert bool((e[b[fin]] <= d[fin]).all())
    inner = fin & (b < nb - 1)
    assert bool((d[inner] < e[b[inner] + 1]).all())
