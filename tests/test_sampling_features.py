"""Logprobs, penalties and the windowed sampler against their torch references.

Without CUDA the Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1, set before
any kernel module is imported) at small shapes; with CUDA the same tests run on the GPU plus
larger shapes and no-sync / CUDA-graph checks.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from kernels.logprobs_ref import token_logprobs_ref  # noqa: E402
from kernels.penalties_ref import (PenaltyTables, apply_penalties_ref, count_sampled, mark_prompt,  # noqa: E402
                                   reset_slots)
from kernels.sampling_ref import sample as sample_ref  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: inf - inf in masked lanes


# --------------------------------------------------------------------------- penalties


def _penalty_tables(num_slots, V, gen, max_bias=8, max_stop=4):
    """Random tables: slot i % 5 == 0 has every penalty off, the others a mix."""
    t = PenaltyTables.allocate(num_slots, V, DEV, max_bias=max_bias, max_stop=max_stop)
    slots = torch.arange(num_slots, device=DEV)
    prompt_slots = torch.randint(0, num_slots, (num_slots * 20,), generator=gen).to(DEV)
    mark_prompt(t, prompt_slots, torch.randint(0, V, (num_slots * 20,), generator=gen).to(DEV))
    for _ in range(6):  # a few "steps" of sampled tokens, with repeats
        count_sampled(t, slots, torch.randint(0, min(V, 50), (num_slots,), generator=gen).to(DEV))
    for q in range(num_slots):
        kind = q % 5
        if kind == 0:
            continue
        t.repetition[q] = 1.0 + float(torch.rand(1, generator=gen)) if kind in (1, 4) else 1.0
        t.frequency[q] = float(torch.rand(1, generator=gen)) * 4 - 2 if kind in (2, 4) else 0.0
        t.presence[q] = float(torch.rand(1, generator=gen)) * 4 - 2 if kind in (3, 4) else 0.0
        nb = int(torch.randint(0, max_bias + 1, (1,), generator=gen))
        t.bias_ids[q, :nb] = torch.randperm(V, generator=gen)[:nb].to(torch.int32).to(DEV)
        t.bias_values[q, :nb] = (torch.rand(nb, generator=gen) * 200 - 100).to(DEV)
        t.stop_ids[q, :2] = torch.randint(0, V, (2,), generator=gen).to(torch.int32).to(DEV)
        t.min_tokens[q] = 10 if q % 2 else 3  # generated == 6: masked on odd slots only
    return t


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("S,V", [(10, 700)] + ([(64, 128256)] if ON_GPU else []))
def test_penalties_match_reference(S, V, in_place):
    from kernels.penalties import apply_penalties

    g = torch.Generator().manual_seed(S + V)
    t = _penalty_tables(S + 2, V, g, max_bias=8 if V < 1000 else 300, max_stop=4)
    slots = torch.randperm(S + 2, generator=g)[:S].to(DEV)
    logits = (torch.randn(S, V, generator=g) * 4).to(DEV)
    ref = apply_penalties_ref(logits, t, slots)
    raw = logits.clone()
    out = apply_penalties(logits, t, slots, out=logits if in_place else None)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
    if not in_place:
        assert torch.equal(logits, raw)
    off = (t.repetition[slots] == 1) & (t.frequency[slots] == 0) & (t.presence[slots] == 0) & (t.bias_ids[slots, 0] < 0)
    assert off.any() and torch.equal(out[off], raw[off])


def test_penalty_formulas_by_hand():
    """One slot, small vocab: each rule written out explicitly (HF / OpenAI semantics)."""
    from kernels.penalties import apply_penalties

    V = 8
    t = PenaltyTables.allocate(2, V, DEV, max_bias=3, max_stop=2)
    mark_prompt(t, torch.tensor([0, 0], device=DEV), torch.tensor([1, 2], device=DEV))
    count_sampled(t, torch.tensor([0, 0, 0], device=DEV), torch.tensor([2, 3, 3], device=DEV))
    t.repetition[0], t.frequency[0], t.presence[0] = 2.0, 0.5, 0.25
    t.bias_ids[0, :2] = torch.tensor([5, 6], dtype=torch.int32)
    t.bias_values[0, :2] = torch.tensor([100.0, -100.0])
    t.stop_ids[0, 0], t.min_tokens[0] = 7, 4  # generated == 3 < 4: token 7 masked
    x = torch.tensor([[1.0, 3.0, -2.0, 4.0, 1.0, 0.0, 2.0, 9.0]], device=DEV)
    want = torch.tensor([[1.0, 1.5, -4.0 - 0.5 - 0.25, 2.0 - 1.0 - 0.25, 1.0, 100.0, -98.0, float("-inf")]])
    for f in (apply_penalties, apply_penalties_ref):
        assert torch.equal(f(x, t, torch.tensor([0], device=DEV)).cpu(), want)
    count_sampled(t, torch.tensor([0], device=DEV), torch.tensor([4], device=DEV))  # generated 4: unmasked
    assert apply_penalties(x, t, torch.tensor([0], device=DEV))[0, 7] == 9.0
    reset_slots(t, torch.tensor([0], device=DEV))
    assert t.output_counts[0].sum() == 0 and not t.prompt_mask[0].any() and t.generated[0] == 0


# --------------------------------------------------------------------------- logprobs


def _same_top(logits, ids, rids):
    """Same ids as the reference up to the order (and choice, at the cut) of tied logits."""
    assert torch.equal(ids == -1, rids == -1) and torch.equal(ids[:, 0], rids[:, 0])
    on = ids >= 0
    got = torch.where(on, logits.float().gather(1, ids.clamp(min=0)), 0.0)
    want = torch.where(on, logits.float().gather(1, rids.clamp(min=0)), 0.0)
    assert torch.equal(got, want)
    assert all(len(set(r[1:])) == len(r[1:]) for r in ids.clamp(min=-1).tolist() if r[1] >= 0 and -1 not in r)
    untied = torch.ones_like(on)
    untied[:, 1:] = (got[:, 1:, None] != got[:, None, 1:]).sum(-1) == got.shape[1] - 2
    assert torch.equal(ids[untied], rids[untied])


@pytest.mark.parametrize("S,V,dtype", [(9, 1000, torch.float32), (5, 3001, torch.bfloat16)]
                         + ([(64, 128256, torch.float32)] if ON_GPU else []))
def test_logprobs_match_reference(S, V, dtype):
    from kernels.logprobs import token_logprobs

    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(S, V, generator=g) * 4).to(dtype).to(DEV)
    tokens = torch.randint(0, V, (S,), generator=g).to(DEV)
    n = torch.tensor([(-1, 0, 1, 5, 20)[i % 5] for i in range(S)], dtype=torch.int32, device=DEV)
    ids, lps = token_logprobs(logits, tokens, n)
    rids, rlps = token_logprobs_ref(logits, tokens, n)
    _same_top(logits, ids, rids)
    torch.testing.assert_close(lps, rlps, rtol=0, atol=1e-4)
    x = logits.float()
    rank = (x >= x.gather(1, tokens[:, None])).sum(1)  # column 0: the token's rank (ties count against it)
    assert (ids[n < 0] == -1).all() and (ids[n >= 0, 0] == rank[n >= 0]).all() and (rank >= 1).all()
    ties = (x == x.max(1, keepdim=True).values).sum(1)  # the most likely token: rank 1 but for ties (bf16)
    assert (token_logprobs(logits, torch.argmax(x, 1), n)[0][n >= 0, 0] == ties[n >= 0]).all()
    want = torch.log_softmax(logits.float(), -1)
    assert torch.allclose(lps[n >= 0, 0], want[n >= 0].gather(1, tokens[n >= 0, None])[:, 0], atol=1e-4)


# --------------------------------------------------------------------------- windowed sampler


def _params(S, V, gen, small_k=True):
    """Per-row mixes of greedy / temperature / min-p / top-k / top-p (small and large)."""
    temp = torch.rand(S, generator=gen) * 1.5 + 0.3
    top_k = torch.zeros(S, dtype=torch.int64)
    top_p = torch.ones(S)
    min_p = torch.zeros(S)
    for i in range(S):
        kind = i % 7
        if kind == 0:
            temp[i] = 0.0
        elif kind == 1:
            min_p[i] = 0.05
        elif kind == 2:
            top_k[i] = int(torch.randint(1, 40 if small_k else V, (1,), generator=gen))
        elif kind == 3:
            top_p[i] = float(torch.rand(1, generator=gen)) * 0.95
        elif kind == 4:
            top_k[i], top_p[i] = 50, 0.9
        elif kind == 5:
            top_p[i], min_p[i] = 0.99, 0.1
    seed = torch.randint(-(2**62), 2**62, (S,), generator=gen, dtype=torch.int64)
    pos = torch.randint(0, 2**40, (S,), generator=gen, dtype=torch.int64)
    return [t.to(DEV) for t in (temp, top_k, top_p, min_p, seed, pos)]


@pytest.mark.parametrize("candidates", [8, 64, 1024])
@pytest.mark.parametrize("S,V", [(21, 2000)] + ([(64, 128256)] if ON_GPU else []))
def test_window_sampler_matches_reference(S, V, candidates):
    from kernels.sampling import sample
    from kernels.sampling_window import sample_window

    g = torch.Generator().manual_seed(candidates + V)
    logits = (torch.randn(S, V, generator=g) * 3).to(DEV)
    # the row kernel alone and filtered=False (no window) do not read ``candidates``: in the interpreter they run
    # in one of the cases, the one where both outcomes of the window happen
    rows_too = ON_GPU or candidates == 64
    for small_k in (True, False):
        params = _params(S, V, g, small_k)
        ref = sample_ref(logits, *params)
        got = sample(logits, *params, candidates=candidates, method="window")
        assert torch.equal(got, ref), (got.tolist(), ref.tolist())
        if rows_too:
            assert torch.equal(sample(logits, *params, method="rows"), ref)
        # batch independence: each row alone
        alone = torch.cat([sample(logits[i: i + 1], *[p[i: i + 1] for p in params], candidates=candidates,
                                  method="window") for i in range(0, S, 4)])
        assert torch.equal(alone, ref[0::4])
    # both outcomes of the window happen: rows it finishes and rows left to the row kernel
    out = torch.empty(S, dtype=torch.int64, device=DEV)
    done = torch.empty(S, dtype=torch.int32, device=DEV)
    sample_window(logits, *params, out, done, candidates=candidates)
    filt = (params[1] > 0) | (params[2] < 1)
    assert done[~filt].all() and torch.equal(out[done.bool()], ref[done.bool()])
    if candidates == 64:
        assert done[filt].any() and not done[filt].all()
    # filtered=False: no window, the row kernel does the top-k/top-p rows
    if rows_too:
        assert torch.equal(sample(logits, *params, candidates=candidates, filtered=False, method="window"), ref)


def test_window_sampler_ties():
    """Tied logits across the window's edge and at the thresholds (and -0.0 vs +0.0)."""
    from kernels.sampling import sample

    g = torch.Generator().manual_seed(77)
    S, V = 21, 400
    logits = ((torch.randn(S, V, generator=g) * 0.6).round() / 2).to(DEV)
    params = _params(S, V, g)
    params[0][params[0] > 0] = 0.5
    for cand in (4, 32, 300):
        assert torch.equal(sample(logits, *params, candidates=cand, method="window"), sample_ref(logits, *params))


