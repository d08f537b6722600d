"""Triton kernels against their torch references.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set
below before any kernel module is imported) at small shapes.  With CUDA the same
tests run on the GPU, plus larger shapes and CUDA-graph / no-sync checks.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from kernels import reference as R  # noqa: E402
from kernels.sampling_ref import hash_uniform, sample as sample_ref  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: inf - inf in masked lanes


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite output (unwritten element?)"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def tol(dtype) -> float:
    return 2e-5 if dtype == torch.float32 else 1e-2


def poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-12345)


def make_paged(lens, block_size, Hkv, D, dtype, extra_blocks=3, gen=None):
    """Random cache and shuffled block tables for rows of the given lengths."""
    nb_row = [max(1, (n + block_size - 1) // block_size) for n in lens]
    max_blocks = max(nb_row) + 1
    num_blocks = sum(nb_row) + extra_blocks
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype).to(DEV)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype).to(DEV)
    perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    i = 0
    for r, nb in enumerate(nb_row):
        bt[r, :nb] = perm[i : i + nb].to(torch.int32)
        i += nb
    return k_cache, v_cache, bt.to(DEV)


# --------------------------------------------------------------------------- decode attention

DECODE_CASES = [
    # (dtype, block_size, num_splits, H, Hkv, D)
    (torch.float32, 16, 1, 8, 2, 32),
    (torch.float32, 16, 3, 8, 2, 32),
    (torch.float32, 32, 8, 4, 4, 64),
    (torch.float32, 1, 2, 8, 1, 32),
    (torch.float32, 16, 4, 9, 3, 48),  # G = 3 (SmolLM2), head_dim not a power of two
    (torch.bfloat16, 16, 1, 8, 2, 32),
    (torch.bfloat16, 16, 4, 8, 2, 64),
    (torch.bfloat16, 32, 2, 16, 2, 32),
    (torch.bfloat16, 1, 4, 8, 2, 32),
]


@pytest.mark.parametrize("dtype,block_size,num_splits,H,Hkv,D", DECODE_CASES)
def test_decode_attention(dtype, block_size, num_splits, H, Hkv, D):
    from kernels.decode_attention import DecodeWorkspace, decode_attention

    g = torch.Generator().manual_seed(block_size * 100 + num_splits * 10 + H)
    lens = [0, 1, 17, 75, 130]
    kc, vc, bt = make_paged(lens, block_size, Hkv, D, dtype, gen=g)
    B = len(lens)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ws = DecodeWorkspace(B + 2, H, D, max_splits=8, device=DEV)
    poison(ws.partial_out), poison(ws.partial_m), poison(ws.partial_l)
    scale = D ** -0.5
    for _ in range(2):  # the second call finds the arrival counters re-armed by the first's mergers
        q = torch.randn(B, H, D, generator=g).to(dtype).to(DEV)
        out = poison(torch.empty_like(q))
        decode_attention(q, kc, vc, bt, cl, scale, out=out, workspace=ws, num_splits=num_splits, block_n=16)
        ref = R.decode_attention_ref(q, kc, vc, bt, cl, scale)
        assert (out[0] == 0).all()  # empty row
        assert rel_err(out, ref) < tol(dtype)
        assert (ws.arrivals == 0).all()


def test_decode_attention_more_rows_than_the_workspace_batch():
    """A call of more rows than the workspace's batch (a speculative step's positions as decode rows) takes fewer
    splits, its partials packed into the same buffers, and gives the reference's output."""
    from kernels.decode_attention import DecodeWorkspace, decode_attention

    g = torch.Generator().manual_seed(11)
    lens = [1, 17, 75, 130, 40, 9]
    H, Hkv, D = 8, 2, 32
    kc, vc, bt = make_paged(lens, 16, Hkv, D, torch.float32, gen=g)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ws = DecodeWorkspace(2, H, D, max_splits=4, device=DEV, max_rows=len(lens))
    assert ws.splits_for(2) == 4 and ws.splits_for(3) == 2 and ws.splits_for(6) == 1
    poison(ws.partial_out), poison(ws.partial_m), poison(ws.partial_l)
    for rows in (3, 4):  # 2 splits, packed into the 2-row buffers
        q = torch.randn(rows, H, D, generator=g).to(DEV)
        out = poison(torch.empty_like(q))
        decode_attention(q, kc, vc, bt[:rows], cl[:rows], D ** -0.5, out=out, workspace=ws, num_splits=2, block_n=16)
        assert rel_err(out, R.decode_attention_ref(q, kc, vc, bt[:rows], cl[:rows], D ** -0.5)) < tol(torch.float32)
        assert (ws.arrivals == 0).all()
    with pytest.raises(AssertionError):  # 6 rows keep 1 split's partials: 2 would overrun the buffers
        decode_attention(q.new_zeros(6, H, D), kc, vc, bt, cl, 1.0, workspace=ws, num_splits=2)
    # room for 2 splits of every row count (batch-invariant attention keeps its split count past the batch)
    ws = DecodeWorkspace(2, H, D, max_splits=4, device=DEV, max_rows=len(lens), min_splits=2)
    assert ws.splits_for(2) == 4 and ws.splits_for(6) == 2
    poison(ws.partial_out), poison(ws.partial_m), poison(ws.partial_l)
    q = torch.randn(6, H, D, generator=g).to(DEV)
    out = poison(torch.empty_like(q))
    decode_attention(q, kc, vc, bt, cl, D ** -0.5, out=out, workspace=ws, num_splits=2, block_n=16)
    assert rel_err(out, R.decode_attention_ref(q, kc, vc, bt, cl, D ** -0.5)) < tol(torch.float32)


