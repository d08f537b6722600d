"""What a decode step pays for the host KV tier's backups, per block (built) vs per token row (HiSparse's).

One executor worker in this process (random weights of ``--model``, bf16, CUDA graphs) decodes
``--batch`` requests of ``--context``-token prompts, all in lockstep, the way the executor does
(prepare -> launch -> copy out, two steps in flight).  Each repetition starts from fresh
prompts (same context trajectory for every variant) and runs ``--steps`` decode steps; the
variants alternate, and each figure is the median over ``--reps`` repetitions:

* ``none``: no backups (the tier off);
* ``block_burst``: the plans carry the blocks the previous step filled, through
  ``HostKV`` (one ``copy_items`` of ``2 x layers x blocks`` items): in lockstep every
  request fills a block on the same step, so every ``block_size`` steps one step backs
  up ``batch`` blocks at once (the bench_host_kv tpot workload);
* ``block_spread``: the same bytes spread evenly, ``batch / block_size`` blocks each step
  (requests of mixed lengths, the usual case);
* ``token``: every step the previous step's new token rows, ``batch x 2 x layers`` items
  of one row each (HiSparse's granularity), one ``copy_items`` beside the step;
* suffixes: none = on the backup stream with ``HostKV``'s backup launch shape
  (``BACKUP_PROGRAMS`` programs looping over the items); ``_all`` = on the backup stream, one
  program per item and chunk (every SM); ``_p<N>``: N programs; ``_compute``: on the compute
  stream (every SM, in the step's order: HiSparse's comparison).

Reported per variant: wall ms per step (what TPOT is), GPU ms per step (CUDA events on the
compute stream over the loop), overhead vs ``none``; bytes and items per backup launch.  Then
each kind of launch alone on the idle GPU (CUDA events, median of 10): its time and GB/s with
``BACKUP_PROGRAMS`` programs and with every program.

    python3 scripts/bench_backup_granularity.py --json OUT.json          # H100, 8B shape
    python3 scripts/bench_backup_granularity.py --model DIR --device cpu --batch 4 --context 8 --steps 8 --reps 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

from _bench_util import write_json
from executor_proc.build import build_worker
from executor_proc.step.host_kv import BACKUP_PROGRAMS
from executor_proc.step.staging import PinnedStaging
from executor_proc.testing.synthetic import DecodeLoop, SyntheticPlanner
from ipc.config import ExecutorConfig
from kernels.transfer import TransferConfig, copy_items

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
VARIANTS = ("none", "block_burst", "block_burst_all", "block_burst_p4", "block_burst_p64", "block_burst_compute",
            "block_spread", "block_spread_all", "block_spread_compute", "token", "token_all", "token_compute")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(CONFIGS, "llama-3-8b"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


class TokenBackup:
    """Per-token-row backups beside each step: HostKV's stream discipline, with row-sized items."""

    def __init__(self, host_kv, block_size: int):
        self.hk, self.block_size = host_kv, block_size
        self.row_bytes = host_kv.item_bytes // block_size
        self.num_rows = host_kv.nbytes // self.row_bytes
        self.cursor = 0  # next host row (the host pool seen as rows; content is not checked)
        self.staging = PinnedStaging(host_kv.kv.storage.device)  # the executor's upload path, as HostKV's offsets

    def offsets(self, rows: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets of every (layer, K/V) item of the rows (device block, row in block): device, host."""
        hk = self.hk
        first = np.array([b * hk.item_bytes + r * self.row_bytes for b, r in rows], dtype=np.int64)
        d = (first[:, None] + hk._device_item[None, :]).reshape(-1)
        h = (self.cursor + np.arange(d.size, dtype=np.int64)) % self.num_rows * self.row_bytes
        self.cursor = (self.cursor + d.size) % self.num_rows
        return d, h

    def copy(self, rows: list[tuple[int, int]], stream, config) -> int:
        """Back up the rows on ``stream`` (None: the compute stream); items copied."""
        hk = self.hk
        d, h = self.offsets(rows)
        upload = self.staging.upload()
        parts = upload.add(d, torch.int64), upload.add(h, torch.int64)
        sent = upload.send()
        if hk.cuda and stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # after the rows' writer and this upload
            sent[parts[0]].record_stream(stream)
            with torch.cuda.stream(stream):
                copy_items(hk.kv.storage, hk.pool, sent[parts[0]], sent[parts[1]], self.row_bytes, config=config)
        elif hk.cuda:
            copy_items(hk.kv.storage, hk.pool, sent[parts[0]], sent[parts[1]], self.row_bytes, config=config)
        else:
            copy_items(hk.kv.storage, hk.pool, sent[parts[0]], sent[parts[1]], self.row_bytes)
        return d.size


def launch_config(variant: str) -> TransferConfig:
    """The backup launch shape a variant's suffix names (see the module docstring)."""
    tail = variant.rsplit("_", 1)[-1]
    if tail in ("all", "compute"):
        return TransferConfig()
    if tail.startswith("p") and tail[1:].isdigit():
        return TransferConfig(max_programs=int(tail[1:]))
    return TransferConfig(max_programs=BACKUP_PROGRAMS)


def time_launch(hk, tokens: TokenBackup, kind: str, batch: int, config: TransferConfig, reps: int = 10) -> dict:
    """One backup launch of ``kind`` alone on the idle GPU: median ms (CUDA events) and GB/s."""
    if kind == "token":
        d, h = tokens.offsets([(b, b % tokens.block_size) for b in range(batch)])
        item = tokens.row_bytes
    else:
        blocks = batch if kind == "block_burst" else max(1, batch // tokens.block_size)
        d, h = hk._offsets(list(range(blocks)), list(range(blocks)))
        item = hk.item_bytes
    dev = torch.from_numpy(np.stack([d, h])).to(hk.kv.storage.device)
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy_items(hk.kv.storage, hk.pool, dev[0], dev[1], item, config=config)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times[2:])
    return dict(items=int(d.size), item_bytes=item, ms=ms, gb_s=d.size * item / ms / 1e6)


class Run:
    """One repetition of one variant: fresh prompts, prefill, ``steps`` timed decode steps."""

    def __init__(self, args, worker, vocab: int, seed: int, first_step_id: int):
        self.args, self.worker = args, worker
        self.planner = SyntheticPlanner(args.batch, args.block_size, worker.kv_cache.num_blocks)
        self.planner.step_id = first_step_id  # step ids only grow, for the worker (its backup events)
        self.host_cursor = 0
        g = torch.Generator().manual_seed(seed)
        for _ in range(args.batch):
            self.planner.add(torch.randint(0, vocab, (args.context,), generator=g).tolist())

    def backups(self, variant: str, step: int) -> tuple[list[int], list[tuple[int, int]]]:
        """(block pairs for the plan, token rows) that ``variant`` backs up beside decode step ``step``."""
        bs, running = self.args.block_size, self.planner.running
        pos = self.args.context + step - 1  # the position the previous step wrote, per request
        if variant.startswith("token"):
            return [], [(r.blocks[pos // bs], pos % bs) for r in running]
        if variant.startswith("block_burst"):
            filled = running if (pos + 1) % bs == 0 else []
        elif variant.startswith("block_spread"):
            filled = [r for i, r in enumerate(running) if (i + step) % bs == 0]
        else:
            return [], []
        pairs = []
        for r in filled:
            pairs += [r.blocks[pos // bs], self.host_cursor % self.worker.host_kv.num_blocks]
            self.host_cursor += 1
        return pairs, []

    def time(self, variant: str, tokens: TokenBackup, backup_stream, releases: list[int]) -> dict:
        """Prefill (releasing the previous run's slots), warm up, time the decode steps; the slots used."""
        worker, cuda = self.worker, self.args.device.startswith("cuda")
        hk = worker.host_kv
        stream = None if variant.endswith("_compute") else backup_stream
        config = launch_config(variant)
        if cuda:
            hk.use_backup_launch(stream, config)
        loop = DecodeLoop(worker, self.planner)
        plans = [self.planner.step() for _ in range(3)]  # prefill, then two decode steps (warm-up)
        plans[0].releases = releases
        for plan in plans:
            step = worker.prepare(plan)
            loop.in_flight.append(worker.copy_out(worker.launch(step), step))
        loop.drain()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        items = launches = 0
        t0 = time.perf_counter()
        for i in range(self.args.steps):
            pairs, rows = self.backups(variant, i + 2)
            plan = self.planner.step()
            plan.backups = pairs
            step = worker.prepare(plan)  # the plan's block backups are enqueued at launch, beside the step
            if rows:
                items += tokens.copy(rows, stream, config)
            items += len(pairs) // 2 * 2 * worker.kv_cache.storage.shape[0]
            launches += bool(rows or pairs)
            loop.in_flight.append(worker.copy_out(worker.launch(step), step))
            while len(loop.in_flight) > loop.depth:
                loop.retire()
            worker.backups_done_through(plan.step_id)  # the output thread's poll
        if cuda:
            end.record()
        loop.drain()
        if cuda:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / self.args.steps
        gpu = start.elapsed_time(end) / 1e3 / self.args.steps if cuda else 0.0
        if cuda:
            hk.use_backup_launch(backup_stream)
        return dict(wall_ms=wall * 1e3, gpu_ms=gpu * 1e3, items=items, launches=launches,
                    slots=[r.slot for r in self.planner.running], next_step_id=self.planner.step_id)


def main(argv=None) -> dict:
    args = parse_args(argv)
    variants = args.variants.split(",")
    max_len = args.context + args.steps + 64
    blocks = args.batch * -(-max_len // args.block_size) + 64
    cfg = ExecutorConfig(model=args.model, plan_addr="", result_addr="", load_format="dummy", device=args.device,
                         dtype=args.dtype, num_slots=args.batch, num_kv_blocks=blocks, block_size=args.block_size,
                         max_model_len=max_len, cuda_graph_max_batch=args.batch, num_host_kv_blocks=4 * args.batch)
    built = build_worker(cfg)
    worker, mcfg = built.worker, built.model_config
    tokens = TokenBackup(worker.host_kv, args.block_size)
    backup_stream = worker.host_kv.backup_stream
    rows: dict[str, list[dict]] = {v: [] for v in variants}
    releases: list[int] = []
    step_id = 0
    for rep in range(args.reps):
        for v in variants:
            run = Run(args, worker, mcfg.vocab_size, seed=rep, first_step_id=step_id)
            rows[v].append(run.time(v, tokens, backup_stream, releases))
            releases, step_id = rows[v][-1].pop("slots"), rows[v][-1].pop("next_step_id")
    block_bytes = worker.host_kv.item_bytes * 2 * mcfg.num_layers
    out: dict = {"config": vars(args), "block_bytes": block_bytes, "row_item_bytes": tokens.row_bytes,
                 "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                 "torch": torch.__version__, "command": " ".join(sys.argv), "variants": {}}
    base = statistics.median(r["wall_ms"] for r in rows[variants[0]])
    print(f"{'variant':<22}{'wall ms':>9}{'gpu ms':>9}{'overhead':>10}{'MiB/step':>10}{'items/launch':>14}")
    for v in variants:
        wall = statistics.median(r["wall_ms"] for r in rows[v])
        gpu = statistics.median(r["gpu_ms"] for r in rows[v])
        items, launches = rows[v][0]["items"], rows[v][0]["launches"]
        item_bytes = tokens.row_bytes if v.startswith("token") else worker.host_kv.item_bytes
        mib = items * item_bytes / args.steps / 2**20
        out["variants"][v] = dict(wall_ms=wall, gpu_ms=gpu, overhead_pct=(wall / base - 1) * 100,
                                  mib_per_step=mib, items_per_launch=items / max(1, launches), runs=rows[v])
        print(f"{v:<22}{wall:>9.3f}{gpu:>9.3f}{(wall / base - 1) * 100:>9.2f}%{mib:>10.2f}"
              f"{items / max(1, launches):>14.0f}")
    if args.device.startswith("cuda"):
        print(f"{'launch alone':<22}{'programs':>9}{'items':>7}{'ms':>8}{'GB/s':>8}")
        out["launch_alone"] = {}
        for kind in ("block_burst", "block_spread", "token"):
            for name, config in ((str(BACKUP_PROGRAMS), launch_config("")), ("all", TransferConfig())):
                r = time_launch(worker.host_kv, tokens, kind, args.batch, config)
                out["launch_alone"][f"{kind}_{name}"] = r
                print(f"{kind:<22}{name:>9}{r['items']:>7}{r['ms']:>8.3f}{r['gb_s']:>8.1f}")
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