@pytest.mark.skipif(not ON_GPU, reason="CUDA only")
def test_features_no_sync_and_graph():
    """Penalties -> sample -> logprobs -> count_sampled: no host sync, and a CUDA graph of it replays right."""
    from kernels.logprobs import token_logprobs
    from kernels.penalties import apply_penalties
    from kernels.sampling import sample

    g = torch.Generator().manual_seed(3)
    S, V = 64, 128256
    tables = _penalty_tables(S + 1, V, g, max_bias=300, max_stop=4)
    slots = torch.arange(S, device=DEV)
    logits = (torch.randn(S, V, generator=g) * 3).to(DEV)
    params = _params(S, V, g)
    num_lp = torch.tensor([(-1, 0, 5, 20)[i % 4] for i in range(S)], dtype=torch.int32, device=DEV)
    pen = torch.empty(S, V, device=DEV)
    tok = torch.empty(S, dtype=torch.int64, device=DEV)
    lp_out = (torch.empty(S, 21, dtype=torch.int64, device=DEV), torch.empty(S, 21, device=DEV))

    def step():
        apply_penalties(logits, tables, slots, out=pen)
        sample(pen, *params, out=tok)
        token_logprobs(logits, tok, num_lp, out=lp_out)
        count_sampled(tables, slots, tok)

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        logits.copy_(torch.randn(S, V, generator=g).to(DEV) * 3)
        params[5].add_(1)
        before = PenaltyTables(**{k: v.clone() for k, v in vars(tables).items()})
        graph.replay()
        want_pen = apply_penalties_ref(logits, before, slots)
        want_tok = sample_ref(want_pen, *params)
        assert (tok != want_tok).sum() <= 1  # 1-ulp FMA differences may flip a near tie, nothing more
        ids, lps = token_logprobs_ref(logits, tok, num_lp)
        assert torch.equal(lp_out[0], ids) and torch.allclose(lp_out[1], lps, atol=1e-4)
        assert torch.equal(tables.generated, before.generated + (torch.arange(S + 2, device=DEV) < S))