def test_one_row_takes_more_splits_in_the_same_workspace(monkeypatch):
    """At one row the default rule gives up to 32 splits (16 past it), and a workspace for 64 rows holds them without
    growing: its partials are 64 rows' 16 splits, which a few rows' 32 fit in; the output is the reference's."""
    import kernels.decode_attention as attention
    from kernels.decode_attention import DecodeWorkspace, decode_attention, default_num_splits

    monkeypatch.setattr(attention, "_num_sms", lambda device: 132)
    assert [default_num_splits(r, 8, "cpu", head_dim=128) for r in (1, 2, 3, 4, 8)] == [32, 16, 16, 16, 8]
    assert [default_num_splits(r, 8, "cpu", head_dim=64) for r in (1, 2, 4, 16)] == [32, 16, 16, 8]
    assert default_num_splits(1, 8, "cpu", 16, 128) == 16  # a workspace of 16 splits caps the rule
    ws = DecodeWorkspace(64, 8, 32, device=DEV)
    assert ws.max_splits == 32 and ws.capacity == 64 * 16 and ws.splits_for(2) == 32 and ws.splits_for(64) == 16
    g = torch.Generator().manual_seed(12)
    lens = [700, 33]
    kc, vc, bt = make_paged(lens, 16, 2, 32, torch.float32, gen=g)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(2, 8, 32, generator=g).to(DEV)
    poison(ws.partial_out), poison(ws.partial_m), poison(ws.partial_l)
    out = decode_attention(q, kc, vc, bt, cl, 32 ** -0.5, workspace=ws, num_splits=32, block_n=16)
    assert rel_err(out, R.decode_attention_ref(q, kc, vc, bt, cl, 32 ** -0.5)) < tol(torch.float32)
    assert (ws.arrivals == 0).all()


