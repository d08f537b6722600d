"""Why a swap resume stalled (issue 12; docs/performance.md, "Host KV tier"): the host tier's onload, timed alone.

The H100 swap run's step logs showed each resume step taking ~370 ms of GPU time *and* the executor's
main thread blocked until that step had run (the next plan, already there, was read only then). This
script separates the candidates, in one process, 8B shape (32 layers, 8 KV heads, dim 128, block 16:
2 MiB a block, 64 items of 32 KiB):

* ``alignment``: host ms of ``prefill_attention`` and ``rope_kv_write`` calls whose index arguments are
  views at a 16-byte boundary or 8 bytes past one (the executor's upload placed its parts at 8-byte
  places): a call far slower than the cached one compiled a new kernel variant;
* ``pinned``: host ms of a new pinned allocation while the GPU is idle and while a ~200 ms kernel runs
  on another stream (does it wait for the device?);
* ``onload``: a ``--blocks``-block onload through ``HostKV`` (host ms of ``stage``; GPU ms on the copy
  stream), from a ``--host-blocks`` pool (12 GiB) and from a pool of just those blocks (256 MiB), with
  the executor's launch (one program per item and chunk) and with a few looping programs; beside a
  backup burst of as many blocks on the backup stream; beside matmuls on the compute stream. Fresh
  random blocks per repetition, median of ``--reps``; the onloaded bytes are checked.

    python3 scripts/bench_onload.py --json OUT.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
import triton

from _bench_util import write_json
from executor_proc.model.kv_cache import KVCache
from executor_proc.step.host_kv import HostKV
from executor_proc.step.staging import PinnedStaging
from ipc.protocol import StepPlan
from kernels.kv_write import rope_cos_sin_cache, rope_kv_write
from kernels.prefill_attention import prefill_attention
from kernels.transfer import TransferConfig, copy_items

LAYERS, KV_HEADS, HEAD_DIM, HEADS, BLOCK = 32, 8, 128, 32, 16


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device-blocks", type=int, default=2188, help="the swap run's device pool")
    ap.add_argument("--host-blocks", type=int, default=6080, help="the swap run's host pool (12 GiB)")
    ap.add_argument("--blocks", type=int, default=128, help="blocks per onload")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def host_ms(fn) -> float:
    """Host ms of ``fn()`` and the device work it enqueued (synchronized before and after)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def alignment(dev: torch.device) -> dict:
    """First-call host ms of the eager kernels with index views 16-byte aligned or 8 bytes past."""
    T, nb = 14, 256
    q = torch.randn(T, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(T, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(2))
    kc, vc = (torch.randn(nb, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16) for _ in range(2))
    bt = torch.randint(0, nb, (T, 160), dtype=torch.int32, device=dev)
    buf = torch.zeros(4096, dtype=torch.uint8, device=dev)
    cos_sin = rope_cos_sin_cache(1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM)),
                                 4096)
    kv_index = torch.arange(T, device=dev, dtype=torch.int64) * 7

    def view(off: int, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(values, dtype=dtype)
        out = buf[off:off + t.numel() * t.element_size()].view(dtype)
        out.copy_(t.to(dev))
        return out

    def attn(qs_off, cl_off):
        qs, cl = view(qs_off, list(range(T + 1)), torch.int32), view(cl_off, [2000 + i for i in range(T)], torch.int32)
        return lambda: prefill_attention(q, kc, vc, bt, qs, cl, 1, 0.088)

    def rope(pos_off):
        pos = view(pos_off, [1999 + i for i in range(T)], torch.int64)
        return lambda: rope_kv_write(q.clone(), k, v, pos, cos_sin, kc, vc, kv_index)

    calls = [("attn qs@16 cl@16 (first call)", attn(0, 128)), ("attn qs@16 cl@16 again", attn(0, 128)),
             ("attn qs@8 cl@16", attn(8, 128)), ("attn qs@8 cl@16 again", attn(8, 128)),
             ("attn qs@16 cl@8", attn(0, 136)), ("attn qs@8 cl@8", attn(8, 136)),
             ("rope pos@16 (first call)", rope(256)), ("rope pos@16 again", rope(256)),
             ("rope pos@8", rope(264)), ("rope pos@8 again", rope(264))]
    return {name: host_ms(fn) for name, fn in calls}


def pinned(dev: torch.device) -> dict:
    """Host ms of new pinned allocations, idle and while a ~200 ms kernel runs on a side stream."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(10_000_000)
    e1.record()
    e1.synchronize()
    cycles = int(10_000_000 * 200 / max(e0.elapsed_time(e1), 1e-3))
    out, keep = {}, [torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)]  # the allocator's own start-up
    for label, busy in (("idle", False), ("busy", True)):
        for mib in (1, 8) if not busy else (2, 16):  # new power-of-two sizes: the caching allocator has none
            side = torch.cuda.Stream(dev)
            if busy:
                with torch.cuda.stream(side):
                    torch.cuda._sleep(cycles)
            t = time.perf_counter()
            keep.append(torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True))
            out[f"pin {mib} MiB, GPU {label} ms"] = (time.perf_counter() - t) * 1e3
            torch.cuda.synchronize()
    return out


def onload_plan(rng: torch.Generator, hk: HostKV, blocks: int, step_id: int) -> StepPlan:
    host = torch.randperm(hk.num_blocks, generator=rng)[:blocks]
    device = torch.randperm(hk.kv.storage.shape[2], generator=rng)[:blocks]
    pairs = torch.stack([host, device], 1).reshape(-1).tolist()
    return StepPlan(step_id, [], [], [], [], [], onloads=pairs)


def timed_stage(hk: HostKV, plan: StepPlan, staging: PinnedStaging, before=None) -> tuple[float, float]:
    """(host ms of ``HostKV.stage``, GPU ms of the onload on the copy stream); ``before()`` runs just before."""
    torch.cuda.synchronize()
    if before is not None:
        before()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(hk.copy_stream)
    t = time.perf_counter()
    upload = staging.upload()
    parts = hk.stage(plan, upload)
    host = (time.perf_counter() - t) * 1e3
    end.record(hk.copy_stream)
    hk.copy(plan.step_id, parts, upload.send())
    torch.cuda.synchronize()
    return host, start.elapsed_time(end)


def launch_ms(hk: HostKV, plan: StepPlan, config) -> float:
    """GPU ms of the plan's onload as one ``copy_items`` with ``config`` (offsets on the device beforehand)."""
    src, dst = hk._onload_offsets(torch.tensor(plan.onloads, dtype=torch.int64, device=hk.kv.storage.device))
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    copy_items(hk.pool, hk.kv.storage, src, dst, hk.item_bytes, config=config)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def mark(hk: HostKV, plan: StepPlan, rng: torch.Generator) -> list[tuple[int, int]]:
    """Random bytes in the plan's first 3 source blocks, a constant in their targets; the pairs to check."""
    pairs = list(zip(plan.onloads[0:6:2], plan.onloads[1:6:2]))
    for h, d in pairs:
        hk.pool[h].view(torch.int16).copy_(torch.randint(-2**15, 2**15, hk.pool[h].shape, generator=rng,
                                                         dtype=torch.int16))
        hk.kv.storage[:, :, d].view(torch.int16).fill_(7)
    return pairs


def check(hk: HostKV, pairs: list[tuple[int, int]]) -> bool:
    return all(torch.equal(hk.kv.storage[:, :, d].reshape(hk.pool[h].shape).cpu().view(torch.int16),
                           hk.pool[h].view(torch.int16)) for h, d in pairs)


def onload_figures(hk: HostKV, args, rng, matmul) -> dict:
    """One pool's figures (medians over reps)."""
    staging, n, mib = PinnedStaging(hk.kv.storage.device), args.blocks, args.blocks * 2
    sid = iter(range(1 << 30))
    first = timed_stage(hk, onload_plan(rng, hk, n, next(sid)), staging)
    runs = {"stage": [], "alone": [], "p16": [], "p132": [], "p528": [], "burst": [], "matmul": []}
    ok = True
    for _ in range(args.reps):
        plan = onload_plan(rng, hk, n, next(sid))
        pairs = mark(hk, plan, rng)
        runs["stage"].append(timed_stage(hk, plan, staging))
        ok = ok and check(hk, pairs)
        runs["alone"].append(launch_ms(hk, plan, None))
        for p in (16, 132, 528):
            runs[f"p{p}"].append(launch_ms(hk, plan, TransferConfig(max_programs=p)))
        other = onload_plan(rng, hk, n, next(sid))
        burst = [x for pair in zip(other.onloads[1::2], other.onloads[0::2]) for x in pair]  # (device, host)

        def backup_burst():
            up = staging.upload()
            parts = hk.stage(StepPlan(next(sid), [], [], [], [], [], backups=burst), up)
            hk.copy(0, parts, up.send())
            hk.start_backups()
        runs["burst"].append(timed_stage(hk, plan, staging, backup_burst)[1])
        runs["matmul"].append(timed_stage(hk, plan, staging, matmul)[1])
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = {"pool_gib": hk.nbytes / 2**30, "first_stage_host_ms": first[0], "first_onload_gpu_ms": first[1],
           "stage_host_ms": med([h for h, _ in runs["stage"]]), "onload_gpu_ms": med([g for _, g in runs["stage"]]),
           "launch_default_ms": med(runs["alone"]), "launch_p16_ms": med(runs["p16"]),
           "launch_p132_ms": med(runs["p132"]), "launch_p528_ms": med(runs["p528"]),
           "beside_backup_burst_ms": med(runs["burst"]), "beside_matmuls_ms": med(runs["matmul"]), "bytes_ok": ok}
    out["onload_gb_s"] = mib * 2**20 / (out["onload_gpu_ms"] * 1e6)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    dev = torch.device("cuda")
    figures: dict = {"config": vars(args), "torch": torch.__version__, "triton": triton.__version__,
                     "gpu": torch.cuda.get_device_name(dev)}

    def section(name, fn):
        t = time.perf_counter()
        try:
            figures[name] = fn()
        except Exception as e:  # one section's failure must not hide the others
            figures[name] = {"error": f"{type(e).__name__}: {e}"}
        figures[name + "_s"] = time.perf_counter() - t
        print(name, figures[name], flush=True)
        if args.json:
            write_json(args.json, figures)

    section("alignment", lambda: alignment(dev))
    section("pinned", lambda: pinned(dev))
    kv = KVCache(SimpleNamespace(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM),
                 num_blocks=args.device_blocks, block_size=BLOCK, device=dev, dtype=torch.bfloat16)
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    matmul = lambda: [a @ a for _ in range(8)]  # noqa: E731  (~10 ms on the compute stream)
    rng = torch.Generator().manual_seed(0)
    for name, blocks in (("small_pool", args.blocks), ("large_pool", args.host_blocks)):
        section(name, lambda: onload_figures(HostKV(kv, blocks, dev), args, rng, matmul))
        torch.cuda.empty_cache()
    return figures


if __name__ == "__main__":
    main()
