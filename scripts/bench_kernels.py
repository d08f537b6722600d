#!/usr/bin/env python3
"""The kernel-level benchmarks, one sub-command each (CUDA unless said; ``SUB --help`` for its flags).

Usage: bench_kernels.py SUB [flags]   (SUB --help: its flags)

    python3 scripts/bench_kernels.py check [--sweep] [--dry]     # every kernel against its reference, decode attention timed
    python3 scripts/bench_kernels.py gemv                        # skinny decode matmuls: cuBLAS vs every GEMV config
    python3 scripts/bench_kernels.py w8a8 [--grid]               # FP8 weights above 8 rows: cuBLASLt vs W8A8 tiles
    python3 scripts/bench_kernels.py decode-attention            # split-KV decode attention's launch configs
    python3 scripts/bench_kernels.py prefill-attention           # paged prefill attention, TFLOP/s (--old MODULE: A/B)
    python3 scripts/bench_kernels.py mixed-step                  # one step with a prefill chunk: graphs vs eager, MFU
    python3 scripts/bench_kernels.py transfer [--dry]            # the device <-> pinned host item copy
    python3 scripts/bench_kernels.py sampling                    # the sampler and the sampling features at batch 64
    python3 scripts/bench_kernels.py sampling-step               # a decode step's cost with logprobs and penalties
    python3 scripts/bench_kernels.py spec                        # speculative verification: K + 1 tokens a row vs 1
    python3 scripts/bench_kernels.py moe                         # the fused MoE kernels' tiles and the routing

Each sub-command's code is a function below whose body reads as a script (its own imports, constants and
``main``); only the one asked for is imported and run, so each keeps its own import-time settings (the
Triton interpreter for ``--dry`` and CPU runs).  Figures: docs/performance.md.
"""

from __future__ import annotations

import os
import sys

SCRIPTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [SCRIPTS, os.path.dirname(SCRIPTS)]



def timed(fn, reps: int, cuda: bool) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (each waited for: CUDA events on the GPU), after two warm-up
    calls."""
    import statistics
    import time

    import torch

    times = []
    for i in range(reps + 2):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        if i >= 2:
            times.append(t)
    return statistics.median(times)


def _check(argv: list[str]) -> int:
    """Check and time the Triton kernels on a CUDA GPU.

    python3 scripts/bench_kernels.py check [--json PATH] [--sweep] [--quick]

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
    sys.argv = ["bench_kernels.py check", *argv]

    import argparse
    import json
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
        ws = DecodeWorkspace(B, H, D, max_splits=32, device=DEV, min_pairs=B * 32)  # the sweep tries up to 32
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
    return main() or 0


def _gemv(argv: list[str]) -> int:
    """Skinny decode matmuls (M = 1..8) on this GPU: cuBLAS against every :data:`kernels.gemv.CONFIGS` entry.

For each linear of the given model shapes (q|k|v, o, gate|up, down, lm_head from
``scripts/configs/<name>/config.json``, random bf16 weights, one copy per layer so that L2
does not hold them) and each M: ms of one pass over the layers (a CUDA graph of back-to-back
calls, timed as the start-up tuner times it, :func:`executor_proc.backends.gemv_tuning._time_pass`),
the fastest config and its ratio to cuBLAS.  Every config is checked against ``F.linear``
first.  ``--all`` prints every config's time, not only the best of each form.

    python3 scripts/bench_kernels.py gemv [--models llama-3.2-1b,llama-3-8b] [--ms 1,2,4,8] [--all] [--json OUT]
    """
    sys.argv = ["bench_kernels.py gemv", *argv]

    import argparse
    import json

    import torch
    import torch.nn.functional as F

    from benchlib import shapes_of, write_json  # noqa: E402
    from executor_proc.backends.gemv_tuning import _time_pass  # noqa: E402  (the tuner's graph timing)
    from kernels import gemv as skinny  # noqa: E402


    def main() -> None:
        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b", help="config names under scripts/configs")
        ap.add_argument("--ms", default="1,2,4,8", help="row counts to time")
        ap.add_argument("--reps", type=int, default=7, help="graph replays per candidate (median)")
        ap.add_argument("--all", action="store_true", help="print every config, not only the best of each form")
        ap.add_argument("--json", default=None, help="write every timing to this JSON file")
        args = ap.parse_args()
        device = torch.device("cuda")
        ms = [int(m) for m in args.ms.split(",")]
        rows, table = [], []
        for model in args.models.split(","):
            with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", model, "config.json")) as f:
                layers = json.load(f)["num_hidden_layers"]
            for name, (n, k) in shapes_of(model).items():
                weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
                           for _ in range(1 if name == "lm_head" else layers)]
                for m in ms:
                    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                    ref = F.linear(x.float(), weights[0].float())
                    times = {"cublas": _time_pass(lambda w: F.linear(x, w), weights, args.reps)}
                    for config in (c for c in skinny.CONFIGS if skinny.config_fits(c, m)):
                        err = ((skinny.gemv(x, weights[0], config=config).float() - ref).norm() / ref.norm()).item()
                        assert err < 1e-2, (model, name, m, config, err)
                        times[config] = _time_pass(lambda w, c=config: skinny.gemv(x, w, config=c), weights, args.reps)
                    gb = n * k * 2 * len(weights) / 1e9
                    for key, t in times.items():
                        rows.append(dict(model=model, weight=name, n=n, k=k, m=m, config=key, ms=t, tb_s=gb / t))
                    best = {}
                    for key, t in times.items():
                        form = key if key == "cublas" else key[0]
                        if form not in best or t < times[best[form]]:
                            best[form] = key
                    shown = times if args.all else {best[f]: times[best[f]] for f in best}
                    winner = min(times, key=times.get)
                    table.append(f"{model:<13}{name:<8}{m:>3}  cublas {times['cublas']:.4f}  best {times[winner]:.4f} "
                                 f"({times['cublas'] / times[winner]:.2f}x, {gb / times[winner]:.2f} TB/s) {winner}")
                    for key, t in sorted(shown.items(), key=lambda kv: kv[1]):
                        table.append(f"{'':>26}{t:.4f}  {key}")
                del weights
                torch.cuda.empty_cache()
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
        print("\n".join(table))
        if args.json:
            write_json(args.json, dict(meta=meta, rows=rows))
    return main() or 0


def _w8a8(argv: list[str]) -> int:
    """FP8 weights at more than 8 rows on this GPU: cuBLASLt against the W8A8 Triton kernel's tiles.

For each layer linear of the given model shapes (q|k|v, o, gate|up, down, random weights quantized to e4m3, one copy
per layer so that L2 does not hold them) and each M: ms of one pass over the layers (a CUDA graph of back-to-back
calls, as the start-up tuner times them), the fastest tile and its ratio to cuBLASLt.  The tiles are the tuner's
candidates (:data:`kernels.matmul_fp8.FP8_MATMUL_CONFIGS`), or with ``--grid`` 60 more (64 or 128 rows; 64, 128 or
256 columns; 64-256 deep; 4 or 8 warps; 3-6 stages), each checked against cuBLASLt first: where a tile of the grid
beats every candidate, it is one to add.

    python3 scripts/bench_kernels.py w8a8 [--models llama-3-8b] [--ms 16,64,128,256,512] [--grid] [--json OUT]
    """
    sys.argv = ["bench_kernels.py w8a8", *argv]

    import argparse
    import json

    import torch

    from benchlib import shapes_of, write_json  # noqa: E402
    from executor_proc.backends.gemv_tuning import _time_pass  # noqa: E402  (the tuner's graph timing)
    from kernels.fp8 import quantize_weight  # noqa: E402
    from kernels.matmul_fp8 import (FP8_MATMUL_CONFIGS, Fp8MatmulConfig, fp8_matmul, quantize_rows,  # noqa: E402
                                    scaled_mm)

    GRID = [Fp8MatmulConfig(64, bn, bk, 4, st) for bn in (64, 128, 256) for bk in (128, 256) for st in (3, 4, 5, 6)]
    GRID += [Fp8MatmulConfig(128, bn, bk, w, st) for bn in (64, 128, 256) for bk in (64, 128) for w in (4, 8)
             for st in (3, 4, 5)]

    def main() -> None:
        ap = argparse.ArgumentParser(description=_w8a8.__doc__.splitlines()[0])
        ap.add_argument("--models", default="llama-3-8b", help="config names under scripts/configs")
        ap.add_argument("--ms", default="16,64,128,256,512", help="row counts to time (above 8: W8A8)")
        ap.add_argument("--grid", action="store_true", help="also time the 60-tile grid, not only the candidates")
        ap.add_argument("--reps", type=int, default=5, help="graph replays per tile (median)")
        ap.add_argument("--json", default=None, help="write every timing to this JSON file")
        args = ap.parse_args()
        device = torch.device("cuda")
        tiles = list(dict.fromkeys([*FP8_MATMUL_CONFIGS, *(GRID if args.grid else [])]))
        rows, table = [], []
        for model in args.models.split(","):
            with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", model, "config.json")) as f:
                layers = json.load(f)["num_hidden_layers"]
            for name, (n, k) in shapes_of(model).items():
                if name == "lm_head":  # bf16 under --quantization fp8
                    continue
                weights = [quantize_weight(torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02)
                           for _ in range(layers)]
                for m in (int(m) for m in args.ms.split(",")):
                    xq, xs = quantize_rows(torch.randn(m, k, device=device, dtype=torch.bfloat16))
                    ref = scaled_mm(xq, xs, weights[0]).float()
                    times = {"cublaslt": _time_pass(lambda w: scaled_mm(xq, xs, w), weights, args.reps)}
                    for tile in tiles:
                        try:
                            got = fp8_matmul(xq, xs, weights[0], config=tile).float()
                        except Exception as e:  # stages past this GPU's shared memory: as the tuner, pass over it
                            rows.append(dict(model=model, weight=name, n=n, k=k, m=m, config=list(tile),
                                             error=f"{type(e).__name__}"))
                            continue
                        err = ((got - ref).norm() / ref.norm()).item()
                        assert err < 1e-2, (model, name, m, tile, err)  # bf16 rounding and summation order only
                        times[tile] = _time_pass(lambda w, c=tile: fp8_matmul(xq, xs, w, config=c), weights,
                                                 args.reps)
                    for key, t in times.items():
                        rows.append(dict(model=model, weight=name, n=n, k=k, m=m, ms=t,
                                         config=key if isinstance(key, str) else list(key),
                                         candidate=key in FP8_MATMUL_CONFIGS, tflops=2 * m * n * k * layers / t / 1e9))
                    ranked = sorted((t, key) for key, t in times.items() if key != "cublaslt")
                    best_t, best = ranked[0]
                    cand_t = min((t for t, key in ranked if key in FP8_MATMUL_CONFIGS), default=float("nan"))
                    us = 1e3 / layers
                    table.append(f"{model:<12}{name:<8}{m:>4}  cuBLASLt {times['cublaslt'] * us:7.1f} us  "
                                 f"candidates {cand_t * us:7.1f}  best {best_t * us:7.1f} "
                                 f"({times['cublaslt'] / best_t:.2f}x) {tuple(best)}"
                                 f"{'' if best in FP8_MATMUL_CONFIGS else '  (not a candidate)'}")
                del weights
                torch.cuda.empty_cache()
        print("\n".join(table))
        if args.json:
            write_json(args.json, dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                                                 tiles=[list(t) for t in tiles]), rows=rows))

    return main() or 0