@pytest.mark.skipif(not ON_GPU, reason="large shapes on CUDA only")
@pytest.mark.parametrize("D", [64, 128])
def test_decode_attention_large(D):
    from kernels.decode_attention import decode_attention

    g = torch.Generator().manual_seed(D)
    lens = torch.randint(1, 3000, (12,), generator=g).tolist()
    kc, vc, bt = make_paged(lens, 16, 8, D, torch.bfloat16, gen=g)
    q = torch.randn(len(lens), 32, D, generator=g).bfloat16().to(DEV)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for ns in (None, 1, 16):
        out = poison(torch.empty_like(q))
        decode_attention(q, kc, vc, bt, cl, D ** -0.5, out=out, num_splits=ns)
        assert rel_err(out, R.decode_attention_ref(q, kc, vc, bt, cl, D ** -0.5)) < 1e-2


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need CUDA")
def test_decode_attention_cuda_graph():
    from kernels.decode_attention import DecodeWorkspace, decode_attention

    g = torch.Generator().manual_seed(7)
    B, H, Hkv, D, bs = 8, 32, 8, 64, 16
    lens = [1000] * B
    kc, vc, bt = make_paged(lens, bs, Hkv, D, torch.bfloat16, gen=g)
    q = torch.randn(B, H, D, generator=g).bfloat16().to(DEV)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ws = DecodeWorkspace(B, H, D, device=DEV)
    out = torch.empty_like(q)
    decode_attention(q, kc, vc, bt, cl, 0.125, out=out, workspace=ws, num_splits=4)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(q, kc, vc, bt, cl, 0.125, out=out, workspace=ws, num_splits=4)
    for new_lens in ([5, 1, 999, 64, 0, 300, 17, 1000], [1000] * B):
        cl.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn(B, H, D, generator=g).bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, R.decode_attention_ref(q, kc, vc, bt, cl, 0.125)) < 1e-2


# --------------------------------------------------------------------------- KV write / rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write(dtype):
    from kernels.kv_write import kv_write

    g = torch.Generator().manual_seed(1)
    T, Hkv, D, bs, nb = 9, 2, 32, 16, 4
    k = torch.randn(T, Hkv, D, generator=g).to(dtype).to(DEV)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype).to(DEV)
    kv_index = torch.randperm(nb * bs, generator=g)[:T]
    kv_index[[2, 5]] = -1
    kv_index = kv_index.to(DEV)
    kc = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype).to(DEV)
    vc = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype).to(DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    kv_write(k, v, kc, vc, kv_index)
    R.kv_write_ref(k, v, kc2, vc2, kv_index)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kv_write(dtype):
    from kernels.kv_write import rope_kv_write

    g = torch.Generator().manual_seed(2)
    T, H, Hkv, D, bs, nb = 7, 8, 2, 64, 16, 3
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype).to(DEV)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    cs = R.rope_cos_sin_cache(inv_freq, 4096).to(DEV)
    pos = torch.randint(0, 4096, (T,), generator=g).to(DEV)
    kv_index = torch.randperm(nb * bs, generator=g)[:T]
    kv_index[3] = -1
    kv_index = kv_index.to(DEV)
    kc = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype).to(DEV)
    vc = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype).to(DEV)
    kc2, vc2 = kc.clone(), vc.clone()
    q_out = poison(torch.empty_like(q))
    rope_kv_write(q, k, v, pos, cs, kc, vc, kv_index, q_out=q_out)
    q_ref = R.rope_kv_write_ref(q, k, v, pos, cs, kc2, vc2, kv_index)
    assert rel_err(q_out, q_ref) < tol(dtype)
    assert rel_err(kc, kc2) < tol(dtype) and torch.equal(vc, vc2)
    # with Qwen3's per-head q and k norms first (the same launch), against the norms one by one
    qw, kw = [(1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEV) for _ in range(2)]
    kc3, vc3 = kc.clone(), vc.clone()
    q_normed = rope_kv_write(q, k, v, pos, cs, kc, vc, kv_index, qk_norm=(qw, kw, 1e-6))
    q_ref = R.rope_kv_write_ref(R.rms_norm_ref(q, qw, 1e-6), R.rms_norm_ref(k, kw, 1e-6), v, pos, cs, kc3, vc3,
                                kv_index)
    assert rel_err(q_normed, q_ref) < tol(dtype)
    assert rel_err(kc, kc3) < tol(dtype) and torch.equal(vc, vc3)
    # in place on the fused buffer
    q_ref = R.rope_kv_write_ref(q, k, v, pos, cs, kc2, vc2, kv_index)
    q_ip = rope_kv_write(q, k, v, pos, cs, kc, vc, kv_index, q_out=q)
    assert q_ip.data_ptr() == q.data_ptr() and rel_err(q, q_ref) < tol(dtype)


# --------------------------------------------------------------------------- norm / activation