# --------------------------------------------------------------------------- two-stage top-k


@pytest.mark.parametrize("V,chunk,per_chunk", [(2000, 256, 8), (2003, 256, 30), (300, 256, 400), (4000, 64, 1)])
def test_chunk_candidates_guarantee(V, chunk, per_chunk):
    """Candidates hold the top ``per_chunk`` and everything above ``bound``; nothing outside exceeds it."""
    from kernels.sampling_topk import chunk_candidates

    g = torch.Generator().manual_seed(V + chunk)
    x = ((torch.randn(6, V, generator=g) * 2).round() / 4).to(DEV)  # many ties
    vals, ids, bound = chunk_candidates(x, per_chunk, chunk)
    assert torch.equal(x.gather(1, ids), vals)
    assert all(len(set(r)) == len(r) for r in ids.tolist())  # no id twice
    outside = torch.ones_like(x, dtype=torch.bool).scatter_(1, ids, False)
    assert (x.masked_fill(~outside, float("-inf")).amax(1) <= bound).all()
    assert ((x > bound[:, None]).sum(1) <= (vals > bound[:, None]).sum(1)).all()
    top = torch.topk(x, min(per_chunk, V), dim=1).values
    assert torch.equal(torch.sort(vals, 1, descending=True).values[:, :top.shape[1]], top)
    if per_chunk >= V:
        assert (bound == float("-inf")).all()