def _decode_attention(argv: list[str]) -> int:
    """Split-KV decode attention's launch config at the decode step's shapes: a sweep, one table.

For each case (model shape, batch, context) the script times ``kernels.decode_attention`` for
every (num_splits, BLOCK_N, num_warps, num_stages) in the grid as a CUDA graph of 10 calls
(median of ``--reps`` replays; the in-kernel merge included), checks the best config against
the reference, and prints, per case, the default config's time and the best few, with the KV
read rate as a fraction of the device copy bandwidth measured in the same run.

    python3 scripts/bench_kernels.py decode-attention [--cases 8b:64:512,1b:64:512,1b:1:512] [--kv-dtypes bf16,fp8]
                                                      [--json OUT.json]

With ``--kv-dtypes bf16,fp8`` each case runs on both caches (FP8: e4m3 values, half the bytes) and the FP8 one's
speed-up is printed.
    """
    sys.argv = ["bench_kernels.py decode-attention", *argv]

    import argparse
    import itertools

    import torch

    from benchlib import write_json
    from executor_proc.backends.gemv_tuning import _time_pass
    from kernels.decode_attention import DecodeWorkspace, _default_config, decode_attention, default_num_splits
    from kernels.reference import decode_attention_ref

    SHAPES = {"8b": (32, 8, 128), "1b": (32, 8, 64)}  # (heads, KV heads, head_dim)
    BLOCK_SIZE = 16


    def graph_time(fn, reps: int, calls: int = 10) -> float:
        """Seconds per call: ``calls`` back-to-back calls in one CUDA graph, median of ``reps`` replays (the
        start-up tuner's timing)."""
        marker = torch.empty(0, device="cuda")  # the tuner's timing wants its arguments' device
        return _time_pass(lambda _: fn(), [marker] * calls, reps) / calls / 1e3


    def copy_bandwidth(reps: int) -> float:
        src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        return 2 * src.numel() / graph_time(lambda: dst.copy_(src), reps, calls=2)


    def run_case(model: str, batch: int, ctx: int, bandwidth: float, args, kv_dtype: str = "bf16") -> dict:
        H, Hkv, D = SHAPES[model]
        g = torch.Generator(device="cuda").manual_seed(batch * ctx + D)
        per_row = -(-ctx // BLOCK_SIZE)
        blocks = batch * per_row + 8
        kc = torch.randn(blocks, BLOCK_SIZE, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn_like(kc)
        if kv_dtype == "fp8":  # e4m3 values, scale 1 (the kernel's scale multiply runs all the same)
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        bt = torch.randperm(blocks, device="cuda", generator=g)[:batch * per_row].view(batch, per_row).int()
        cl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        out = torch.empty_like(q)
        most = max(32, *args.splits)  # room for every swept split count at this row count
        ws = DecodeWorkspace(batch, H, D, max_splits=most, device="cuda", min_pairs=batch * most)
        kv_bytes = 2 * batch * ctx * Hkv * D * kc.element_size()
        fp8 = kv_dtype == "fp8"
        default = (default_num_splits(batch, Hkv, "cuda", head_dim=D), *_default_config(D, fp8, batch))
        results = {}
        for cfg in itertools.product(args.splits, args.block_n, args.warps_stages):
            splits, block_n, (warps, stages) = cfg
            key = (splits, block_n, warps, stages)
            try:
                results[key] = graph_time(lambda: decode_attention(q, kc, vc, bt, cl, D ** -0.5, out=out, workspace=ws,
                                                                   num_splits=splits, block_n=block_n, num_warps=warps,
                                                                   num_stages=stages), args.reps)
            except Exception as e:  # noqa: BLE001 - out of shared memory etc.: skip the config
                print(f"  skip {key}: {type(e).__name__}", flush=True)
        if default not in results:
            results[default] = graph_time(lambda: decode_attention(q, kc, vc, bt, cl, D ** -0.5, out=out, workspace=ws,
                                                                   num_splits=default[0]), args.reps)
        ranked = sorted(results.items(), key=lambda kv: kv[1])
        best = ranked[0][0]
        decode_attention(q, kc, vc, bt, cl, D ** -0.5, out=out, workspace=ws, num_splits=best[0], block_n=best[1],
                         num_warps=best[2], num_stages=best[3])
        ref = decode_attention_ref(q[:4].float(), kc.float(), vc.float(), bt[:4], cl[:4], D ** -0.5)
        err = ((out[:4].float() - ref).abs().max() / ref.abs().max()).item()
        frac = lambda t: kv_bytes / t / bandwidth  # noqa: E731
        return dict(model=model, kv_dtype=kv_dtype, batch=batch, ctx=ctx, default=list(default),
                    default_us=results[default] * 1e6,
                    default_frac=frac(results[default]), best=list(best), best_us=ranked[0][1] * 1e6,
                    best_frac=frac(ranked[0][1]), best_rel_err=err,
                    top=[dict(config=list(k), us=t * 1e6, frac=frac(t)) for k, t in ranked[:8]])


    def main(argv=None) -> int:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--cases", default="8b:64:512,1b:64:512,8b:1:512,1b:1:512",
                        help="MODEL:BATCH:CONTEXT,... (MODEL: 8b or 1b head shapes)")
        ap.add_argument("--splits", default="1,2,4,8,16", help="num_splits values to try")
        ap.add_argument("--block-n", default="32,64,128", help="BLOCK_N values to try")
        ap.add_argument("--warps-stages", default="2x3,4x2,4x3,4x4,8x3", help="num_warps x num_stages pairs to try")
        ap.add_argument("--reps", type=int, default=20, help="graph replays per config (median)")
        ap.add_argument("--kv-dtypes", default="bf16", help="the KV cache's dtypes to time, comma-separated: bf16, fp8")
        ap.add_argument("--json", default=None, help="write the rows here")
        args = ap.parse_args(argv)
        args.splits = [int(x) for x in args.splits.split(",")]
        args.block_n = [int(x) for x in args.block_n.split(",")]
        args.warps_stages = [tuple(int(v) for v in x.split("x")) for x in args.warps_stages.split(",")]
        bandwidth = copy_bandwidth(args.reps)
        rows = []
        for case in args.cases.split(","):
            model, batch, ctx = case.split(":")
            for kv in args.kv_dtypes.split(","):
                rows.append(run_case(model, int(batch), int(ctx), bandwidth, args, kv))
                r = rows[-1]
                print(f"{case} {kv}: default {r['default']} {r['default_us']:.1f} us ({r['default_frac']:.0%}); "
                      + "; ".join(f"{t['config']} {t['us']:.1f} ({t['frac']:.0%})" for t in r["top"][:4]),
                      flush=True)
        print(f"\n{torch.cuda.get_device_name()}  copy {bandwidth / 1e12:.2f} TB/s  (splits, BLOCK_N, warps, stages)")
        print(f"{'case':<14}{'kv':>5}{'default':>20}{'us':>8}{'BW':>6}{'best':>22}{'us':>8}{'BW':>6}{'err':>9}")
        for r in rows:
            print(f"{r['model']}:{r['batch']}:{r['ctx']:<8}{r['kv_dtype']:>5}{str(tuple(r['default'])):>20}"
                  f"{r['default_us']:>8.1f}{r['default_frac']:>6.0%}{str(tuple(r['best'])):>22}{r['best_us']:>8.1f}"
                  f"{r['best_frac']:>6.0%}{r['best_rel_err']:>9.1e}")
        base = {(r["model"], r["batch"], r["ctx"]): r for r in rows if r["kv_dtype"] == "bf16"}
        for r in rows:
            b = base.get((r["model"], r["batch"], r["ctx"]))
            if r["kv_dtype"] == "fp8" and b is not None:
                print(f"{r['model']}:{r['batch']}:{r['ctx']}: FP8 KV {b['default_us'] / r['default_us']:.2f}x bf16 "
                      f"at the default config, {b['best_us'] / r['best_us']:.2f}x best against best")
        if args.json:
            write_json(args.json, dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                 copy_bandwidth=bandwidth, command=" ".join(sys.argv)), rows=rows))
        return 0
    return main(argv) or 0