@pytest.mark.parametrize("dtype,N", [(torch.float32, 96), (torch.bfloat16, 256), (torch.bfloat16, 576)])
def test_rms_norm(dtype, N):
    from kernels.norm import fused_add_rms_norm, rms_norm

    g = torch.Generator().manual_seed(N)
    T = 6
    x = (torch.randn(T, N, generator=g) * 3).to(dtype).to(DEV)
    res = torch.randn(T, N, generator=g).to(dtype).to(DEV)
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype).to(DEV)
    out = poison(torch.empty_like(x))
    rms_norm(x, w, 1e-5, out=out)
    assert rel_err(out, R.rms_norm_ref(x, w, 1e-5)) < tol(dtype) / 2
    o2, r2 = poison(torch.empty_like(x)), poison(torch.empty_like(x))
    fused_add_rms_norm(x, res, w, 1e-5, out=o2, residual_out=r2)
    ro, rr = R.fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(r2, rr) and rel_err(o2, ro) < tol(dtype) / 2
    # in place (vLLM style): x <- normed, residual <- x + residual
    x2, res2 = x.clone(), res.clone()
    fused_add_rms_norm(x2, res2, w, 1e-5, out=x2, residual_out=res2)
    assert torch.equal(res2, rr) and rel_err(x2, ro) < tol(dtype) / 2


@pytest.mark.parametrize("dtype,I", [(torch.float32, 100), (torch.bfloat16, 3000)])
def test_silu_and_mul(dtype, I):
    from kernels.activation import silu_and_mul

    g = torch.Generator().manual_seed(I)
    x = (torch.randn(5, 2 * I, generator=g) * 2).to(dtype).to(DEV)
    out = poison(torch.empty(5, I, dtype=dtype, device=DEV))
    silu_and_mul(x, out=out)
    assert rel_err(out, R.silu_and_mul_ref(x)) < tol(dtype) / 2


# --------------------------------------------------------------------------- sampling


def _sampling_params(S, V, gen):
    temp = torch.rand(S, generator=gen) * 1.5 + 0.2
    top_k = torch.zeros(S, dtype=torch.int32)
    top_p = torch.ones(S)
    min_p = torch.zeros(S)
    for i in range(S):
        kind = i % 8
        if kind == 0:
            temp[i] = 0.0  # greedy
        elif kind == 2:
            top_k[i] = int(torch.randint(1, min(V, 200), (1,), generator=gen))
        elif kind == 3:
            top_p[i] = float(torch.rand(1, generator=gen)) * 0.9 + 0.05
        elif kind == 4:
            min_p[i] = float(torch.rand(1, generator=gen)) * 0.2
        elif kind == 5:
            top_k[i] = int(torch.randint(1, V, (1,), generator=gen))
            top_p[i] = float(torch.rand(1, generator=gen)) * 0.9 + 0.05
        elif kind == 6:
            top_k[i] = 40
            top_p[i] = 0.9
            min_p[i] = 0.02
        elif kind == 7:
            top_k[i] = V  # off
            top_p[i] = 1.0
    seed = torch.randint(-(2**62), 2**62, (S,), generator=gen, dtype=torch.int64)
    pos = torch.randint(0, 2**40, (S,), generator=gen, dtype=torch.int64)
    return [t.to(DEV) for t in (temp, top_k, top_p, min_p, seed, pos)]


def test_hash_matches_reference_bits():
    from kernels.sampling import hash_uniform_triton

    g = torch.Generator().manual_seed(0)
    S, V = 6, 3001
    seed = torch.randint(-(2**63), 2**63 - 1, (S,), generator=g, dtype=torch.int64)
    seed[0], seed[1] = 0, -1
    pos = torch.randint(0, 2**62, (S,), generator=g, dtype=torch.int64)
    pos[0] = 0
    seed, pos = seed.to(DEV), pos.to(DEV)
    a = hash_uniform_triton(seed, pos, V)
    b = hash_uniform(seed, pos, V)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert 0.0 < float(b.min()) and float(b.max()) < 1.0


@pytest.mark.parametrize("S,V,dtype", [(16, 1000, torch.float32), (8, 3001, torch.bfloat16)]
                         + ([(64, 32000, torch.float32), (24, 128256, torch.bfloat16)] if ON_GPU else []))
