"""FP8 weights (``quantization: fp8``): the quantization math against torch references, the skinny-matmul kernels
on FP8 weights (Triton's interpreter on the CPU, the GPU where there is one), and a quantized model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from ipc.config import ExecutorConfig
from kernels.e4m3 import to_e4m3
from kernels.fp8 import FP8, FP8_MAX, Fp8Weight, fp8_linear_ref, quantize_rows_ref, quantize_weight
from tests.test_gpu_fastpath import built, write_config

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def test_quantize_weight_scales_and_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 40, generator=g) * torch.tensor([1e-3, 0.02, 1.0, 30.0, 0.5, 0.0])[:, None]
    q = quantize_weight(w)
    assert q.data.dtype == FP8 and q.scale.dtype == torch.float32 and q.dtype == torch.float32
    amax = w.abs().amax(dim=1)
    assert torch.allclose(q.scale[:5], amax[:5] / FP8_MAX) and q.scale[5] > 0  # a zero row: any positive scale
    assert q.data.float().abs().amax(dim=1)[:5].eq(FP8_MAX).all()  # each row's largest value maps to 448
    err = (q.dequantize() - w).abs()
    assert (err <= w.abs() / 16 + q.scale[:, None] * 2 ** -9).all()  # e4m3: 3 mantissa bits, subnormals below 2^-6
    assert q.dequantize()[5].eq(0).all()
    exact = quantize_weight(q.dequantize())  # values on the grid round-trip exactly
    assert torch.equal(exact.dequantize(), q.dequantize())
    parts = q.split([2, 4])
    assert parts[1].data.data_ptr() == q.data[2:].data_ptr() and torch.equal(parts[1].scale, q.scale[2:])
    assert quantize_weight(w.bfloat16()).dtype == torch.bfloat16


def test_quantize_rows_and_linear_reference():
    """Up to 8 rows: exact activations times the dequantized weight (float64 reference); above, each row quantized
    with its own scale (W8A8) and the product of the dequantized operands."""
    g = torch.Generator().manual_seed(1)
    w = quantize_weight(torch.randn(24, 64, generator=g) * 0.05)
    b = torch.randn(24, generator=g)
    x = torch.randn(12, 64, generator=g) * torch.linspace(0.1, 10, 12)[:, None]
    x[3] = 0
    xq, xs = quantize_rows_ref(x)
    assert xq.dtype == FP8 and torch.allclose(xs[:3], x[:3].abs().amax(1) / FP8_MAX) and xq[3].float().eq(0).all()
    wd = w.dequantize().double()
    small = fp8_linear_ref(x[:8], w, b)
    assert torch.allclose(small.double(), x[:8].double() @ wd.T + b.double(), rtol=1e-5, atol=1e-5)
    big = fp8_linear_ref(x, w, b)
    xd = xq.double() * xs.double()[:, None]
    assert torch.allclose(big.double(), xd @ wd.T + b.double(), rtol=1e-5, atol=1e-5)
    assert fp8_linear_ref(x.bfloat16(), Fp8Weight(w.data, w.scale, torch.bfloat16)).dtype == torch.bfloat16


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, to_e4m3(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def test_to_e4m3_rounds_as_torch_casts():
    """Every e4m3 value, every midpoint of two neighbours (ties go to the even one) and the float32 values either side
    of it, float32 bit patterns at random and values of five magnitudes through :func:`kernels.e4m3.to_e4m3`: torch's
    cast, bit for bit (on the GPU, where Triton's own narrowing through float16 rounds twice; in the interpreter,
    which rounds ties away from zero and has no subnormals)."""
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    patterns = torch.randint(0, 2**31 - 1, (20000,), generator=g, dtype=torch.int32).view(torch.float32)
    patterns = patterns[patterns.abs() <= FP8_MAX]  # NaNs and magnitudes beyond e4m3's out
    x = torch.cat([grid, near, -near, patterns, -patterns,
                   *(torch.randn(2000, generator=g) * s for s in (1e-3, 0.02, 1, 30, 200))])
    x = x.clamp(-FP8_MAX, FP8_MAX).to(DEVICE)
    y = torch.empty(x.numel(), dtype=FP8, device=DEVICE)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    assert torch.equal(y.float(), x.to(FP8).float())


def _plain(w: Fp8Weight) -> torch.Tensor:
    return w.dequantize(torch.float32)


def test_fp8_skinny_kernels_match_dequantized():
    """Every skinny-matmul form and fused kernel on an FP8 weight equals the same kernel on the dequantized float32
    weight (the scale applied to the sums instead of the weights: float32 rounding apart)."""
    from kernels import gemv as skinny
    from kernels.gemv_qkv import qkv_rope
    from kernels.gemv_row import gemv_prologue

    g = torch.Generator().manual_seed(2)
    dev = DEVICE
    k, n = 128, 48
    w = quantize_weight(torch.randn(n, k, generator=g).to(dev) * 0.05)
    wf = _plain(w)
    b = torch.randn(n, generator=g).to(dev)
    close = lambda a, r: torch.allclose(a.float(), r.float(), rtol=1e-4, atol=1e-4)  # noqa: E731
    for m, config in ((1, ("row", 8, 64, 4, 2)), (3, ("row", 4, 64, 4, 2)), (4, ("rowk", 4, 64, 4, 2)),
                      (5, ("dot", 16, 64, 4, 2)), (2, ("dotT", 64, 64, 4, 2))):
        x = torch.randn(m, k, generator=g).to(dev)
        assert close(skinny.gemv(x, w, b, config=config), skinny.gemv(x, wf, b, config=config)), (m, config)
        assert close(skinny.gemv(x, w, b, config=config), fp8_linear_ref(x, w, b)), (m, config)
    x, r = torch.randn(3, k, generator=g).to(dev), torch.randn(3, n, generator=g).to(dev)
    h, ss = skinny.gemv_residual(x, w, b, r, config=("dot", 16, 64, 4, 2))
    h_ref, ss_ref = skinny.gemv_residual(x, wf, b, r, config=("dot", 16, 64, 4, 2))
    assert close(h, h_ref) and close(ss, ss_ref)
    gate_up = quantize_weight(torch.randn(2 * n, k, generator=g).to(dev) * 0.05)
    cfg = ("dot", 16, 64, 4, 2)
    assert close(skinny.gemv_silu(x, gate_up, None, config=cfg), skinny.gemv_silu(x, _plain(gate_up), None, config=cfg))
    one, nw = torch.randn(1, k, generator=g).to(dev), torch.rand(k, generator=g).to(dev) + 0.5
    row = ("row", 8, 64, 4, 2)
    assert close(gemv_prologue(one, w, b, config=row, norm=(nw, 1e-5))[0],
                 gemv_prologue(one, wf, b, config=row, norm=(nw, 1e-5))[0])
    gu = torch.randn(1, 2 * k, generator=g).to(dev)
    assert close(gemv_prologue(gu, w, None, config=row, silu=True)[0],
                 gemv_prologue(gu, wf, None, config=row, silu=True)[0])
    heads, hkv, d = 4, 1, 32  # q|k|v rows: (4 + 2) heads of 32
    qkv = quantize_weight(torch.randn((heads + 2 * hkv) * d, k, generator=g).to(dev) * 0.05)
    for m, cfg, norm in ((1, ("row", 16, 64, 4, 2), (nw, 1e-5)), (3, ("row", 4, 64, 4, 2), None),
                         (4, ("dot", 16, 64, 4, 2), None)):
        outs = []
        for weight in (qkv, _plain(qkv)):
            cache = torch.zeros(2, 4, hkv, d, device=dev)
            vcache = torch.zeros_like(cache)
            cos_sin = torch.randn(32, d, generator=g.manual_seed(9)).to(dev)
            q, _ = qkv_rope(torch.ones(m, k, device=dev) * 0.3, weight, None, config=cfg, norm=norm, residual=None,
                            positions=torch.arange(m, device=dev), cos_sin_cache=cos_sin, k_cache=cache,
                            v_cache=vcache, kv_index=torch.arange(m, device=dev))
            outs.append((q, cache, vcache))
        for a, r in zip(*outs):
            assert close(a, r), (m, cfg)


@pytest.mark.skipif(not CUDA, reason="the W8A8 kernels need FP8 tensor cores")
def test_w8a8_matches_reference_gpu():
    from kernels.matmul_fp8 import FP8_MATMUL_CONFIGS, quantize_rows, w8a8_linear

    g = torch.Generator().manual_seed(3)
    for m, n, k in ((16, 256, 512), (77, 384, 1024), (2048, 512, 2048)):
        x = (torch.randn(m, k, generator=g) * 3).cuda().bfloat16()
        w = quantize_weight(torch.randn(n, k, generator=g).cuda().bfloat16() * 0.05)
        b = torch.randn(n, generator=g).cuda().bfloat16()
        xq, xs = quantize_rows(x)
        xq_ref, xs_ref = quantize_rows_ref(x)
        assert torch.equal(xs, xs_ref)
        assert torch.equal(xq.float(), xq_ref.float())
        ref = (xq_ref.double() * xs_ref.double()[:, None]) @ w.dequantize().double().T + b.double()
        for config in (None, *FP8_MATMUL_CONFIGS):
            y = w8a8_linear(x, w, b, config=config)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < 4e-3, (m, n, k, config, err)  # bf16 output rounding


@pytest.mark.skipif(not CUDA, reason="the W8A8 kernels need FP8 tensor cores")
def test_w8a8_tma_tiles_equal_pointer_tiles_bit_for_bit(monkeypatch):
    """On Hopper the Triton W8A8 kernel reads its tiles through tensor descriptors; where rows, columns or depth
    end inside a tile (the descriptor's bounds give zeros there), it still equals the per-thread-load kernel."""
    import kernels.matmul_fp8 as mm

    g = torch.Generator().manual_seed(5)
    for m, n, k in ((16, 256, 512), (77, 200, 1040), (300, 4096, 4096)):
        x = (torch.randn(m, k, generator=g) * 3).cuda().bfloat16()
        w = quantize_weight(torch.randn(n, k, generator=g).cuda().bfloat16() * 0.05)
        b = torch.randn(n, generator=g).cuda().bfloat16()
        xq, xs = mm.quantize_rows(x)
        assert mm._takes_tma(xq, w) == (torch.cuda.get_device_capability() >= (9, 0))
        for config in mm.FP8_MATMUL_CONFIGS:
            with monkeypatch.context() as patch:
                patch.setattr(mm, "_takes_tma", lambda *_: False)
                loads = mm.fp8_matmul(xq, xs, w, b, config=config)
            assert torch.equal(mm.fp8_matmul(xq, xs, w, b, config=config), loads), (m, n, k, config)


def test_norm_and_silu_mul_hand_over_the_rows_quantize_rows_makes():
    """The RMSNorm (with and without its residual add) and the SiLU-mul that write FP8 rows and scales for a W8A8
    matmul give, bit for bit, what the plain kernel followed by ``quantize_rows`` gives (one pass and, for the
    SiLU-mul, two passes over a row); a zero row takes the smallest scale."""
    import kernels.activation as act
    from kernels.matmul_fp8 import quantize_rows
    from kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8

    g = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = (torch.randn(6, 96, generator=g) * torch.linspace(0.01, 30, 6)[:, None]).to(DEVICE, dtype)
    x[2] = 0
    r, w = torch.randn_like(x) * 2, (torch.rand(96, generator=g) + 0.5).to(DEVICE, dtype)

    def same(a, b):
        return torch.equal(a[0].float(), b[0].float()) and torch.equal(a[1], b[1])

    q, s, stream = rms_norm_fp8(x, w, 1e-5)
    assert stream is x and same((q, s), quantize_rows(rms_norm(x, w, 1e-5)))
    h, added = fused_add_rms_norm(x, r, w, 1e-5)
    q, s, stream = rms_norm_fp8(x, w, 1e-5, residual=r)
    assert torch.equal(stream, added) and same((q, s), quantize_rows(h))
    assert s[2] > 0 and q.float().abs().max() <= FP8_MAX
    gate_up = torch.cat([x, r], dim=1)
    want = quantize_rows(act.silu_and_mul(gate_up))
    assert same(act.silu_and_mul_fp8(gate_up), want)
    one_pass, act.ONE_PASS_MAX_I = act.ONE_PASS_MAX_I, 32  # rows wider than that: read twice, 2048 at a time
    try:
        assert same(act.silu_and_mul_fp8(gate_up), want)
    finally:
        act.ONE_PASS_MAX_I = one_pass


def test_w8a8_linears_take_quantized_rows_from_the_norm_and_silu_mul(tmp_path):
    """Above 8 rows a quantized model's norm -> q|k|v and norm -> gate|up -> SiLU-mul -> down hand FP8 rows from
    the norm and the SiLU-mul to the matmuls: the same outputs, bit for bit, as the ops one at a time."""
    from executor_proc.backends.base import NormInput, unfused_mlp, unfused_norm_linear

    model_dir = write_config(tmp_path, hidden=64, intermediate=128, vocab=97)
    dtype = "bfloat16" if CUDA else "float32"
    model = built(model_dir, DEVICE, dtype=dtype, kernels="triton", num_blocks=16, quantization="fp8",
                  cuda_graphs=False).worker.model
    backend, layer = model.backend, model.model.layers[0]
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(2, 12, 64, generator=g) * 3).to(DEVICE, getattr(torch, dtype))
    norm = layer.input_layernorm.weight
    for residual in (None, r):
        pre = NormInput(x, residual, norm, 1e-5)
        qkv = (layer.self_attn.qkv.weight, layer.self_attn.qkv.bias)
        assert isinstance(qkv[0], Fp8Weight)
        got, want = backend.norm_linear(pre, *qkv), unfused_norm_linear(backend, pre, *qkv)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        mlp = layer.mlp
        gate_up, down = (mlp.gate_up.weight, mlp.gate_up.bias), (mlp.down.weight, mlp.down.bias)
        got, want = backend.mlp(pre, gate_up, down), unfused_mlp(backend, pre, gate_up, down)
        assert torch.equal(got.x, want.x) and torch.equal(got.residual, want.residual)