def _prefill_attention(argv: list[str]) -> int:
    """Time paged prefill attention on a CUDA GPU against an older copy of the kernel, in one process.

    python3 scripts/bench_kernels.py prefill-attention [--old kernels_main.prefill_attention] [--sweep] [--json PATH]

Cases (bf16, block size 16, 32 query / 8 KV heads): Llama-3.2-1B (D=64) and Llama-3-8B (D=128)
with 4 rows x 1024 fresh tokens and 4 rows x 512 new after 3584 cached, plus the 8B 2,048-token
fresh chunk.  Each kernel is checked against ``prefill_attention_ref`` on fresh random inputs,
then timed as the median of ``do_bench`` over a CUDA graph of 10 calls (no launch gaps).
TFLOP/s counts causal FLOPs (4*H*D per visible (query, key) pair) and is shown as a fraction of
the bf16 matmul rate measured in the same run (torch.matmul 8192^3, median).  ``--sweep`` times
(score rows, BLOCK_N, warps, stages) variants of the new kernel; ``--ttgir DIR`` saves the
default configs' TTGIR and counts its wgmma / async-copy ops.  Prints a short table last.
    """
    sys.argv = ["bench_kernels.py prefill-attention", *argv]

    import argparse
    import importlib
    import json
    import time

    import torch
    from triton.testing import do_bench


    from kernels import prefill_attention as NEW  # noqa: E402
    from kernels import reference as R  # noqa: E402

    DEV = torch.device("cuda")
    CASES = [("1B", 64, "4x1024 fresh", [(0, 1024)] * 4), ("1B", 64, "4x512 @3584", [(3584, 512)] * 4),
             ("8B", 128, "4x1024 fresh", [(0, 1024)] * 4), ("8B", 128, "4x512 @3584", [(3584, 512)] * 4),
             ("8B", 128, "1x2048 fresh", [(0, 2048)])]
    H, HKV, BS = 32, 8, 16


    def make(rows, D, seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        lens = [p + n for p, n in rows]
        nb = [-(-n // BS) for n in lens]
        kc = torch.randn(sum(nb) + 4, BS, HKV, D, device=DEV, generator=g).bfloat16()
        vc = torch.randn_like(kc)
        perm = torch.randperm(kc.shape[0], device=DEV, generator=g).to(torch.int32)
        bt = torch.zeros(len(rows), max(nb), dtype=torch.int32, device=DEV)
        at = 0
        for r, n in enumerate(nb):
            bt[r, :n] = perm[at:at + n]
            at += n
        qlens = [n for _, n in rows]
        qs = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        cl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        q = torch.randn(sum(qlens), H, D, device=DEV, generator=g).bfloat16()
        return q, kc, vc, bt, qs, cl, max(qlens)


    def rel_err(a, b):
        a, b = a.double(), b.double()
        return float("inf") if not torch.isfinite(a).all() else ((a - b).norm() / b.norm()).item()


    def graph_ms(fn, calls=10):
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        return do_bench(g.replay, warmup=25, rep=150, return_mode="median") / calls


    def matmul_peak():
        a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
        b = torch.randn_like(a)
        ms = do_bench(lambda: torch.matmul(a, b), warmup=50, rep=300, return_mode="median")
        return 2 * 8192 ** 3 / ms / 1e9


    def run_case(mod, rows, D, seed, **kw):
        """(rel err on fresh inputs, graph ms) of ``mod.prefill_attention`` for one case."""
        q, kc, vc, bt, qs, cl, mq = make(rows, D, seed)
        out = torch.full_like(q, float("nan"))
        mod.prefill_attention(q, kc, vc, bt, qs, cl, mq, D ** -0.5, out=out, **kw)
        err = rel_err(out, R.prefill_attention_ref(q, kc, vc, bt, qs, cl, D ** -0.5))
        q, kc, vc, bt, qs, cl, mq = make(rows, D, seed + 1)
        return err, graph_ms(lambda: mod.prefill_attention(q, kc, vc, bt, qs, cl, mq, D ** -0.5, out=out, **kw))


    def flops(rows, D):
        return sum(4 * H * D * n * (p + (n + 1) / 2) for p, n in rows)


    def sweep(results, deadline):
        """Variants of the new kernel; the best by total time per head dim (stops at ``deadline``, a host time)."""
        out = {}
        for D in (64, 128):
            cases = [c for c in CASES if c[1] == D]
            scores = []
            for bm in (32, 16):  # query tokens per program at G=4: 128 / 64 score rows
                for bn in (64, 128):
                    for warps in (4, 8):
                        for stages in (3, 4):
                            if time.time() > deadline:
                                break
                            cfg = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                            try:
                                times = [run_case(NEW, rows, D, 7, **cfg) for _, _, _, rows in cases]
                            except Exception as e:  # out of shared memory / registers
                                print(f"sweep D={D} {cfg}: {type(e).__name__}", flush=True)
                                continue
                            if max(e for e, _ in times) > 2e-2:
                                print(f"sweep D={D} {cfg}: WRONG {times}", flush=True)
                                continue
                            scores.append((sum(t for _, t in times), cfg, [t for _, t in times]))
                            print(f"sweep D={D} {cfg}: " + " ".join(f"{t * 1e3:7.1f}" for _, t in times), flush=True)
            scores.sort(key=lambda s: s[0])
            out[D] = [dict(total_ms=s, cfg=c, ms=t) for s, c, t in scores]
            results.append(dict(kind="sweep", D=D, ranked=out[D][:12]))
        return out


    def save_ttgir(where):
        """TTGIR of every compiled variant of the plain-grid kernel, and its op counts."""
        os.makedirs(where, exist_ok=True)
        counts = []
        caches = getattr(NEW._prefill_kernel, "device_caches", {})
        for dev_cache in caches.values():
            for i, k in enumerate(dev_cache[0].values()):
                ir = k.asm.get("ttgir", "")
                with open(os.path.join(where, f"prefill_{i}.ttgir"), "w") as f:
                    f.write(ir)
                c = {op: ir.count(op) for op in ("warp_group_dot", "async_copy_global_to_local", "async_wait",
                                                 "tt.dot", "scf.for")}
                md = getattr(k, "metadata", None)
                c.update(regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None), file=f"prefill_{i}.ttgir",
                         warps=getattr(md, "num_warps", None), stages=getattr(md, "num_stages", None),
                         smem=getattr(md, "shared", None))
                counts.append(c)
                print("ttgir", c, flush=True)
        return counts


    def main():
        ap = argparse.ArgumentParser()
        ap.add_argument("--old", default="")
        ap.add_argument("--sweep", action="store_true")
        ap.add_argument("--ttgir", default="")
        ap.add_argument("--json", default="")
        ap.add_argument("--budget-s", type=float, default=240.0, help="the sweep stops this long after the start")
        args = ap.parse_args()
        t0 = time.time()
        peak = matmul_peak()
        print(f"bf16 matmul 8192^3: {peak:.0f} TFLOP/s", flush=True)
        results = [dict(kind="peak", TFLOPs=peak)]
        kernels = [("new", NEW)] + ([("old", importlib.import_module(args.old))] if args.old else [])
        table = []
        for model, D, label, rows in CASES:
            for name, mod in kernels:
                err, ms = run_case(mod, rows, D, 1)
                tf = flops(rows, D) / ms / 1e9
                row = dict(kind="case", kernel=name, model=model, D=D, case=label, rel_err=err, ms=ms, TFLOPs=tf,
                           frac_peak=tf / peak)
                results.append(row)
                table.append(row)
                print(row, flush=True)
        ttgir = save_ttgir(args.ttgir) if args.ttgir else []
        results.append(dict(kind="ttgir", variants=ttgir))
        best = sweep(results, t0 + args.budget_s) if args.sweep else {}
        env = dict(torch=torch.__version__, triton=__import__("triton").__version__, gpu=torch.cuda.get_device_name(),
                   seconds=time.time() - t0)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(env=env, results=results), f, indent=1)
        print(f"\n{env}\nbf16 matmul peak (measured): {peak:.0f} TFLOP/s")
        for D, ranked in best.items():
            for r in ranked[:3]:
                print(f"sweep D={D}: {r['total_ms'] * 1e3:8.1f} us total  {r['cfg']}")
        print(f"{'model':5} {'case':14} {'kernel':6} {'us':>8} {'TFLOP/s':>8} {'%peak':>6} {'rel err':>8}")
        for r in table:
            print(f"{r['model']:5} {r['case']:14} {r['kernel']:6} {r['ms'] * 1e3:8.1f} {r['TFLOPs']:8.0f} "
                  f"{100 * r['frac_peak']:5.1f}% {r['rel_err']:8.1e}")
        bad = [r for r in table if r["rel_err"] > 1e-2]
        sys.exit(1 if bad else 0)
    return main() or 0


def _mixed_step(argv: list[str]) -> int:
    """One step with a prefill chunk beside decode rows: replayed graphs (mixed-step runner) against the eager path.

For each case (``D`` decode rows at a context of ``--context`` tokens plus one prefill
chunk of ``P`` new tokens; ``D = 0``: a prefill-only step) the script runs the worker the
way the executor does, then times the step's launch alone, back to back (CUDA events,
median of ``--reps`` after warm-up):

- ``graph``: the mixed runner's body and head replays (the step padded to its bucket);
- ``eager``: the same plan through the eager path (``mixed_graphs: off``: Python launches,
  decode rows through the prefill kernel);
- ``TFLOP/s``: model FLOPs of the real tokens (2 x matmul weights per token, the LM head
  per sampled row, causal attention) / graph time;
- ``MFU``: that rate / the bf16 matmul peak measured in the same run (``--peak-size``: one
  square ``torch.matmul`` in the model's dtype, median of ``--reps`` after warm-up; 0 skips it).

With ``--profile PREFIX`` the kernels of the ``--profile-case`` replays are listed by
device time in ``PREFIX.txt``.

    python3 scripts/bench_kernels.py mixed-step [--model llama-3.2-1b] [--cases 16x128,16x512,16x1024,0x2048]
                                         [--context 512] [--reps 20] [--json OUT.json] [--profile PREFIX]
                                         [--peak-size 8192]
    """
    sys.argv = ["bench_kernels.py mixed-step", *argv]

    import argparse
    import time

    import torch

    from benchlib import write_json
    from bench_decode import profile_kernels
    from executor_proc.build import build_worker
    from executor_proc.testing.synthetic import DecodeLoop, SyntheticPlanner
    from executor_proc.step.step_kinds import EagerStep, MixedStep
    from ipc.config import ExecutorConfig

    CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    BLOCK_SIZE = 16


    def step_flops(mcfg, decode: int, context: int, prefill: int, sampled: int) -> float:
        """Model FLOPs of the real tokens: matmul weights, LM head of the sampled rows, causal attention."""
        h, i, layers = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_layers
        q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
        per_token = layers * (h * (q + 2 * kv) + q * h + 3 * h * i)
        attn_pairs = decode * (context + 1) + prefill * (prefill + 1) // 2  # (query, key) pairs, per layer and head
        attention = 2 * 2 * layers * mcfg.num_heads * mcfg.head_dim * attn_pairs
        return 2 * per_token * (decode + prefill) + 2 * h * mcfg.vocab_size * sampled + attention


    def matmul_peak(size: int, dtype: torch.dtype, reps: int, cuda: bool) -> float:
        """FLOP/s of one ``size``-cubed matmul (median), the peak the step's rate is compared with."""
        a = torch.randn(size, size, dtype=dtype, device="cuda" if cuda else "cpu")
        b = torch.randn(size, size, dtype=dtype, device=a.device)
        return 2 * size ** 3 / timed(lambda: torch.matmul(a, b), reps, cuda)


    def run_case(worker, mcfg, decode: int, prefill: int, args) -> dict:
        """Decoders at the context, one new prompt of ``prefill`` tokens; time its step both ways."""
        cuda = worker.device.type == "cuda"
        blocks = worker.kv_cache.k[0].shape[0]
        planner = SyntheticPlanner(worker.tables.num_slots, BLOCK_SIZE, blocks)
        g = torch.Generator().manual_seed(decode * 7919 + prefill)
        prompt = lambda n: torch.randint(0, mcfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
        for _ in range(decode):
            planner.add(prompt(args.context))
        loop = DecodeLoop(worker, planner)
        if decode:
            for _ in range(3):
                loop.step()
        loop.drain()
        planner.add(prompt(prefill))
        plan = planner.step()
        step = worker.prepare(plan)
        assert isinstance(step, MixedStep), type(step).__name__
        run = lambda: worker.mixed.run(step.shape, step.num_sampled, step.mode)  # noqa: E731
        graph = timed(run, args.reps, cuda)
        if args.profile and f"{decode}x{prefill}" == args.profile_case:
            profile_kernels(run, f"{args.profile}.txt")
        mixed, worker.mixed = worker.mixed, None  # the same plan through the eager path
        eager_step = worker.prepare(plan)
        worker.mixed = mixed
        assert isinstance(eager_step, EagerStep)
        eager = timed(lambda: worker.launch(eager_step), max(3, args.reps // 4), cuda)
        flops = step_flops(mcfg, decode, args.context, prefill, step.num_sampled)
        return dict(decode=decode, prefill=prefill, context=args.context, bucket_tokens=step.shape.tokens,
                    bucket_rows=step.shape.rows, sampled=step.num_sampled, graph_ms=graph * 1e3, eager_ms=eager * 1e3,
                    tflops=flops / graph / 1e12)


    def main(argv=None) -> int:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--model", default="llama-3.2-1b", help="a folder of scripts/configs, or a config path")
        ap.add_argument("--cases", default="16x128,16x512,16x1024,0x2048", help="DECODE_ROWSxPREFILL_TOKENS,...")
        ap.add_argument("--context", type=int, default=512, help="tokens of context of each decode row")
        ap.add_argument("--reps", type=int, default=20, help="timed repetitions per case (median)")
        ap.add_argument("--slots", type=int, default=64, help="request slots of the worker")
        ap.add_argument("--device", default="cuda", help="cuda or cpu (cpu: interpreter-sized shapes only)")
        ap.add_argument("--dtype", default="bfloat16", help="model and KV dtype")
        ap.add_argument("--json", default=None, help="write the rows and metadata here")
        ap.add_argument("--profile", default=None, metavar="PREFIX", help="list the kernels of one case in PREFIX.txt")
        ap.add_argument("--profile-case", default="16x512", help="the DECODExPREFILL case --profile lists")
        ap.add_argument("--peak-size", type=int, default=8192,
                        help="side of the square matmul whose rate is the MFU denominator (0: no MFU)")
        args = ap.parse_args(argv)
        cases = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
        model = args.model if os.path.exists(args.model) else os.path.join(CONFIGS, args.model)
        budget = max(d + p for d, p in cases)
        blocks = args.slots * -(-(args.context + budget + 64) // BLOCK_SIZE)
        cfg = ExecutorConfig(model=model, load_format="dummy", device=args.device, dtype=args.dtype,
                             kernels="triton", num_slots=args.slots, num_kv_blocks=blocks, block_size=BLOCK_SIZE,
                             max_model_len=args.context + budget + 64, max_num_batched_tokens=budget,
                             mixed_graphs="auto" if args.device.startswith("cuda") else "on")
        t0 = time.perf_counter()
        built = build_worker(cfg)
        setup_s = time.perf_counter() - t0
        rows = [run_case(built.worker, built.model_config, d, p, args) for d, p in cases]
        cuda = args.device.startswith("cuda")
        peak = matmul_peak(args.peak_size, getattr(torch, args.dtype), args.reps, cuda) if args.peak_size else 0.0
        for r in rows:
            r["mfu"] = r["tflops"] * 1e12 / peak if peak else None
        meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                    model=args.model, setup_s=setup_s, num_graphs=built.num_graphs, graph_capture_s=built.graph_capture_s,
                    graph_memory_bytes=built.graph_memory_bytes, peak_tflops=peak / 1e12, peak_size=args.peak_size,
                    command=" ".join(sys.argv))
        print(f"{meta['device']}  {args.model}  {built.num_graphs} graphs in {built.graph_capture_s:.1f} s, "
              f"{built.graph_memory_bytes / 2**20:.0f} MiB; matmul peak {peak / 1e12:.0f} TFLOP/s ({args.peak_size}^3)")
        print(f"{'decode':>7}{'prefill':>8}{'bucket':>10}{'graph ms':>10}{'eager ms':>10}{'TFLOP/s':>9}{'MFU':>6}")
        for r in rows:
            print(f"{r['decode']:>7}{r['prefill']:>8}{r['bucket_tokens']:>6}x{r['bucket_rows']:<3}{r['graph_ms']:>10.3f}"
                  f"{r['eager_ms']:>10.2f}{r['tflops']:>9.0f}"
                  + (f"{100 * r['mfu']:>5.0f}%" if r["mfu"] is not None else f"{'-':>6}"))
        if args.json:
            write_json(args.json, dict(meta=meta, rows=rows))
        return 0
    return main(argv) or 0


def _transfer(argv: list[str]) -> int:
    """Bandwidth of the item-copy kernel (kernels/transfer.py) between the GPU and pinned host memory.

    python3 scripts/bench_kernels.py transfer [--json PATH] [--sweep] [--total-mib 256] [--dry]

For items of 2 KiB, 16 KiB, 64 KiB and 1 MiB, in three layouts, both directions (D2H, H2D):
  aligned     item = size; device items at shuffled slots of the device pool, host items packed
  odd         item = size + 3; device slots 16-byte aligned, host items packed (every alignment)
  misaligned  item = size; host items packed one byte off (source and destination disagree
              by one byte: the shifted-word path, or bytes with shifted=False)
each kernel measurement moves about --total-mib MiB in one launch. Baselines: a Python loop of per-item
``copy_(..., non_blocking=True)`` (cudaMemcpyAsync; at most 4096 items, it is per-item bound) and
one contiguous copy of the whole volume (the measured pinned bandwidth). Every kernel result is
checked bit-exact against the torch reference. ``--sweep`` also times a grid of launch configs per case.
``--dry`` runs tiny shapes on the CPU interpreter (checks the script).
    """
    sys.argv = ["bench_kernels.py transfer", *argv]

    import argparse
    import datetime

    import torch

    DRY = "--dry" in sys.argv
    if DRY:
        os.environ["TRITON_INTERPRET"] = "1"


    from kernels.interpreter_patch import patch_interpreter  # noqa: E402

    patch_interpreter()

    import triton  # noqa: E402

    from benchlib import write_json  # noqa: E402
    from kernels.transfer import TransferConfig, copy_items_ref, copy_items_triton, default_config  # noqa: E402

    SIZES = [2048, 16384, 65536, 1 << 20]
    LAYOUTS = ["aligned", "odd", "misaligned"]
    DIRECTIONS = ["d2h", "h2d"]
    LOOP_MAX_ITEMS = 4096
    SWEEP = [TransferConfig(b, c, w, sh) for b, c, w, sh in [
        (8192, 16384, 4, True), (8192, 16384, 4, False), (4096, 16384, 4, True), (16384, 16384, 8, True),
        (8192, 65536, 4, True), (4096, 65536, 4, True)]]


    def layout(name: str, size: int, n: int, gen: torch.Generator):
        """(item_bytes, device offsets, host offsets, device bytes, host bytes)."""
        item = size + 3 if name == "odd" else size
        slot = (item + 15) // 16 * 16
        dev_off = torch.randperm(n, generator=gen) * slot
        host_off = torch.arange(n) * item + (1 if name == "misaligned" else 0)
        return item, dev_off, host_off, n * slot, n * item + 16


    def contiguous_bw(total: int, dev: torch.Tensor, host: torch.Tensor, reps: int) -> dict:
        """GB/s of one big pinned copy in each direction."""
        d2h = timed(lambda: host[:total].copy_(dev[:total], non_blocking=True), reps, not DRY)
        h2d = timed(lambda: dev[:total].copy_(host[:total], non_blocking=True), reps, not DRY)
        return {"d2h": total / d2h / 1e9, "h2d": total / h2d / 1e9}


    def run_case(size, lay, direction, total, device, reps, configs, gen):
        n = max(1, total // size)
        item, dev_off, host_off, dev_bytes, host_bytes = layout(lay, size, n, gen)
        dev = torch.randint(0, 256, (dev_bytes,), dtype=torch.uint8, device=device)
        host = torch.empty(host_bytes, dtype=torch.uint8, pin_memory=not DRY)
        host.copy_(torch.randint(0, 256, (host_bytes,), dtype=torch.uint8, device=device))
        src, dst, so, do = (dev, host, dev_off, host_off) if direction == "d2h" else (host, dev, host_off, dev_off)
        so_d, do_d = so.to(device), do.to(device)
        moved = n * item
        orig = dst.clone()
        want = orig.to(device)
        copy_items_ref(src.to(device), want, so_d, do_d, item)
        m = min(n, LOOP_MAX_ITEMS)
        pairs = list(zip(so[:m].tolist(), do[:m].tolist()))

        def loop():
            for s, d in pairs:
                dst[d:d + item].copy_(src[s:s + item], non_blocking=True)

        loop_s = timed(loop, reps, not DRY)
        row = {"item_bytes": item, "layout": lay, "direction": direction, "items": n, "bytes": moved,
               "loop_items": m, "loop_gbps": m * item / loop_s / 1e9, "configs": []}
        for cfg in configs:
            dst.copy_(orig)
            secs = timed(lambda: copy_items_triton(src, dst, so_d, do_d, item, config=cfg), reps, not DRY)
            ok = torch.equal(dst.to(device), want)
            row["configs"].append({"block": cfg.block, "chunk": cfg.chunk, "num_warps": cfg.num_warps,
                                   "shifted": cfg.shifted, "gbps": moved / secs / 1e9, "bit_exact": ok})
        best = max(row["configs"], key=lambda c: c["gbps"])
        row.update(kernel_gbps=best["gbps"], bit_exact=all(c["bit_exact"] for c in row["configs"]),
                   best_config=[best["block"], best["chunk"], best["num_warps"], int(best["shifted"])])
        del dev, host, orig, want
        return row


    def main() -> None:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--json", help="write the rows here")
        ap.add_argument("--sweep", action="store_true", help="time the launch configs in SWEEP too")
        ap.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement")
        ap.add_argument("--reps", type=int, default=5)
        ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU interpreter")
        args = ap.parse_args()
        device = "cpu" if DRY else "cuda"
        total = (16 << 10) if DRY else args.total_mib << 20
        sizes = [2048, 16384] if DRY else SIZES
        reps = 1 if DRY else args.reps
        gen = torch.Generator().manual_seed(0)
        info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
                "device": "cpu-interpreter" if DRY else torch.cuda.get_device_name(), "total_bytes": total}
        if not DRY:
            big_dev = torch.empty(total, dtype=torch.uint8, device=device)
            big_host = torch.empty(total, dtype=torch.uint8).pin_memory()
            info["pinned_gbps"] = contiguous_bw(total, big_dev, big_host, reps)
            del big_dev, big_host
        else:
            info["pinned_gbps"] = {"d2h": float("nan"), "h2d": float("nan")}
        rows = []
        for size in sizes:
            configs = ([default_config(size)] + [c for c in SWEEP if c != default_config(size)]) if args.sweep \
                else [default_config(size)]
            for lay in LAYOUTS:
                for direction in DIRECTIONS:
                    row = run_case(size, lay, direction, total, device, reps, configs, gen)
                    row["default_gbps"] = row["configs"][0]["gbps"]
                    pinned = info["pinned_gbps"][direction]
                    row["pct_of_pinned"] = 100 * row["default_gbps"] / pinned
                    row["x_loop"] = row["default_gbps"] / row["loop_gbps"]
                    rows.append(row)
        pin = info["pinned_gbps"]
        print(f"{info['device']}  torch {info['torch']}  triton {info['triton']}  {info['date']}")
        print(f"contiguous pinned copy: D2H {pin['d2h']:.1f} GB/s, H2D {pin['h2d']:.1f} GB/s ({total >> 20} MiB)")
        head = f"{'item':>9} {'layout':>10} {'dir':>4} {'items':>7} {'kernel':>7} {'%pin':>5} {'loop':>6} " \
               f"{'x loop':>6} {'best':>7} {'best cfg':>20} exact"
        print(head)
        for r in rows:
            print(f"{r['item_bytes']:>9} {r['layout']:>10} {r['direction']:>4} {r['items']:>7} "
                  f"{r['default_gbps']:>7.1f} {r['pct_of_pinned']:>5.0f} {r['loop_gbps']:>6.2f} {r['x_loop']:>6.1f} "
                  f"{r['kernel_gbps']:>7.1f} {str(r['best_config']):>20} {r['bit_exact']}")
        if args.json:
            write_json(args.json, {**info, "rows": rows})
    return main() or 0


def _sampling(argv: list[str]) -> int:
    """Time the sampler and the sampling features (logprobs, penalties) at batch 64.

    python3 scripts/bench_kernels.py sampling [--json PATH] [--reps N]

On CUDA: batch 64, vocab 128256 and 49152, float32 logits, every case captured in a CUDA
graph and replayed; time per replay from CUDA events, median of ``--reps`` after warm-up.
Cases: plain greedy (torch argmax, the all-greedy step's sampler); sampled rows with the
previous row kernel (``method="rows"``) and the default path with the host flag the executor
would pass (``filtered`` only when some row has top-k/top-p); ``--sweep`` times the knobs; and the per-step extra
work of rows that ask for top-5 logprobs + repetition + frequency penalties (penalties out of
place, argmax of the penalised logits, logprobs, count update), as microseconds and as a
percentage of a ~1.3 ms 1B decode step.  Also checks that the two sampler paths agree and
counts the rows the window left to the row kernel.
Without CUDA: tiny shapes in the Triton CPU interpreter (a smoke test of the script).
Prints a table; ``--json`` writes the rows.
    """
    sys.argv = ["bench_kernels.py sampling", *argv]

    import argparse
    import json
    import statistics
    import time

    import torch


    ON_GPU = torch.cuda.is_available()
    if not ON_GPU:
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from kernels.interpreter_patch import patch_interpreter  # noqa: E402

    patch_interpreter()

    from kernels.logprobs import token_logprobs  # noqa: E402
    from kernels.penalties import PenaltyTables, apply_penalties, count_sampled, mark_prompt  # noqa: E402
    from kernels.sampling import sample  # noqa: E402
    from kernels.sampling_window import sample_window  # noqa: E402

    DEV = torch.device("cuda" if ON_GPU else "cpu")
    STEP_US_1B = 1300.0  # a 1B decode step at batch 64 on the H100 (docs/performance.md: ~1.33 ms)


    def time_us(fn, reps: int) -> float:
        """Median microseconds of ``fn``: a replayed CUDA graph timed by events (GPU), or wall clock (CPU)."""
        if not ON_GPU:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(5):
            graph.replay()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        return statistics.median(times)


    def params(S, kind, g):
        temp = torch.full((S,), 0.0 if kind == "greedy" else 0.8)
        top_k = torch.full((S,), 50 if "top_k" in kind else 0, dtype=torch.int64)
        top_p = torch.full((S,), 0.9 if "top_p" in kind else 1.0)
        min_p = torch.full((S,), 0.05 if "min_p" in kind else 0.0)
        seed = torch.randint(0, 2**62, (S,), generator=g, dtype=torch.int64)
        pos = torch.randint(0, 2**20, (S,), generator=g, dtype=torch.int64)
        return [t.to(DEV) for t in (temp, top_k, top_p, min_p, seed, pos)]


    def penalty_tables(S, V, g):
        t = PenaltyTables.allocate(S, V, DEV)
        slots = torch.arange(S, device=DEV)
        for _ in range(4):
            mark_prompt(t, slots.repeat(128), torch.randint(0, V, (S * 128,), generator=g).to(DEV))
        for _ in range(64):
            count_sampled(t, slots, torch.randint(0, V, (S,), generator=g).to(DEV))
        t.repetition[:S] = 1.3
        t.frequency[:S] = 0.5
        return t


    def bench_vocab(S, V, reps, rows, sweep=False):
        g = torch.Generator().manual_seed(V)
        logits = (torch.randn(S, V, generator=g) * 4).to(DEV)
        out = torch.empty(S, dtype=torch.int64, device=DEV)

        def add(case, us, **extra):
            rows.append(dict(case=case, S=S, V=V, us=round(us, 1), **extra))
            print(f"  S={S} V={V:>6}  {case:<44} {us:9.1f} us  {extra or ''}", flush=True)

        greedy_us = time_us(lambda: torch.argmax(logits, dim=-1, out=out), reps)
        add("greedy: torch.argmax (all-greedy step)", greedy_us)
        gp = params(S, "greedy", g)
        add("greedy: sample(greedy_only=True)", time_us(lambda: sample(logits, *gp, out=out, greedy_only=True), reps))
        add("greedy: sample(filtered=False)", time_us(lambda: sample(logits, *gp, out=out, filtered=False), reps))
        for kind in ("temperature", "min_p", "top_k", "top_p", "top_k+top_p"):
            p = params(S, kind, g)
            filtered = "top" in kind
            old = time_us(lambda: sample(logits, *p, out=out, method="rows"), max(5, reps // 4))
            new = time_us(lambda: sample(logits, *p, out=out, filtered=filtered), reps)
            done = torch.empty(S, dtype=torch.int32, device=DEV)
            sample_window(logits, *p, out, done, filtered=filtered)
            mism = int((sample(logits, *p, filtered=filtered) != sample(logits, *p, method="rows")).sum())
            add(f"{kind}: rows kernel (old)", old)
            add(f"{kind}: sample(filtered={filtered}) (new)", new, left_to_row_kernel=int((done == 0).sum()),
                mismatches_vs_old=mism)
        if sweep:
            p = params(S, "top_k+top_p", g)
            add("ref: torch.topk(logits, 1024)", time_us(lambda: torch.topk(logits, 1024, dim=-1), reps))
            add("ref: torch.topk(logits, 20)", time_us(lambda: torch.topk(logits, 20, dim=-1), reps))
            for chunk in (None, 4096, 8192):
                for cand in (256, 512, 1024):
                    add(f"sweep top_k+top_p chunk={chunk} cand={cand}",
                        time_us(lambda: sample(logits, *p, out=out, chunk=chunk, candidates=cand), reps))

        tables = penalty_tables(S, V, g)
        slots = torch.arange(S, device=DEV)
        pen = torch.empty(S, V, device=DEV)
        n5 = torch.full((S,), 5, dtype=torch.int32, device=DEV)
        lp_out = (torch.empty(S, 21, dtype=torch.int64, device=DEV), torch.empty(S, 21, device=DEV))

        def features():
            apply_penalties(logits, tables, slots, out=pen)
            torch.argmax(pen, dim=-1, out=out)
            token_logprobs(logits, out, n5, out=lp_out)
            count_sampled(tables, slots, out)

        off_tables = PenaltyTables.allocate(S, V, DEV)
        parts = {
            "penalties (rep 1.3 + freq 0.5, out of place)": lambda: apply_penalties(logits, tables, slots, out=pen),
            "penalties in place, no row penalised": lambda: apply_penalties(pen, off_tables, slots, out=pen),
            "logprobs top-5": lambda: token_logprobs(logits, out, n5, out=lp_out),
            "count_sampled": lambda: count_sampled(tables, slots, out),
        }
        for name, fn in parts.items():
            add(name, time_us(fn, reps))
        full = time_us(features, reps)
        extra = full - greedy_us
        add("greedy + top-5 logprobs + rep + freq penalties", full,
            extra_us=round(extra, 1), extra_pct_of_1b_step=round(100 * extra / STEP_US_1B, 1))


    def main() -> None:
        ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        ap.add_argument("--json", help="write the rows to this path")
        ap.add_argument("--reps", type=int, default=100)
        ap.add_argument("--sweep", action="store_true", help="also time the tuning knobs (chunk, candidates)")
        args = ap.parse_args()
        rows: list[dict] = []
        shapes = [(64, 128256), (64, 49152)] if ON_GPU else [(4, 3000)]
        t0 = time.time()
        print(f"device: {torch.cuda.get_device_name() if ON_GPU else 'cpu (Triton interpreter)'}")
        for S, V in shapes:
            bench_vocab(S, V, args.reps if ON_GPU else 1, rows, args.sweep)
        print(f"done in {time.time() - t0:.1f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name() if ON_GPU else "cpu", step_us_1b=STEP_US_1B,
                               rows=rows), f, indent=1)
    return main() or 0


def _sampling_step(argv: list[str]) -> int:
    """Decode step cost of the sampling features: plain greedy rows vs rows asking for logprobs and penalties.

One worker, 1B shape (``scripts/configs/llama-3.2-1b``, random bf16 weights), batch
``--batch`` (64), context ``--context``; for each case the same requests are admitted
again with the case's sampling, prefilled, then ``--steps`` decode steps run the way
the executor runs them (prepare -> launch -> copy out, two in flight).  Reported per
case: wall ms per step, GPU ms per step (CUDA events over the loop), the bucket's graph
replayed alone, and the cost over plain greedy (target: <= 10% for top-5
logprobs + repetition 1.3 + frequency 0.5).

Rows that ask for nothing run the same graph as before these features (the plain
greedy mode: forward, argmax, last_token); compare ``plain`` here with
``scripts/bench_decode.py --models llama-3.2-1b --batch 64`` on the previous commit
for "same as before".

    python3 scripts/bench_kernels.py sampling-step [--batch 64] [--context 512] [--steps 200] [--json OUT.json]
    """
    sys.argv = ["bench_kernels.py sampling-step", *argv]

    import argparse
    import time

    import torch

    from benchlib import write_json
    from executor_proc.build import build_worker
    from executor_proc.testing.synthetic import DecodeLoop, SyntheticPlanner
    from ipc.config import ExecutorConfig
    from ipc.protocol import SlotSampling

    CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    BLOCK_SIZE = 16


    def cases(context: int) -> dict[str, SlotSampling]:
        g = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, num_prompt_tokens=context)
        return {
            "plain greedy": SlotSampling(**g),
            "top-5 logprobs + rep 1.3 + freq 0.5": SlotSampling(**g, logprobs=5, repetition_penalty=1.3,
                                                                frequency_penalty=0.5),
            "top-5 logprobs": SlotSampling(**g, logprobs=5),
            "rep 1.3 + freq 0.5": SlotSampling(**g, repetition_penalty=1.3, frequency_penalty=0.5),
            "plain sampled (T=0.8)": SlotSampling(**{**g, "temperature": 0.8, "seed": 1}),
            "plain sampled + top-5 logprobs + penalties": SlotSampling(**{**g, "temperature": 0.8, "seed": 1},
                                                                        logprobs=5, repetition_penalty=1.3,
                                                                        frequency_penalty=0.5),
        }


    def run_case(worker, sampling: SlotSampling, args, vocab: int, blocks: int) -> dict:
        planner = SyntheticPlanner(args.batch, BLOCK_SIZE, blocks)
        g = torch.Generator().manual_seed(0)
        for _ in range(args.batch):
            planner.add(torch.randint(0, vocab, (args.context,), generator=g).tolist(), sampling)
        loop = DecodeLoop(worker, planner)
        for _ in range(1 + args.warmup):  # prefill, then decode (the first one may capture this mode's graph)
            loop.step()
        loop.drain()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(args.steps):
            loop.step()
        end.record()
        loop.drain()
        end.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
        bucket = worker.graphs.bucket_for(args.batch)
        mode = worker.prepare(planner.step()).mode  # the mode this case's decode steps run
        torch.cuda.synchronize()
        n = args.steps
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            worker.graphs.run(bucket, mode)
        e.record()
        e.synchronize()
        return dict(mode=mode._asdict(), step_ms=wall * 1e3, gpu_ms=start.elapsed_time(end) / args.steps,
                    replay_ms=s.elapsed_time(e) / n)


    def main(argv=None) -> int:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--model", default="llama-3.2-1b")
        ap.add_argument("--batch", type=int, default=64)
        ap.add_argument("--context", type=int, default=512)
        ap.add_argument("--steps", type=int, default=200)
        ap.add_argument("--warmup", type=int, default=10)
        ap.add_argument("--json", default=None)
        args = ap.parse_args(argv)
        t_start = time.perf_counter()
        max_len = args.context + args.warmup + args.steps + 64
        blocks = args.batch * -(-max_len // BLOCK_SIZE)
        cfg = ExecutorConfig(model=os.path.join(CONFIGS, args.model), plan_addr="", result_addr="", load_format="dummy",
                             device="cuda", dtype="bfloat16", num_slots=args.batch, num_kv_blocks=blocks,
                             block_size=BLOCK_SIZE, max_model_len=max_len, cuda_graph_max_batch=args.batch)
        built = build_worker(cfg)
        setup_s = time.perf_counter() - t_start
        rows = {}
        for name, sampling in cases(args.context).items():
            rows[name] = run_case(built.worker, sampling, args, built.model_config.vocab_size, blocks)
        base = rows["plain greedy"]
        print(f"{torch.cuda.get_device_name()}  {args.model}  batch {args.batch}  context {args.context}  "
              f"setup {setup_s:.1f} s")
        print(f"{'case':<45}{'step ms':>9}{'gpu ms':>9}{'replay ms':>11}{'vs plain':>10}")
        for name, r in rows.items():
            r["over_plain"] = r["replay_ms"] / base["replay_ms"] - 1
            print(f"{name:<45}{r['step_ms']:>9.3f}{r['gpu_ms']:>9.3f}{r['replay_ms']:>11.3f}{100 * r['over_plain']:>9.1f}%")
        target = rows["top-5 logprobs + rep 1.3 + freq 0.5"]["over_plain"]
        print(f"target (logprobs + penalties <= 10% over plain greedy): {'ok' if target <= 0.10 else 'MISS'}"
              f"  total {time.perf_counter() - t_start:.1f} s")
        if args.json:
            write_json(args.json, dict(gpu=torch.cuda.get_device_name(), model=args.model, batch=args.batch,
                                       context=args.context, steps=args.steps, setup_s=setup_s, cases=rows,
                                       command=" ".join(sys.argv)))
        return 0
    return main(argv) or 0


def _spec(argv: list[str]) -> int:
    """The cost of verifying K drafts: a step of K + 1 tokens per row against a decode step of 1, per batch size.

For each batch size B, B requests at a context of ``--context`` tokens (random weights of ``--model``), three
steps over the same rows, each launched alone (``Worker.launch``; CUDA events, median of ``--reps`` after warm-up;
on the cpu wall time, a check that it runs):

- ``decode``: one token per row, the decode graph of bucket B (what a step without speculation costs);
- ``verify graph``: the rows as K + 1-token chunks through the mixed-step graphs (body and head): what a verify
  step costs once it is captured;
- ``verify step``: the speculative rows as the executor runs them (``StepPlan.num_drafts``): greedy rows as
  decode rows in one graph (drafts by the n-gram kernel, the forward, argmax, acceptance and table updates:
  :mod:`executor_proc.step.spec_graphs`), other rows through the mixed-step graphs then the LM head of every
  position and acceptance, eagerly where they do not fit.

The ratios to ``decode`` are the verification's price; speculation pays when a row gains more accepted tokens.
With ``--profile PREFIX`` the kernels of the first batch size's decode and verify steps are listed in
``PREFIX.decode.txt`` and ``PREFIX.verify.txt`` (torch profiler, 10 launches each).

    python3 scripts/bench_kernels.py spec [--model llama-3-8b] [--batches 1,8,32,64] [--k 4] [--context 512]
                                          [--reps 20] [--device cuda] [--json OUT.json] [--profile PREFIX]
    """
    sys.argv = ["bench_kernels.py spec", *argv]

    import argparse
    import json
    import time

    import torch

    from bench_decode import profile_kernels
    from benchlib import write_json
    from executor_proc.build import build_worker
    from executor_proc.step.step_kinds import EagerStep, GraphStep, MixedStep, SpecDecodeStep
    from executor_proc.testing.synthetic import DecodeLoop, SyntheticPlanner
    from ipc.config import ExecutorConfig, SpeculativeConfig
    from ipc.protocol import StepPlan

    CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    BLOCK_SIZE = 16


    def plan(rows, n: int, prefill: bool, drafts: bool, vocab: int) -> StepPlan:
        """One step over ``rows`` (slot, next position): ``n`` tokens each, rewriting the KV of their last ``n``."""
        g = torch.Generator().manual_seed(n)
        return StepPlan(step_id=0, slots=[s for s, _ in rows], num_tokens=[n] * len(rows),
                        positions=[p - n for _, p in rows], is_prefill=[prefill] * len(rows),
                        sample=[True] * len(rows),
                        prefill_tokens=torch.randint(0, vocab, (n * len(rows),), generator=g).tolist() if prefill else [],
                        num_drafts=[n - 1] * len(rows) if drafts else [])


    def main(argv=None) -> int:
        ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        ap.add_argument("--model", default="llama-3-8b", help="a folder of scripts/configs, or a config path")
        ap.add_argument("--batches", default="1,8,32,64", help="batch sizes, comma-separated")
        ap.add_argument("--k", type=int, default=4, help="drafts per row")
        ap.add_argument("--context", type=int, default=512, help="tokens of context of each row")
        ap.add_argument("--reps", type=int, default=20, help="timed repetitions per case (median)")
        ap.add_argument("--device", default="cuda", help="cuda, or cpu (wall time of tiny shapes: a check that it runs)")
        ap.add_argument("--json", default=None, help="write the rows and metadata here")
        ap.add_argument("--profile", default=None, metavar="PREFIX",
                        help="kernels of the first batch's steps: PREFIX.{decode,verify}.txt")
        args = ap.parse_args(argv)
        cuda = args.device.startswith("cuda")
        batches = [int(b) for b in args.batches.split(",")]
        slots, k = max(batches), args.k
        model = args.model if os.path.exists(args.model) else os.path.join(CONFIGS, args.model)
        max_len = args.context + 64
        with open(os.path.join(model, "config.json")) as f:
            limit = json.load(f).get("max_position_embeddings", max_len)
        if max_len > limit:
            ap.error(f"--context {args.context}: the rows need {max_len} positions, the model has {limit}")
        blocks = slots * -(-max_len // BLOCK_SIZE)
        budget = max(2048, slots * (k + 1))
        cfg = ExecutorConfig(model=model, load_format="dummy", device=args.device,
                             dtype="bfloat16" if cuda else "float32", num_slots=slots, num_kv_blocks=blocks,
                             block_size=BLOCK_SIZE, max_model_len=max_len, max_num_batched_tokens=budget,
                             cuda_graph_max_tokens=budget, mixed_graphs="auto" if cuda else "on",
                             speculative=SpeculativeConfig(method="ngram", num_tokens=k))
        t0 = time.perf_counter()
        built = build_worker(cfg)
        setup_s = time.perf_counter() - t0
        worker, vocab = built.worker, built.model_config.vocab_size
        planner = SyntheticPlanner(slots, BLOCK_SIZE, blocks, max_prefill_tokens=budget, chunk_size=budget)
        g = torch.Generator().manual_seed(0)
        for _ in range(slots):
            planner.add(torch.randint(0, vocab, (args.context,), generator=g).tolist())
        loop = DecodeLoop(worker, planner)
        while any(r.computed < len(r.prompt) for r in planner.running) or planner.pending:
            loop.step()
        for _ in range(4):
            loop.step()
        loop.drain()
        rows = []
        for b in batches:
            live = [(r.slot, r.computed) for r in planner.running[:b]]
            decode = worker.prepare(plan(live, 1, False, False, vocab))
            assert isinstance(decode, GraphStep if cuda else MixedStep), type(decode).__name__
            t_decode = timed(lambda: worker.launch(decode), args.reps, cuda)
            mixed = worker.prepare(plan(live, k + 1, True, False, vocab))
            assert isinstance(mixed, MixedStep), type(mixed).__name__
            t_graph = timed(lambda: worker.launch(mixed), args.reps, cuda)
            spec = worker.prepare(plan(live, k + 1, False, True, vocab))
            assert isinstance(spec, SpecDecodeStep) or spec.spec is not None, type(spec).__name__
            t_spec = timed(lambda: worker.launch(spec), args.reps, cuda)
            if args.profile and b == batches[0]:
                profile_kernels(lambda: worker.launch(decode), f"{args.profile}.decode.txt")
                profile_kernels(lambda: worker.launch(spec), f"{args.profile}.verify.txt")
            kind = {SpecDecodeStep: "decode rows", MixedStep: "graphs", EagerStep: "eager"}[type(spec)]
            rows.append(dict(batch=b, k=k, context=args.context, decode_ms=t_decode * 1e3,
                             verify_graph_ms=t_graph * 1e3, verify_step_ms=t_spec * 1e3, verify_step_kind=kind,
                             graph_ratio=t_graph / t_decode, step_ratio=t_spec / t_decode))
        meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__, model=args.model, setup_s=setup_s,
                    command=" ".join(sys.argv))
        print(f"{meta['device']}  {args.model}  K={k}  context {args.context}  (setup {setup_s:.0f} s)")
        print(f"{'batch':>6}{'decode ms':>11}{'verify graph':>14}{'x':>7}{'verify step':>13}{'x':>7}  kind")
        for r in rows:
            print(f"{r['batch']:>6}{r['decode_ms']:>11.3f}{r['verify_graph_ms']:>14.3f}{r['graph_ratio']:>7.2f}"
                  f"{r['verify_step_ms']:>13.3f}{r['step_ratio']:>7.2f}  {r['verify_step_kind']}")
        if args.json:
            write_json(args.json, dict(meta=meta, rows=rows))
        return 0
    return main(argv) or 0


def _moe(argv: list[str]) -> int:
    """The fused MoE kernels' tiles on this GPU: every candidate of the start-up tuner, per model shape and size.

For each MoE config (random bf16 stacks, ``--layers`` copies so that L2 holds none, a fixed random routing of
``k`` distinct experts a token) and each token count: the routing and the grouping of the pairs by expert (torch
ops against each one-launch kernel),
then, while the pairs fit the per-pair form, its gate|up and down launches with every candidate tile, else the
grouped form's; ms of one pass over the layers (:func:`executor_proc.backends.gemv_tuning._time_pass`) and
the bandwidth of the experts' bytes the routing touches.  Each candidate is checked against the torch
reference first.

    python3 scripts/bench_kernels.py moe [--models qwen3-30b-a3b,qwen1.5-moe-a2.7b,mixtral-8x7b] [--ms 1,2,4,64]
                                         [--layers 8] [--json OUT]
    """
    sys.argv = ["bench_kernels.py moe", *argv]

    import argparse

    import torch

    from benchlib import write_json
    from executor_proc.backends.gemv_tuning import _time_pass
    from executor_proc.backends.moe_tuning import Experts, _routing
    from executor_proc.model.config import ModelConfig
    from kernels import moe as fused
    from kernels.moe_ref import align_by_expert_ref, moe_ref, route_ref
    from kernels.moe_route import route
    from triton.runtime.errors import OutOfResources

    def main() -> None:
        ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        ap.add_argument("--models", default="qwen3-30b-a3b,qwen1.5-moe-a2.7b,mixtral-8x7b",
                        help="MoE config names under scripts/configs")
        ap.add_argument("--ms", default="1,2,4,64", help="token counts to time")
        ap.add_argument("--layers", type=int, default=8, help="stacks per pass (each its own copy)")
        ap.add_argument("--reps", type=int, default=7, help="graph replays per candidate (median)")
        ap.add_argument("--json", default=None, help="write every timing to this JSON file")
        args = ap.parse_args()
        device = torch.device("cuda")
        rows, table = [], []
        for model in args.models.split(","):
            cfg = ModelConfig.from_pretrained(os.path.join(SCRIPTS, "configs", model))
            moe = cfg.moe
            E, k, I, H = moe.num_experts, moe.top_k, moe.intermediate_size, cfg.hidden_size
            layers = [Experts(torch.randn(E, 2 * I, H, device=device, dtype=torch.bfloat16) / H ** 0.5,
                              torch.randn(E, H, I, device=device, dtype=torch.bfloat16) / I ** 0.5)
                      for _ in range(args.layers)]
            for m in (int(v) for v in args.ms.split(",")):
                weights, ids = _routing(m, k, E, device)
                x = torch.randn(m, H, device=device, dtype=torch.bfloat16)
                touched = ids.unique().numel()
                gb_up, gb_down = [touched * n * 2 * args.layers / 1e9 for n in (2 * I * H, H * I)]
                logits = torch.randn(m, E, device=device, dtype=torch.bfloat16)
                times = {"route torch": _time_pass(lambda e: route_ref(logits, k, moe.renormalize), layers, args.reps),
                         "route kernel": _time_pass(lambda e: route(logits, k, moe.renormalize), layers, args.reps)}
                bm = fused.grouped_config(fused.MoEConfig(), m * k, E).block_m  # the grouped form's pairs by expert
                times["align torch"] = _time_pass(lambda e: align_by_expert_ref(ids, E, bm), layers, args.reps)
                times["align kernel"] = _time_pass(lambda e: fused.align_by_expert(ids, E, bm), layers, args.reps)
                want = moe_ref(x.float(), layers[0].w13.float(), layers[0].w2.float(), weights, ids)
                small = m * k <= fused.SMALL_MAX_PAIRS
                if small:
                    inter = fused.moe_up_small(x, layers[0].w13, ids, fused.SMALL_CONFIG.up)
                    for c in fused.UP_CANDIDATES:
                        got = fused.fused_moe_small(x, *layers[0], weights, ids,
                                                    fused.SmallConfig(c, fused.SMALL_CONFIG.down))
                        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2, (model, m, c)
                        times[("up", *c)] = _time_pass(lambda e, c=c: fused.moe_up_small(x, e.w13, ids, c), layers,
                                                       args.reps)
                    for c in fused.DOWN_CANDIDATES:
                        got = fused.fused_moe_small(x, *layers[0], weights, ids, fused.SmallConfig(c, c))
                        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2, (model, m, c)
                        times[("down", *c)] = _time_pass(
                            lambda e, c=c: fused.moe_down_small(inter, e.w2, ids, weights, c, x.dtype), layers,
                            args.reps)
                else:
                    for c in fused.GROUPED_CANDIDATES:
                        c = fused.grouped_config(c, m * k, E)
                        try:
                            got = fused.fused_moe_grouped(x, *layers[0], weights, ids, c)
                        except OutOfResources:  # a wide tile at block_m 64: not a candidate here (nor to the tuner)
                            continue
                        assert ((got.float() - want).norm() / want.norm()).item() < 2e-2, (model, m, c)
                        times[("grouped", *c)] = _time_pass(
                            lambda e, c=c: fused.fused_moe_grouped(x, *e, weights, ids, c), layers, args.reps)
                for key, t in times.items():
                    kind = key if isinstance(key, str) else key[0]
                    gb = {"up": gb_up, "down": gb_down, "grouped": gb_up + gb_down}.get(kind)
                    rows.append(dict(model=model, m=m, kind=kind, config=None if isinstance(key, str) else key[1:],
                                     ms=t, tb_s=gb / t if gb else None))
                table.append(f"{model:<18} m={m:<4} experts touched {touched}/{E}: route torch "
                             f"{times['route torch'] / args.layers * 1e3:.1f} us, kernel "
                             f"{times['route kernel'] / args.layers * 1e3:.1f} us a layer; align torch "
                             f"{times['align torch'] / args.layers * 1e3:.1f} us, kernel "
                             f"{times['align kernel'] / args.layers * 1e3:.1f} us")
                for kind, gb in (("up", gb_up), ("down", gb_down)) if small else (("grouped", gb_up + gb_down),):
                    mine = {key: t for key, t in times.items() if not isinstance(key, str) and key[0] == kind}
                    best = min(mine, key=mine.get)
                    default = (kind, *(fused.SMALL_CONFIG.up if kind == "up" else fused.SMALL_CONFIG.down)) \
                        if small else ("grouped", *fused.grouped_config(fused.MoEConfig(), m * k, E))
                    table.append(f"{'':>20}{kind:<8} best {mine[best] / args.layers * 1e3:7.1f} us a layer "
                                 f"({gb / mine[best]:.2f} TB/s) {best[1:]}; default "
                                 f"{mine.get(default, float('nan')) / args.layers * 1e3:.1f} us")
            del layers
            torch.cuda.empty_cache()
        print("\n".join(table))
        if args.json:
            write_json(args.json, dict(meta=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__),
                                       rows=rows))
    return main() or 0


SUBCOMMANDS = {"check": _check, "gemv": _gemv, "w8a8": _w8a8, "decode-attention": _decode_attention, "prefill-attention": _prefill_attention, "mixed-step": _mixed_step, "transfer": _transfer, "sampling": _sampling, "sampling-step": _sampling_step, "spec": _spec, "moe": _moe}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print(__doc__)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown sub-command {argv[0]!r}; one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
            return 2
        return 0
    return SUBCOMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