def test_sample_matches_reference(S, V, dtype):
    from kernels.sampling import sample

    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(S, V, generator=g) * 4).to(dtype).to(DEV)
    params = _sampling_params(S, V, g)
    out = poison(torch.empty(S, dtype=torch.int64, device=DEV))
    sample(logits, *params, out=out)
    ref = sample_ref(logits.float(), *params)
    assert torch.equal(out, ref), (out.tolist(), ref.tolist())
    # batch composition does not matter: each row alone, and the batch reversed
    alone = torch.cat([sample(logits[i : i + 1], *[p[i : i + 1] for p in params]) for i in range(0, S, 3)])
    assert torch.equal(alone, ref[0::3])
    rev = sample(logits.flip(0), *[p.flip(0) for p in params])
    assert torch.equal(rev.flip(0), ref)


def test_sample_ties_match_reference():
    """Heavily tied logits (and -0.0 vs +0.0): thresholds keep or drop ties together."""
    from kernels.sampling import sample

    g = torch.Generator().manual_seed(100)
    S, V = 24, 300
    logits = (torch.randn(S, V, generator=g) * 0.6).round() / 2  # mostly +-0.0, a few +-0.5
    params = _sampling_params(S, V, g)
    params[0][params[0] > 0] = 0.5  # exact reciprocal: ties survive the temperature
    on = params[1] > 0  # top-k threshold exactly at the zeros (some of them -0.0)
    params[1][on] = ((logits.to(DEV) > 0).sum(-1)[on] + 1).to(torch.int32)
    logits = logits.to(DEV)
    out = poison(torch.empty(S, dtype=torch.int64, device=DEV))
    sample(logits, *params, out=out)
    assert torch.equal(out, sample_ref(logits, *params))


def test_sample_ref_distribution():
    """The reference samples softmax(logits / T) restricted by top-k / top-p / min-p."""
    g = torch.Generator().manual_seed(5)
    V, N = 8, 40000
    logits = torch.randn(V, generator=g) * 1.5
    base = dict(temperature=torch.full((N,), 0.8), top_k=torch.zeros(N, dtype=torch.int64),
                top_p=torch.ones(N), min_p=torch.zeros(N), seed=torch.full((N,), 1234, dtype=torch.int64),
                position=torch.arange(N, dtype=torch.int64))
    probs = torch.softmax(logits / 0.8, -1)
    order = probs.argsort(descending=True)
    for change, keep in (({}, V), ({"top_k": torch.full((N,), 3)}, 3), ({"top_p": torch.full((N,), 0.6)}, None),
                         ({"min_p": torch.full((N,), 0.15)}, None)):
        kw = {**base, **change}
        tok = sample_ref(logits.expand(N, V).contiguous(), **kw)
        freq = torch.bincount(tok, minlength=V).double() / N
        want = probs.double().clone()
        if "top_k" in change:
            want[order[keep:]] = 0
        if "top_p" in change:
            cum = torch.cumsum(probs[order], 0) - probs[order]
            want[order[cum >= 0.6]] = 0
        if "min_p" in change:
            want[probs < 0.15 * probs.max()] = 0
        want /= want.sum()
        assert (freq - want).abs().max() < 0.012, (freq, want)
        assert (freq[want == 0] == 0).all()


@pytest.mark.skipif(not ON_GPU, reason="CUDA only")
def test_sampling_no_sync_and_graph():
    from kernels.sampling import sample

    g = torch.Generator().manual_seed(9)
    S, V = 32, 50000
    logits = torch.randn(S, V, generator=g).to(DEV) * 3
    params = _sampling_params(S, V, g)
    sample(logits, *params)
    sample_ref(logits, *params)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, *params)
        sample_ref(logits, *params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = torch.empty(S, dtype=torch.int64, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample(logits, *params, out=out)
    for _ in range(2):
        logits.copy_(torch.randn(S, V, generator=g) * 3)
        params[5].add_(1)
        graph.replay()
        assert torch.equal(out, sample_ref(logits, *params))
