"""Start-up memory plans against what serving takes: one `forerun serve` per cell of a matrix.

    python scripts/bench_memory.py --models llama-3.2-1b,llama-3-8b --max-num-seqs 64,256,512,1024 \\
        --max-num-batched-tokens 2048,8192,16384 --json out.json

For each (model, --max-num-seqs, --max-num-batched-tokens) cell a server starts (random weights of the
config's shape, ``--load-format dummy``, CUDA graphs on), prints its memory plan (parsed here), and serves
a load through the SDK that reaches every step kind at its largest size (:func:`drive`): every slot
decoding at once (greedy and sampled rows), prefill steps of the full token budget, prompt logprobs over
the full budget (the eager path), logprobs and penalties as the batch drains (lazy captures of other
sampling modes), and a prefix-cache reset followed by the same prompts (onloads from the host tier).
Then it reads the executor's device memory from the server's stats: the allocator's peak reserved bytes
while serving and the least free memory seen.  A cell passes when it started, served every request
without an error, and the peak stayed within what the plan lets torch's allocator hold (``cap``: ``planned`` =
weights + activations + graphs + KV, and the budget's rest where the KV cache was capped at what the slots use).

``--quick`` sends a short load (every slot decoding, one full-budget prefill and one prompt-logprob
step) instead: the matrix's cheap form.  Prints a table; ``--json PATH`` writes every cell's figures.
Where there is no GPU, ``--device cpu`` runs the same cells on the cpu (the smoke test's tiny case).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

from benchlib import format_table, ipc_address, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "scripts", "configs")
GIB = 1024**3
START_TIMEOUT_S = 600.0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-3.2-1b,llama-3-8b",
                    help="comma-separated config folders under scripts/configs, or paths to config folders")
    ap.add_argument("--max-num-seqs", type=_ints, default=[64, 256, 512, 1024], metavar="N,N,...",
                    help="--max-num-seqs of the cells (comma-separated)")
    ap.add_argument("--max-num-batched-tokens", type=_ints, default=[2048, 8192, 16384], metavar="N,N,...",
                    help="--max-num-batched-tokens of the cells (comma-separated)")
    ap.add_argument("--cells", default="", metavar="MODEL:SEQS:TOKENS,...",
                    help="run these cells only (e.g. llama-3.2-1b:256:8192,llama-3-8b:1024:16384), not the matrix")
    ap.add_argument("--device", default="cuda", help="the servers' --device")
    ap.add_argument("--serve-args", default="", help="more `forerun serve` flags for every cell (one string)")
    ap.add_argument("--quick", action="store_true",
                    help="a short load per cell: every slot decoding, one full-budget prefill, one prompt-logprob "
                         "step")
    ap.add_argument("--output-len", type=int, default=32, help="tokens each decoding request generates")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="skip the cells that would start after this many seconds (0: no deadline)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every cell's figures here")
    return ap.parse_args(argv)


def model_folder(name: str) -> str:
    """A config folder under scripts/configs by its name, else the path given."""
    return os.path.join(CONFIGS, name) if os.path.isdir(os.path.join(CONFIGS, name)) else name


class Server:
    """``forerun serve`` for one cell; its start-up lines, and the plan parsed from them."""

    def __init__(self, model: str, seqs: int, tokens: int, device: str, extra: list[str], run_dir: str):
        self.address = ipc_address(run_dir)
        cmd = [sys.executable, "-m", "scheduler_proc.launch", "serve", "--address", self.address, "--quiet",
               "--device", device, "--load-format", "dummy", "--model", model_folder(model),
               "--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(tokens), *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1", FORERUN_RUN_DIR=run_dir,
                   PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
        t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.log: list[str] = []
        watchdog = threading.Timer(START_TIMEOUT_S, self.proc.kill)
        watchdog.start()
        try:
            for line in iter(self.proc.stdout.readline, ""):
                self.log.append(line)
                if "ready at" in line:
                    break
        finally:
            watchdog.cancel()
        self.ready = any("ready at" in line for line in self.log)
        self.start_s = time.monotonic() - t0
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()

    def _read_rest(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.log.append(line)

    def line(self, prefix: str) -> str:
        return next((ln.strip() for ln in self.log if ln.startswith(prefix)), "")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._drain.join(timeout=5)
        return self.proc.returncode


def parse_plan(line: str) -> dict[str, float]:
    """The numbers of a `forerun: memory plan: ...` line (GiB, and the KV tokens)."""
    out: dict[str, float] = {}
    for name in ("weights", "activations", "graphs", "other", "KV"):
        m = re.search(rf"{name} ([0-9.]+)", line)
        if m:
            out[name.lower()] = float(m.group(1))
    m = re.search(r"= ([0-9.]+) GiB of ([0-9.]+)", line)
    if m:
        out["used"], out["budget"] = float(m.group(1)), float(m.group(2))
    m = re.search(r"KV ([0-9,]+) tokens", line) or re.search(r"= ([0-9,]+) tokens", line)
    if m:
        out["kv_tokens"] = int(m.group(1).replace(",", ""))
    return out


async def drive(address: str, seqs: int, tokens: int, output_len: int = 32, quick: bool = False) -> dict[str, Any]:
    """Every step kind at its largest size (module docstring); the request count, errors, and the stats."""
    from ipc.client import AsyncClient

    errors: list[str] = []
    done = 0

    async def one(client, ids, **kw) -> None:
        nonlocal done
        try:
            await client.generate(prompt_token_ids=ids, detokenize=False, ignore_eos=True, **kw)
            done += 1
        except Exception as e:  # every failure is a cell's error, counted and shown
            errors.append(f"{type(e).__name__}: {e}"[:200])

    async with AsyncClient(address, timeout=600) as client:
        info = await client.connect()
        vocab, max_model_len = info.vocab_size, info.max_model_len
        prompt = lambda i, n: [(i * 7919 + j * 31) % (vocab - 1) + 1 for j in range(n)]  # noqa: E731
        longest = max(2, min(tokens, max_model_len - output_len - 1))
        full = [prompt(10_000 + i, longest) for i in range(max(1, -(-tokens // longest)))]  # one step's budget
        # Every slot decoding at once, half greedy, half sampled (top-p): the largest decode graphs.
        await asyncio.gather(*(one(client, prompt(i, 16), max_tokens=output_len,
                                   temperature=0.0 if i % 2 else 1.0, top_p=0.9, seed=i) for i in range(seqs)))
        # The full token budget in prefill chunks (the largest mixed bodies), then with every prompt
        # position's logprobs (the eager path's largest step: the LM head for every token).
        await asyncio.gather(*(one(client, ids, max_tokens=2) for ids in full))
        await asyncio.gather(*(one(client, [t + 1 for t in ids], max_tokens=2, prompt_logprobs=5, logprobs=5,
                                   repetition_penalty=1.1) for ids in full))
        if not quick:
            # Logprobs and penalties on every slot, finishing at different lengths: lazy captures of those
            # sampling modes at every bucket as the batch drains.
            await asyncio.gather(*(one(client, prompt(20_000 + i, 16), max_tokens=1 + i % output_len,
                                       temperature=1.0, top_k=20, logprobs=3, presence_penalty=0.5, seed=i)
                                   for i in range(seqs)))
            await asyncio.gather(*(one(client, prompt(30_000 + i, 16), max_tokens=1 + i % output_len,
                                       temperature=0.0, logprobs=1) for i in range(seqs)))
            # The prefix cache emptied, then the same prompts: their blocks come back from the host tier.
            await client.reset_prefix_cache()
            await asyncio.gather(*(one(client, ids, max_tokens=2) for ids in full))
        await asyncio.sleep(1.2)  # the executor samples its memory at most once a second: one more sample
        await one(client, prompt(1, 4), max_tokens=2)
        stats = await client.get_stats()
    return dict(requests=done, errors=errors, peak=stats.device_peak_bytes, free_min=stats.device_free_min_bytes)


def run_cell(model: str, seqs: int, tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    cell: dict[str, Any] = dict(model=model, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    with tempfile.TemporaryDirectory(prefix="fr-mem-") as run_dir:
        server = Server(model, seqs, tokens, args.device, args.serve_args.split(), run_dir)
        cell.update(started=server.ready, start_s=round(server.start_s, 1))
        plan_line = server.line("forerun: memory plan")
        cell["plan_line"] = plan_line
        cell["plan"] = parse_plan(plan_line)
        print(f"{model} seqs {seqs} tokens {tokens}: {'ready' if server.ready else 'not ready'} after "
              f"{cell['start_s']} s; {plan_line}", flush=True)  # before the load: a cell cut off still shows it
        # The final capture's own figure (the plan's graphs were measured on the first): the two should agree.
        graphs = re.search(r"CUDA graphs captured in ([0-9.]+) s, ([0-9]+) MiB", "".join(server.log))
        if graphs:
            cell["capture_s"], cell["graphs_final_gib"] = float(graphs.group(1)), round(int(graphs.group(2)) / 1024, 2)
        if not server.ready:
            server.stop()
            cell["error"] = "".join(server.log[-8:]).strip()[-1500:]
            wait_for_free_device(args.device)
            return finish(cell, args)
        try:
            load = asyncio.run(drive(server.address, seqs, tokens, args.output_len, args.quick))
            cell.update(load)
        except Exception as e:
            cell["error"] = f"{type(e).__name__}: {e}"[:600]
        cell["exit_code"] = server.stop()
        cell["oom_in_log"] = any("OutOfMemoryError" in line or "out of memory" in line for line in server.log)
    wait_for_free_device(args.device)
    return finish(cell, args)


def wait_for_free_device(device: str, timeout_s: float = 60.0) -> None:
    """Until the stopped server's executors have let go of their GPUs (they die with the scheduler, a moment
    later): the GPUs ``CUDA_VISIBLE_DEVICES`` names (all of them when it is unset), so that two matrices can run
    side by side on two GPUs of one machine."""
    if not device.startswith("cuda"):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").replace(" ", "")
    ids = ["--id=" + visible] if visible and all(x.isdigit() for x in visible.split(",")) else []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(["nvidia-smi", *ids, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            return
        if not out or all(int(x) < 1024 for x in out):
            return
        time.sleep(0.5)


def finish(cell: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The cell's totals and verdict."""
    plan = cell["plan"]
    planned_gib = sum(plan.get(k, 0.0) for k in ("weights", "activations", "graphs", "kv"))
    cell["planned_gib"] = round(planned_gib, 2)
    # What the allocator may hold: the plan's parts, and the budget's rest where the KV cache did not take it
    # (capped at what the slots can use): executor_proc.memory_plan.allocator_cap.
    cell["cap_gib"] = round(planned_gib + max(0.0, plan.get("budget", 0.0) - plan.get("used", 0.0)), 2)
    cell["peak_gib"] = round(cell.get("peak", 0) / GIB, 2)
    cell["free_min_gib"] = round(cell.get("free_min", 0) / GIB, 2)
    # The plan's parts are printed to 0.01 GiB: four of them round by 0.02 GiB at most.
    cell["within_plan"] = bool(cell.get("peak")) and cell["peak_gib"] <= cell["cap_gib"] + 0.02
    cell["ok"] = bool(cell["started"] and not cell.get("errors") and not cell.get("error")
                      and not cell.get("oom_in_log") and (cell["within_plan"] or args.device == "cpu"))
    return cell