def test_config_refuses_fp8_batch_invariant():
    with pytest.raises(ValueError, match="quantization 'fp8' cannot run batch_invariant"):
        ExecutorConfig(quantization="fp8", batch_invariant=True, kernels="triton")
    for flags, words in ((dict(quantization="fp8"), "--quantization fp8 needs a model"),
                         (dict(kv_cache_dtype="fp8"), "--kv-cache-dtype fp8 needs a model")):
        with pytest.raises(ValueError, match=words):  # the scripted executor has no weights and no KV cache
            ExecutorConfig(load_format="scripted", **flags)


def test_quantized_model_runs_and_counts_fp8_bytes(tmp_path):
    """A dummy model quantized at load: layer weights in FP8 with scales (the embedding and LM head not), the
    memory plan's weight bytes from them, logits near the unquantized model's, and the torch path's and the
    Triton path's (interpreter on the CPU) equal."""
    from tests.forward_batch import all_logits, build_forward_batch

    model_dir = write_config(tmp_path, hidden=64, intermediate=128, vocab=97)
    ref = built(model_dir, DEVICE, kernels="torch", num_blocks=16)
    fp8 = built(model_dir, DEVICE, kernels="torch", num_blocks=16, quantization="fp8")
    tri = built(model_dir, DEVICE, kernels="triton", num_blocks=16, quantization="fp8", cuda_graphs=False)
    model = fp8.worker.model
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.weight.dtype == FP8 and layer.mlp.down_proj.weight_scale.dtype == torch.float32
    assert isinstance(layer.mlp.gate_up.weight, Fp8Weight) and model.lm_head.weight.dtype == torch.float32
    assert fp8.plan.weights < ref.plan.weights * 0.75
    for rows in ([(0, list(range(3, 15)), 0, True)], [(0, [5], 0, True), (1, [7, 8], 0, True)]):  # W8A8, W8A16
        # a block table of its own per row: rows sharing one would write their KV to the same places (on a GPU in
        # no fixed order, so each model would read a different cache)
        tables = [[1 + 4 * i + j for j in range(4)] for i in range(len(rows))]
        batch = build_forward_batch(rows, tables, 4, DEVICE)
        batch = dataclasses.replace(batch, query_start=batch.query_start.int(), context_lens=batch.context_lens.int(),
                                    block_tables=batch.block_tables.int())
        a = all_logits(ref.worker.model, batch, ref.worker.kv_cache)
        b = all_logits(model, batch, fp8.worker.kv_cache)
        c = all_logits(tri.worker.model, batch, tri.worker.kv_cache)
        # quantization error, small (a 2-layer random model of hidden 64: 4% on the CPU's weights, 6% on a GPU's)
        assert (a - b).abs().max() < 0.1 * a.abs().max()
        if not CUDA:  # the same arithmetic
            assert torch.allclose(b, c, rtol=1e-3, atol=2e-3 * b.abs().max().item())
        else:  # measured on an H200: 0.9% (norm), 1.35% of the largest logit at most, on the 12-token prefill (W8A8)
            # rows; the Triton path's float32 dots run in tf32 and FP8 tensor cores sum with fewer bits, the cause
            # is not pinned down further
            assert (b - c).norm() < 0.02 * b.norm()


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_fp8_graphs_match_eager_gpu(tmp_path):
    """Decode steps replayed from CUDA graphs give the eager steps' tokens (the same tuned kernels)."""
    from tests.test_gpu_fastpath import run_plans, scenario

    model_dir = write_config(tmp_path)
    plans = scenario(vocab=97, steps=10, alone_from=8)
    graphs = built(model_dir, "cuda", kernels="triton", quantization="fp8").worker
    eager = built(model_dir, "cuda", kernels="triton", quantization="fp8", cuda_graphs=False).worker
    eager.model.backend.use_choices_of(graphs.model.backend)
    assert [t for _, t in run_plans(graphs, plans)] == [t for _, t in run_plans(eager, plans)]
