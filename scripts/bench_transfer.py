"""Bandwidth of the item-copy kernel (kernels/transfer.py) between the GPU and pinned host memory.

    python3 scripts/bench_transfer.py [--json PATH] [--sweep] [--total-mib 256] [--dry]

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

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch

DRY = "--dry" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.interpreter_patch import patch_interpreter  # noqa: E402

patch_interpreter()

import triton  # noqa: E402

from _bench_util import write_json  # noqa: E402
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


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up (events on the GPU)."""
    fn()
    times = []
    for _ in range(reps):
        if DRY:
            t0 = datetime.datetime.now()
            fn()
            times.append((datetime.datetime.now() - t0).total_seconds())
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def contiguous_bw(total: int, dev: torch.Tensor, host: torch.Tensor, reps: int) -> dict:
    """GB/s of one big pinned copy in each direction."""
    d2h = timed(lambda: host[:total].copy_(dev[:total], non_blocking=True), reps)
    h2d = timed(lambda: dev[:total].copy_(host[:total], non_blocking=True), reps)
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

    loop_s = timed(loop, reps)
    row = {"item_bytes": item, "layout": lay, "direction": direction, "items": n, "bytes": moved,
           "loop_items": m, "loop_gbps": m * item / loop_s / 1e9, "configs": []}
    for cfg in configs:
        dst.copy_(orig)
        secs = timed(lambda: copy_items_triton(src, dst, so_d, do_d, item, config=cfg), reps)
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
    total = (64 << 10) if DRY else args.total_mib << 20
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


if __name__ == "__main__":
    main()
