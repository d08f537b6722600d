"""``kv_cache_dtype: fp8``: the paged KV cache in e4m3 (scale 1). Writes (the rotary + cache-write kernel, the fused
q|k|v epilogue, the torch reference) clamp and round like torch; decode and prefill attention read it against the
reference on the dequantized cache; the memory plan counts half the bytes; a model runs on it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference as R
from kernels.fp8 import FP8

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _cache(blocks: int, bs: int, hkv: int, d: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(blocks, bs, hkv, d, generator=g) * 4).clamp(-448, 448).to(FP8).to(DEV)


def test_reference_store_clamps_and_rounds():
    cache = torch.zeros(2, 4, 1, 4, dtype=FP8)
    k = torch.tensor([[[1.0, 1000.0, -1e4, 0.3]]])
    R.kv_store(k, k, cache, cache.clone(), torch.tensor([5]))
    assert cache.view(-1, 4)[5].float().tolist() == [1.0, 448.0, -448.0, torch.tensor(0.3).to(FP8).item()]


@pytest.mark.parametrize("dtype,D", [(torch.float32, 32), (torch.bfloat16, 32), (torch.bfloat16, 40)])
def test_attention_reads_fp8_cache(dtype, D):
    from kernels.decode_attention import decode_attention
    from kernels.prefill_attention import prefill_attention

    g = torch.Generator().manual_seed(0)
    H, Hkv, bs = 4, 2, 8  # head_dim 40: padded to 64, e4m3 read two a word up to dim 40
    kc, vc = _cache(12, bs, Hkv, D, g), _cache(12, bs, Hkv, D, g)
    bt = torch.randperm(12, generator=g)[:10].reshape(2, 5).int().to(DEV)
    lens = torch.tensor([37, 19], dtype=torch.int32, device=DEV)
    q = torch.randn(2, H, D, generator=g).to(dtype).to(DEV)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ks, vs = 0.05, 0.2  # stored = value / scale: the reference reads the dequantized cache
    kd, vd = kc.float() * ks, vc.float() * vs
    out = decode_attention(q, kc, vc, bt, lens, D ** -0.5, num_splits=2, kv_scale=(ks, vs))
    ref = R.decode_attention_ref(q.float(), kd, vd, bt, lens, D ** -0.5)
    assert torch.allclose(out.float(), ref, atol=tol, rtol=tol)
    qp = torch.randn(7, H, D, generator=g).to(dtype).to(DEV)  # 3 + 4 new tokens of the two rows
    qs = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEV)
    out = prefill_attention(qp, kc, vc, bt, qs, lens, 7, D ** -0.5, kv_scale=(ks, vs))
    ref = R.prefill_attention_ref(qp.float(), kd, vd, bt, qs, lens, D ** -0.5)
    assert torch.allclose(out.float(), ref, atol=tol, rtol=tol)


def test_rope_kv_write_into_fp8_cache():
    from kernels.kv_write import rope_cos_sin_cache, rope_kv_write

    g = torch.Generator().manual_seed(1)
    T, H, Hkv, D = 3, 4, 2, 16
    q, k, v = (torch.randn(T, h, D, generator=g).to(DEV) * scale for h, scale in ((H, 1), (Hkv, 200), (Hkv, 30)))
    cs = rope_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)).to(DEV), 64)
    pos, idx = torch.tensor([3, 9, 20], device=DEV), torch.tensor([1, 6, -1], device=DEV)
    kc, vc = torch.zeros(2, 4, Hkv, D, dtype=FP8, device=DEV), torch.zeros(2, 4, Hkv, D, dtype=FP8, device=DEV)
    rk, rv = torch.zeros(2, 4, Hkv, D, device=DEV), torch.zeros(2, 4, Hkv, D, device=DEV)
    rope_kv_write(q.clone(), k, v, pos, cs, kc, vc, idx, kv_scale=(1.0, 0.25))
    R.rope_kv_write_ref(q.clone(), k, v, pos, cs, rk, rv, idx)
    for got, want, inv in ((kc, rk, 1.0), (vc, rv, 4.0)):
        same = got.float() == R.to_cache_dtype(want, FP8, inv).float()
        # the GPU rounds as torch; Triton's interpreter drops the carry when a mantissa rounds up to the next power
        # of two (31.4 -> 16, not 32): a few values on the CPU
        assert same.all() if CUDA else same.float().mean() > 0.9, same.float().mean()
    assert kc.float().abs().max() == 448  # clamped, not NaN


def test_model_on_fp8_kv_cache(tmp_path, monkeypatch):
    """The memory plan's block bytes shrink with the element size, and a model's logits on an FP8 cache stay near the
    float32 cache's, on the torch path and on the Triton kernels (equal to the torch path's on a GPU)."""
    from tests.forward_batch import all_logits, build_forward_batch
    from tests.test_gpu_fastpath import built, write_config

    import executor_proc.model.kv_scales as kv_scales

    monkeypatch.setattr(kv_scales, "CALIBRATION_TOKENS", 24)  # a short calibration prefill (the interpreter is slow)
    model_dir = write_config(tmp_path)
    ref = built(model_dir, DEV, kernels="torch", num_blocks=16)
    fp8 = built(model_dir, DEV, kernels="torch", num_blocks=16, kv_cache_dtype="fp8")
    tri = built(model_dir, DEV, kernels="triton", num_blocks=16, kv_cache_dtype="fp8", cuda_graphs=False)
    assert fp8.worker.kv_cache.k[0].dtype == FP8 and fp8.plan.block_bytes * 4 == ref.plan.block_bytes  # vs float32
    scales = fp8.worker.kv_cache.scales  # calibrated per layer at start-up (executor_proc/model/kv_scales.py)
    assert len(scales) == 2 and all(0 < s < 1 for pair in scales for s in pair)
    assert torch.allclose(torch.tensor(scales), torch.tensor(tri.worker.kv_cache.scales), rtol=1e-3)
    for rows in ([(0, list(range(3, 12)), 0, True)], [(0, [5], 9, True)]):  # a prefill, then a decode row on it
        batch = build_forward_batch(rows, [[1, 2, 3, 4]], 4, DEV)
        batch = dataclasses.replace(batch, query_start=batch.query_start.int(), context_lens=batch.context_lens.int(),
                                    block_tables=batch.block_tables.int())
        a, b, c = (all_logits(w.worker.model, batch, w.worker.kv_cache) for w in (ref, fp8, tri))
        assert (a - b).abs().max() < 0.05 * a.abs().max()
        if CUDA:  # the same cache bytes (the interpreter's FP8 stores miss some carries: test_rope_kv_write_...)
            assert torch.allclose(b, c, atol=2e-3 * b.abs().max().item(), rtol=1e-3)
        else:
            assert (a - c).abs().max() < 0.1 * a.abs().max()


def test_fused_qkv_epilogue_writes_fp8_cache():
    """The one-token q|k|v matmul with the rotary and cache write as its epilogue (kernels/gemv_qkv.py)."""
    from kernels.gemv_qkv import qkv_rope

    g = torch.Generator().manual_seed(2)
    hkv, d, k = 1, 32, 64
    w = (torch.randn((4 + 2 * hkv) * d, k, generator=g) * 0.3).to(DEV)
    x, cs = torch.randn(1, k, generator=g).to(DEV), torch.randn(8, d, generator=g).to(DEV)
    caches = []
    for dtype in (torch.float32, FP8):
        kc, vc = torch.zeros(2, 4, hkv, d, dtype=dtype, device=DEV), torch.zeros(2, 4, hkv, d, dtype=dtype, device=DEV)
        qkv_rope(x, w, None, config=("row", 16, 64, 4, 2), norm=(torch.ones(k, device=DEV), 1e-5), residual=None,
                 positions=torch.tensor([3], device=DEV), cos_sin_cache=cs, k_cache=kc, v_cache=vc,
                 kv_index=torch.tensor([5], device=DEV), kv_scale=(0.5, 0.125) if dtype == FP8 else (1.0, 1.0))
        caches.append((kc, vc))
    for want, got, inv in zip(*caches, (2.0, 8.0)):
        assert want.abs().max() > 0
        same = got.float() == R.to_cache_dtype(want, FP8, inv).float()
        assert same.all() if CUDA else same.float().mean() > 0.9


def test_host_tier_moves_fp8_blocks_bit_exact():
    """Backups to the host KV tier and onloads back move an FP8 cache's blocks byte for byte."""
    from types import SimpleNamespace

    from executor_proc.model.kv_cache import KVCache, kv_cache_bytes_per_block
    from executor_proc.step.host_kv import HostKV
    from executor_proc.step.staging import PinnedStaging
    from tests.test_host_kv_gpu import diff_plan, run_copies

    config = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)
    assert kv_cache_bytes_per_block(config, 4, FP8) * 2 == kv_cache_bytes_per_block(config, 4, torch.bfloat16)
    kv = KVCache(config, num_blocks=6, block_size=4, device=DEV, dtype=FP8)
    kv.storage.copy_(torch.randn(kv.storage.shape, generator=torch.Generator().manual_seed(0)).to(DEV).to(FP8))
    original = kv.storage.clone()
    hk, staging = HostKV(kv, num_blocks=3, device=torch.device(DEV)), PinnedStaging(torch.device(DEV))
    run_copies(hk, staging, diff_plan(0, backups=[4, 1]))  # device 4 -> host 1
    run_copies(hk, staging, diff_plan(1, onloads=[1, 2]))  # host 1 -> device 2
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(kv.storage[:, :, 2].view(torch.uint8), original[:, :, 4].view(torch.uint8))


def test_fp8_decode_attention_rows_keep_their_bits_with_a_pinned_tile():
    """An FP8 cache's tile depends on the call's row count (long tiles for a few rows); with ``config_rows`` (what a
    batch-invariant backend passes) a row's output is bit-identical whether it is alone or one of 12 rows."""
    from kernels.decode_attention import FP8_FEW_ROWS, decode_attention

    g = torch.Generator().manual_seed(3)
    H, Hkv, D, bs, rows = 4, 2, 32, 16, FP8_FEW_ROWS + 4
    kc, vc = _cache(rows * 24, bs, Hkv, D, g), _cache(rows * 24, bs, Hkv, D, g)
    bt = torch.randperm(rows * 24, generator=g).reshape(rows, 24).int().to(DEV)
    lens = torch.randint(200, 24 * bs, (rows,), generator=g).int().to(DEV)
    q = torch.randn(rows, H, D, generator=g).bfloat16().to(DEV)

    def row0(n, **kw):
        return decode_attention(q[:n], kc, vc, bt[:n], lens[:n], D ** -0.5, num_splits=2, **kw)[0]

    assert torch.equal(row0(1, config_rows=rows), row0(rows, config_rows=rows))