@pytest.mark.parametrize("V,chunk,candidates", [(2000, 256, 64), (2003, 256, 512), (2003, 128, 1024)])
def test_window_sampler_chunked(V, chunk, candidates):
    """The two-stage window (several chunks, with and without a tail chunk) stays exact."""
    from kernels.sampling import sample
    from kernels.sampling_window import sample_window

    g = torch.Generator().manual_seed(V + candidates)
    S = 21
    logits = (torch.randn(S, V, generator=g) * 3).to(DEV)
    for small_k in (True, False):
        params = _params(S, V, g, small_k)
        ref = sample_ref(logits, *params)
        assert torch.equal(sample(logits, *params, candidates=candidates, chunk=chunk, method="window"), ref)
    out = torch.empty(S, dtype=torch.int64, device=DEV)
    done = torch.empty(S, dtype=torch.int32, device=DEV)
    sample_window(logits, *params, out, done, candidates=candidates, chunk=chunk)
    assert torch.equal(out[done.bool()], ref[done.bool()]) and done.sum() > S // 2
    ties = ((torch.randn(S, V, generator=g) * 0.6).round() / 2).to(DEV)
    got = sample(ties, *params, candidates=candidates, chunk=chunk, method="window")
    assert torch.equal(got, sample_ref(ties, *params))


def test_sample_flags():
    """greedy_only is argmax; filtered=False gives the same tokens for rows without top-k/top-p."""
    from kernels.sampling import sample

    g = torch.Generator().manual_seed(5)
    S, V = 13, 1500
    logits = (torch.randn(S, V, generator=g) * 3).to(DEV)
    params = _params(S, V, g)
    params[0].zero_()
    assert torch.equal(sample(logits, *params, greedy_only=True), sample_ref(logits, *params))
    params = _params(S, V, g)
    params[1].zero_()
    params[2].fill_(1.0)
    assert torch.equal(sample(logits, *params, filtered=False), sample_ref(logits, *params))


def test_count_sampled_kernel_matches_reference():
    """The one-launch count update equals the torch one, repeated slots and tokens included."""
    from kernels.penalties import count_sampled as count_kernel

    g = torch.Generator().manual_seed(11)
    a = PenaltyTables.allocate(5, 50, DEV)
    b = PenaltyTables.allocate(5, 50, DEV)
    for n in (1, 7, 40):
        slots = torch.randint(0, 5, (n,), generator=g).to(DEV)
        toks = torch.randint(0, 10, (n,), generator=g).to(DEV)
        count_sampled(a, slots, toks)
        count_kernel(b, slots.to(torch.int32), toks)
    assert torch.equal(a.output_counts, b.output_counts) and torch.equal(a.generated, b.generated)
    assert int(b.generated.sum()) == 48
