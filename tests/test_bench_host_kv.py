"""scripts/bench_host_kv.py runs on the CPU with tiny settings (a random-weight 2-layer model), every mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.test_gpu_fastpath import write_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def run_script(tmp_path, script: str, *args: str):
    """Run ``scripts/SCRIPT`` on a random-weight 2-layer model with ``--json``; (its result, the JSON)."""
    model = tmp_path / "model"
    model.mkdir()
    write_config(model, hidden=64, layers=2, heads=4, kv_heads=2, vocab=300, intermediate=96)
    out = tmp_path / "out.json"
    run = subprocess.run([sys.executable, f"scripts/{script}", "--device", "cpu", "--model", str(model), *args,
                          "--json", str(out)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    return run, json.loads(out.read_text())


def test_every_mode_runs_and_reports(tmp_path):
    run, figures = run_script(tmp_path, "bench_host_kv.py", "--tiny")
    tpot, swap, chat = figures["tpot"], figures["swap"], figures["chat"]
    assert set(tpot) >= {"off", "backup_stream", "compute_stream"}
    assert tpot["off"]["host_blocks"] == 0 and tpot["backup_stream"]["host_blocks"] > 0
    assert all(tpot[k]["itl_ms_p50"] > 0 for k in ("off", "backup_stream", "compute_stream"))
    assert swap["off"]["preemptions"] > 0 and swap["on"]["preemptions"] > 0, "the swap workload must preempt"
    assert swap["off"]["host_hit_tokens"] == 0 and swap["on"]["host_hit_tokens"] > 0
    assert swap["recompute"]["query_tokens"] == 0, "the recompute baseline runs without prefix caching"
    assert chat["device_only"]["host_hit_tokens"] == 0 and chat["host_tier"]["host_hit_tokens"] > 0
    assert "host KV tier: chat" in run.stdout


def test_backup_granularity_bench_runs(tmp_path):
    _, figures = run_script(tmp_path, "bench_backup_granularity.py", "--dtype", "float32", "--batch", "4",
                            "--context", "8", "--block-size", "4", "--steps", "8", "--reps", "1")
    variants = figures["variants"]
    assert variants["none"]["items_per_launch"] == 0
    assert variants["block_burst"]["items_per_launch"] == 4 * 2 * 2  # every request's block, 2 layers x K/V
    assert variants["token"]["items_per_launch"] == 4 * 2 * 2  # every request's row, 2 layers x K/V
    assert variants["block_spread"]["mib_per_step"] == pytest.approx(variants["token"]["mib_per_step"])


def test_simulation_resumes_by_copy_and_hits_the_host():
    """scripts/sim_host_kv.py: the real planner on a modelled clock; small workloads, both modes."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    swap = subprocess.run([sys.executable, "scripts/sim_host_kv.py", "swap", "--requests", "8", "--context-len", "256",
                           "--output-len", "96", "--pool-fraction", "0.5"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert swap.returncode == 0, swap.stderr
    lines = {line.split()[0]: line for line in swap.stdout.splitlines()}
    assert "'resumes': 1" in lines["recompute"] and "'host_hit_tokens': 0," not in lines["on"]
    chat = subprocess.run([sys.executable, "scripts/sim_host_kv.py", "chat", "--conversations", "20", "--concurrency",
                           "4", "--first-len", "64"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert chat.returncode == 0, chat.stderr
    assert "'host_hit_tokens': 0," not in chat.stdout.splitlines()[1]
