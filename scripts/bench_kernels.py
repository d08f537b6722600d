#!/usr/bin/env python3
"""Check and time the Triton kernels on a CUDA GPU.

    python3 scripts/bench_kernels.py [--json PATH] [--sweep] [--quick]

(a) correctness at real shapes against the torch references;
(b) paged decode attention at batch 64, contexts 1k/4k/16k, Llama-3.2-1B (32/8 heads,
    D=64) and Llama-3-8B (32/8, D=128) shapes, block size 16, bf16: time (median of
    ``triton.testing.do_bench``, L2 flushed between runs), achieved bandwidth = KV bytes
    read / time, as a fraction of the device-to-device copy bandwidth measured in the
    same run (read + write bytes), next to torch SDPA over a gathered contiguous cache;
    ``--sweep`` also tries BLOCK_N / num_warps / num_stages / num_splits variants;
(c) brief timings of the other kernels.
Prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch


DRY = "--dry" in sys.argv  # tiny shapes on the CPU interpreter: checks that the script runs
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.interpreter_patch import patch_interpreter  # noqa: E402

patch_interpreter()

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import reference as R  # noqa: E402
from kernels.activation import silu_and_mul  # noqa: E402
from kernels.decode_attention import DecodeWorkspace, decode_attention, default_num_splits  # noqa: E402
from kernels.kv_write import rope_kv_write  # noqa: E402
from kernels.norm import fused_add_rms_norm  # noqa: E402
from kernels.prefill_attention import prefill_attention  # noqa: E402
from kernels.sampling import sample  # noqa: E402
from kernels.sampling_ref import sample as sample_ref  # noqa: E402

DEV = torch.device("cpu" if DRY else "cuda")


def Z(big, small):
    return small if DRY else big

ROWS: list[dict] = []
CHECKS: list[tuple[str, float, float]] = []


def rel_err(a, b):
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench(fn, rep=100):
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def bench_graph(fn, rep=100):
    """Median time of ``fn`` captured in a CUDA graph (no host launch overhead)."""
    if DRY:
        return bench(fn, rep)
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay, rep)


def check(name, err, limit):
    CHECKS.append((name, err, limit))
    print(f"check {name}: rel err {err:.2e} (limit {limit:.0e}) {'OK' if err <= limit else 'FAIL'}", flush=True)


def paged_cache(B, ctx, Hkv, D, bs, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    nb_row = (ctx + bs - 1) // bs
    num_blocks = B * nb_row + 8
    kc = torch.randn(num_blocks, bs, Hkv, D, device=DEV, dtype=dtype, generator=g)
    vc = torch.randn(num_blocks, bs, Hkv, D, device=DEV, dtype=dtype, generator=g)
    perm = torch.randperm(num_blocks, device=DEV, generator=g)[: B * nb_row]
    bt = perm.view(B, nb_row).to(torch.int32).contiguous()
    return kc, vc, bt


def copy_bandwidth():
    n = Z(1 << 30, 1 << 16)  # two buffers of 2n bytes
    src = torch.empty(2 * n, dtype=torch.uint8, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    bw = 2 * src.numel() / (ms * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    ROWS.append(dict(kernel="d2d_copy", bytes=4 * n, ms=ms, GBps=bw / 1e9))
    print(f"device copy: {bw / 1e12:.3f} TB/s (read+write)", flush=True)
    return bw


# --------------------------------------------------------------------------- (a) correctness


def correctness():
    torch.manual_seed(0)
    for D in (64, 128):
        B, H, Hkv, bs, L = 8, Z(32, 8), Z(8, 2), 16, Z(4096, 100)
        lens = torch.randint(1, L, (B,)).tolist()
        kc, vc, bt = paged_cache(B, L, Hkv, D, bs, seed=D)
        cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        q = torch.randn(B, H, D, device=DEV, dtype=torch.bfloat16)
        ref = R.decode_attention_ref(q, kc, vc, bt, cl, D ** -0.5)
        for ns in (1, default_num_splits(B, Hkv, DEV, head_dim=D), 16):
            out = torch.full_like(q, float("nan"))
            decode_attention(q, kc, vc, bt, cl, D ** -0.5, out=out, num_splits=ns)
            check(f"decode D={D} splits={ns}", rel_err(out, ref), 1e-2)
        # prefill: chunked rows over the same cache
        qlens = [min(l, n) for l, n in zip(lens, [512, 1, 77, 300, 1, 1024, 16, 2000])]
        qs = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        qp = torch.randn(sum(qlens), H, D, device=DEV, dtype=torch.bfloat16)
        out = torch.full_like(qp, float("nan"))
        prefill_attention(qp, kc, vc, bt, qs, cl, max(qlens), D ** -0.5, out=out)
        check(f"prefill D={D}", rel_err(out, R.prefill_attention_ref(qp, kc, vc, bt, qs, cl, D ** -0.5)), 1e-2)
    # rope + kv write
    T, H, Hkv, D = Z(300, 20), Z(32, 4), Z(8, 2), 128
    q = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(T, Hkv, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEV) / D))
    cs = R.rope_cos_sin_cache(inv_freq, 8192)
    pos = torch.randint(0, 8192, (T,), device=DEV)
    kv_index = torch.randperm(64 * 16, device=DEV)[:T]
    kv_index[::7] = -1
    kc = torch.randn(64, 16, Hkv, D, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    qo = rope_kv_write(q, k, v, pos, cs, kc, vc, kv_index)
    qr = R.rope_kv_write_ref(q, k, v, pos, cs, kc2, vc2, kv_index)
    check("rope_kv_write q", rel_err(qo, qr), 1e-2)
    check("rope_kv_write cache", rel_err(kc, kc2) + rel_err(vc, vc2), 1e-2)
    # norm / silu
    x = torch.randn(Z(257, 5), 4096, device=DEV, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.randn(4096, device=DEV, dtype=torch.bfloat16)
    o, r = fused_add_rms_norm(x, res, w, 1e-5)
    ro, rr = R.fused_add_rms_norm_ref(x, res, w, 1e-5)
    check("fused_add_rms_norm", rel_err(o, ro) + rel_err(r, rr), 1e-2)
    xs = torch.randn(Z(257, 5), 2 * 8192, device=DEV, dtype=torch.bfloat16)
    check("silu_and_mul", rel_err(silu_and_mul(xs), R.silu_and_mul_ref(xs)), 1e-2)
    # sampling at Llama-3 vocab: exact agreement with the torch version
    S, V = Z(64, 8), Z(128256, 1000)
    logits = torch.randn(S, V, device=DEV) * 4
    temp = torch.rand(S, device=DEV) + 0.3
    temp[::8] = 0
    top_k = torch.where(torch.arange(S, device=DEV) % 3 == 0, 50, 0).to(torch.int32)
    top_p = torch.where(torch.arange(S, device=DEV) % 2 == 0, 0.9, 1.0)
    min_p = torch.where(torch.arange(S, device=DEV) % 5 == 0, 0.05, 0.0)
    seed = torch.randint(0, 2**62, (S,), device=DEV)
    pos = torch.randint(0, 2**20, (S,), device=DEV)
    a = sample(logits, temp, top_k, top_p, min_p, seed, pos)
    b = sample_ref(logits, temp, top_k, top_p, min_p, seed, pos)
    mism = (a != b).sum().item()
    check("sample == sample_ref (mismatched rows)", float(mism), 0.0)


# --------------------------------------------------------------------------- (b) decode attention


def decode_case(name, H, Hkv, D, ctx, copy_bw, sweep, B=64, bs=16):
    kc, vc, bt = paged_cache(B, ctx, Hkv, D, bs, seed=ctx + D)
    cl = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(B, H, D, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ws = DecodeWorkspace(B, H, D, max_splits=32, device=DEV)
    kv_bytes = 2 * B * ctx * Hkv * D * 2
    scale = D ** -0.5

    def run(**cfg):
        return bench(lambda: decode_attention(q, kc, vc, bt, cl, scale, out=out, workspace=ws, **cfg))

    ms = run()
    ms_graph = bench_graph(lambda: decode_attention(q, kc, vc, bt, cl, scale, out=out, workspace=ws))
    ns = default_num_splits(B, Hkv, DEV, head_dim=D)
    row = dict(kernel="decode_attention", model=name, B=B, ctx=ctx, H=H, Hkv=Hkv, D=D, block_size=bs,
               num_splits=ns, ms=ms, GBps=kv_bytes / ms / 1e6, frac_copy=kv_bytes / (ms * 1e-3) / copy_bw,
               graph_ms=ms_graph, graph_frac_copy=kv_bytes / (ms_graph * 1e-3) / copy_bw)
    # check at this shape too (a few rows, the reference is slow)
    ref = R.decode_attention_ref(q[:4], kc, vc, bt[:4], cl[:4], scale)
    row["rel_err"] = rel_err(out[:4], ref)
    # SDPA over a gathered contiguous cache [B, Hkv, L, D]
    try:
        kg = kc[bt.long()].reshape(B, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
        vg = vc[bt.long()].reshape(B, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
        q4 = q.unsqueeze(2)
        f = torch.nn.functional.scaled_dot_product_attention
        sd = bench(lambda: f(q4, kg, vg, scale=scale, enable_gqa=True))
        o_sdpa = f(q4, kg, vg, scale=scale, enable_gqa=True).squeeze(2)
        row.update(sdpa_ms=sd, sdpa_frac_copy=kv_bytes / (sd * 1e-3) / copy_bw, sdpa_rel_diff=rel_err(out, o_sdpa))
        del kg, vg
    except Exception as e:  # pragma: no cover - report and go on
        row["sdpa_error"] = repr(e)[:200]
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    if sweep:
        results = []
        for block_n in Z((32, 64, 128), (16,)):
            for nw, st in Z(((2, 3), (4, 2), (4, 3), (4, 4), (8, 3)), ((4, 2),)):
                try:
                    t = run(num_splits=ns, block_n=block_n, num_warps=nw, num_stages=st)
                except Exception as e:  # out of resources etc.
                    print(f"  sweep {block_n} {nw} {st}: {e!r}"[:200])
                    continue
                results.append((t, dict(num_splits=ns, block_n=block_n, num_warps=nw, num_stages=st)))
        best_t, best = min(results, key=lambda r: r[0])
        for s in Z((1, 2, 4, 8, 16, 32), (1, 2)):
            if s != ns:
                t = run(**{**best, "num_splits": s})
                results.append((t, {**best, "num_splits": s}))
        results.sort(key=lambda r: r[0])
        for t, cfg in results[:6]:
            print(f"  sweep {name} ctx={ctx}: {t * 1e3:8.1f} us  {kv_bytes / (t * 1e-3) / copy_bw:5.1%}  {cfg}")
        ROWS.append(dict(kernel="decode_sweep", model=name, ctx=ctx,
                         top=[dict(ms=t, frac_copy=kv_bytes / (t * 1e-3) / copy_bw, **cfg) for t, cfg in results[:10]]))
    del kc, vc
    torch.cuda.empty_cache()
    return row


# --------------------------------------------------------------------------- (c) other kernels


def other_kernels(copy_bw, sweep=False):
    out = []
    # prefill attention: 4 x 1024 new tokens (no prefix) and a 512-token chunk after 3584 cached
    for name, D in (("1B", 64), ("8B", 128)):
        H, Hkv = 32, 8
        for label, rows in (("4x1024 fresh", [(0, Z(1024, 20))] * 4),
                            ("4x512 chunk@3584", [(Z(3584, 30), Z(512, 10))] * 4)):
            lens = [p + n for p, n in rows]
            qlens = [n for _, n in rows]
            kc, vc, bt = paged_cache(len(rows), max(lens), Hkv, D, 16, seed=1)
            cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
            qs = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
            q = torch.randn(sum(qlens), H, D, device=DEV, dtype=torch.bfloat16)
            o = torch.empty_like(q)
            fn = lambda: prefill_attention(q, kc, vc, bt, qs, cl, max(qlens), D ** -0.5, out=o)  # noqa: E731
            ms, gms = bench(fn), bench_graph(fn)
            flops = sum(4 * H * D * n * (p + (n + 1) / 2) for p, n in rows)
            out.append(dict(kernel="prefill_attention", model=name, case=label, ms=ms, graph_ms=gms,
                            TFLOPs=flops / gms / 1e9))
    # rope + kv write
    for T in Z((64, 4096), (4,)):
        H, Hkv, D = Z(32, 4), Z(8, 2), 128
        q = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(T, Hkv, D, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        cs = R.rope_cos_sin_cache(torch.rand(D // 2, device=DEV), 8192)
        pos = torch.randint(0, 8192, (T,), device=DEV)
        kc = torch.empty(T // 16 + 1, 16, Hkv, D, device=DEV, dtype=torch.bfloat16)
        vc = torch.empty_like(kc)
        kv_index = torch.arange(T, device=DEV)
        qo = torch.empty_like(q)
        fn = lambda: rope_kv_write(q, k, v, pos, cs, kc, vc, kv_index, q_out=qo)  # noqa: E731
        ms, gms = bench(fn), bench_graph(fn)
        by = (2 * q.numel() + 4 * k.numel()) * 2
        out.append(dict(kernel="rope_kv_write", case=f"T={T} 32/8x128", ms=ms, graph_ms=gms, GBps=by / gms / 1e6,
                        frac_copy=by / (gms * 1e-3) / copy_bw))
    # fused add + rmsnorm, silu
    for T, N in Z(((64, 2048), (4096, 4096)), ((2, 256),)):
        x = torch.randn(T, N, device=DEV, dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.randn(N, device=DEV, dtype=torch.bfloat16)
        o, ro = torch.empty_like(x), torch.empty_like(x)
        fn = lambda: fused_add_rms_norm(x, r, w, 1e-5, out=o, residual_out=ro)  # noqa: E731
        ms, gms = bench(fn), bench_graph(fn)
        by = 4 * x.numel() * 2
        out.append(dict(kernel="fused_add_rms_norm", case=f"T={T} N={N}", ms=ms, graph_ms=gms,
                        GBps=by / gms / 1e6, frac_copy=by / (gms * 1e-3) / copy_bw))
    for T, I in Z(((64, 8192), (4096, 8192)), ((2, 512),)):
        x = torch.randn(T, 2 * I, device=DEV, dtype=torch.bfloat16)
        o = torch.empty(T, I, device=DEV, dtype=torch.bfloat16)
        fn = lambda: silu_and_mul(x, out=o)  # noqa: E731
        ms, gms = bench(fn), bench_graph(fn)
        by = 3 * T * I * 2
        out.append(dict(kernel="silu_and_mul", case=f"T={T} I={I}", ms=ms, graph_ms=gms, GBps=by / gms / 1e6,
                        frac_copy=by / (gms * 1e-3) / copy_bw))
    # sampling, S=64, V=128256
    S, V = Z(64, 4), Z(128256, 500)
    logits = torch.randn(S, V, device=DEV) * 4
    seed = torch.randint(0, 2**62, (S,), device=DEV)
    pos = torch.randint(0, 2**20, (S,), device=DEV)
    z = torch.zeros(S, device=DEV)
    o = torch.empty(S, dtype=torch.int64, device=DEV)
    for label, temp, tk, tp, mp in (
        ("greedy", 0.0, 0, 1.0, 0.0), ("temperature", 0.8, 0, 1.0, 0.0), ("min_p=0.05", 0.8, 0, 1.0, 0.05),
        ("top_k=50", 0.8, 50, 1.0, 0.0), ("top_p=0.9", 0.8, 0, 0.9, 0.0), ("top_k=50+top_p=0.9", 0.8, 50, 0.9, 0.0),
    ):
        args = (logits, z + temp, torch.full((S,), tk, dtype=torch.int32, device=DEV), z + tp, z + mp, seed, pos)
        ms = bench(lambda: sample(*args, out=o), rep=50)
        gms = bench_graph(lambda: sample(*args, out=o), rep=50)
        ms_ref = bench(lambda: sample_ref(*args), rep=50)
        out.append(dict(kernel="sample", case=f"S={S} V={V} {label}", ms=ms, graph_ms=gms, torch_ref_ms=ms_ref))
        if sweep and label in ("temperature", "top_k=50+top_p=0.9"):
            for cfg in Z((dict(block=2048), dict(block=8192), dict(num_warps=4), dict(nc=4), dict(nc=16),
                          dict(nc=16, sblock=256), dict(nc=8, sblock=2048), dict(num_stages=1)), (dict(nc=4),)):
                t = bench(lambda: sample(*args, out=o, **cfg), rep=50)
                print(f"  sweep sample {label}: {t * 1e3:8.1f} us  {cfg}", flush=True)
                out.append(dict(kernel="sample_sweep", case=label, ms=t, cfg=cfg))
    for row in out:
        print(json.dumps(row), flush=True)
    ROWS.extend(out)


def guarded(fn, *a, **kw):
    """Run one section; a failure is reported as a failed check, and the rest goes on."""
    try:
        return fn(*a, **kw)
    except Exception as e:
        import traceback

        traceback.print_exc()
        check(f"{fn.__name__} raised {e!r}"[:120], float("inf"), 0.0)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="try decode configs at 4k/16k")
    ap.add_argument("--sweep-sampling", action="store_true", help="try sampling configs")
    ap.add_argument("--quick", action="store_true", help="decode only")
    ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU interpreter (script check)")
    args = ap.parse_args()
    assert DRY or torch.cuda.is_available(), "needs CUDA"
    props = torch.cuda.get_device_properties(0) if not DRY else None
    meta = dict(gpu=props.name if props else "cpu-interpreter", sms=props.multi_processor_count if props else 0, torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%d"), cmd=" ".join(sys.argv))
    print(json.dumps(meta), flush=True)
    t0 = time.time()
    copy_bw = copy_bandwidth()
    if not args.quick:
        guarded(correctness)
    dec = []
    for name, H, Hkv, D in (("Llama-3.2-1B", Z(32, 8), Z(8, 2), 64), ("Llama-3-8B", Z(32, 8), Z(8, 2), 128)):
        for ctx in Z((1024, 4096, 16384), (32, 64)):
            r = guarded(decode_case, name, H, Hkv, D, ctx, copy_bw, args.sweep and ctx >= Z(4096, 64), B=Z(64, 2))
            if r:
                dec.append(r)
    if not args.quick:
        guarded(other_kernels, copy_bw, args.sweep_sampling)
    copy_bw2 = copy_bandwidth()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, copy_TBps=[copy_bw / 1e12, copy_bw2 / 1e12], rows=ROWS,
                           checks=CHECKS), f, indent=1)
    # ---- short table last
    print(f"\n{meta['gpu']}  torch {meta['torch']}  triton {meta['triton']}  "
          f"copy {copy_bw / 1e12:.2f}/{copy_bw2 / 1e12:.2f} TB/s  ({time.time() - t0:.0f} s)")
    bad = [c for c in CHECKS if not c[1] <= c[2]]
    print(f"checks: {len(CHECKS) - len(bad)}/{len(CHECKS)} ok" + (f"  FAILED: {[c[0] for c in bad]}" if bad else ""))
    print(f"{'decode (B=64, bs=16, bf16)':22s} {'ctx':>6s} {'splits':>6s} {'eager us':>9s} {'TB/s':>5s} {'%copy':>6s}"
          f" {'graph us':>9s} {'%copy':>6s} {'sdpa us':>8s} {'sdpa%':>6s}")
    for r in dec:
        print(f"{r['model']:22s} {r['ctx']:6d} {r['num_splits']:6d} {r['ms'] * 1e3:9.1f} {r['GBps'] / 1e3:5.2f}"
              f" {r['frac_copy']:6.1%} {r['graph_ms'] * 1e3:9.1f} {r['graph_frac_copy']:6.1%}"
              f" {r.get('sdpa_ms', float('nan')) * 1e3:8.1f} {r.get('sdpa_frac_copy', float('nan')):6.1%}")
    for r in ROWS:
        if r["kernel"] in ("prefill_attention", "rope_kv_write", "fused_add_rms_norm", "silu_and_mul", "sample"):
            extra = (f"{r['TFLOPs']:.0f} TFLOP/s" if "TFLOPs" in r else
                     f"{r['frac_copy']:.0%} copy bw" if "frac_copy" in r else
                     f"torch ref {r['torch_ref_ms'] * 1e3:.0f} us")
            print(f"{r['kernel']:18s} {r.get('model', ''):2s} {r['case']:32s} eager {r['ms'] * 1e3:7.1f} us"
                  f"  graph {r['graph_ms'] * 1e3:7.1f} us  {extra}")


if __name__ == "__main__":
    main()