def cells_of(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    if args.cells:
        out = []
        for spec in args.cells.split(","):
            model, seqs, tokens = spec.rsplit(":", 2)
            out.append((model, int(seqs), int(tokens)))
        return out
    return [(m, s, t) for m in args.models.split(",") for s in args.max_num_seqs for t in args.max_num_batched_tokens]


def main(argv: Optional[list[str]] = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    t0 = time.monotonic()
    results = []
    for model, seqs, tokens in cells_of(args):
        if args.deadline_s and time.monotonic() - t0 > args.deadline_s:
            results.append(dict(model=model, max_num_seqs=seqs, max_num_batched_tokens=tokens, skipped=True))
            print(f"skipped {model} {seqs} {tokens}: past --deadline-s", flush=True)
            continue
        cell = run_cell(model, seqs, tokens, args)
        results.append(cell)
        if args.json:  # after every cell: a run cut off keeps the cells it finished
            write_json(args.json, dict(device=args.device, quick=args.quick, cells=results))
        print(f"{model} seqs {seqs} tokens {tokens}: {'ok' if cell['ok'] else 'FAILED'} {cell.get('plan_line', '')}"
              f" | peak {cell['peak_gib']} GiB, free min {cell['free_min_gib']} GiB, {cell.get('requests', 0)} "
              f"requests, errors {len(cell.get('errors', []))} {cell.get('error', '')[:300]}", flush=True)
    rows = [("model / seqs / tokens", "weights | act | graphs (final) | other | KV GiB | KV tokens | planned | peak | "
             "cap | free min | start s | ok")]
    for c in results:
        key = f"{os.path.basename(c['model'])} / {c['max_num_seqs']} / {c['max_num_batched_tokens']}"
        if c.get("skipped"):
            rows.append((key, "skipped"))
            continue
        p = c.get("plan", {})
        rows.append((key, " | ".join([f"{p.get('weights', 0):.2f}", f"{p.get('activations', 0):.2f}",
                                      f"{p.get('graphs', 0):.2f} ({c.get('graphs_final_gib', 0):.2f})",
                                      f"{p.get('other', 0):.2f}", f"{p.get('kv', 0):.2f}",
                                      f"{int(p.get('kv_tokens', 0)):,}", f"{c['planned_gib']:.2f}",
                                      f"{c['peak_gib']:.2f}", f"{c['cap_gib']:.2f}", f"{c['free_min_gib']:.2f}",
                                      f"{c['start_s']:.0f}",
                                      "ok" if c["ok"] else "FAILED"])))
    print(format_table(rows, title="memory plan vs serving (GiB)"))
    if args.json:
        write_json(args.json, dict(device=args.device, quick=args.quick, cells=results))
    return results


if __name__ == "__main__":
    sys.exit(0 if all(c.get("ok") or c.get("skipped") for c in main()) else 1)
