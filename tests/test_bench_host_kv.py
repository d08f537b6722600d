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


def test_every_mode_runs_and_reports(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    write_config(model, hidden=64, layers=2, heads=4, kv_heads=2, vocab=300, intermediate=96)
    out = tmp_path / "host_kv.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "scripts/bench_host_kv.py", "--device", "cpu", "--model", str(model),
                          "--tiny", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    tpot, swap, chat = figures["tpot"], figures["swap"], figures["chat"]
    assert set(tpot) >= {"off", "backup_stream", "compute_stream"}
    assert tpot["off"]["host_blocks"] == 0 and tpot["backup_stream"]["host_blocks"] > 0
    assert all(tpot[k]["itl_ms_p50"] > 0 for k in ("off", "backup_stream", "compute_stream"))
    assert swap["off"]["preemptions"] > 0 and swap["on"]["preemptions"] > 0, "the swap workload must preempt"
    assert swap["off"]["host_hit_tokens"] == 0 and swap["on"]["host_hit_tokens"] > 0
    assert chat["device_only"]["host_hit_tokens"] == 0 and chat["host_tier"]["host_hit_tokens"] > 0
    assert "host KV tier: chat" in run.stdout


def test_backup_granularity_bench_runs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    write_config(model, hidden=64, layers=2, heads=4, kv_heads=2, vocab=300, intermediate=96)
    out = tmp_path / "granularity.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "scripts/bench_backup_granularity.py", "--device", "cpu", "--dtype", "float32",
                          "--model", str(model), "--batch", "4", "--context", "8", "--block-size", "4", "--steps", "8",
                          "--reps", "1", "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    variants = json.loads(out.read_text())["variants"]
    assert variants["none"]["items_per_launch"] == 0
    assert variants["block_burst"]["items_per_launch"] == 4 * 2 * 2  # every request's block, 2 layers x K/V
    assert variants["token"]["items_per_launch"] == 4 * 2 * 2  # every request's row, 2 layers x K/V
    assert variants["block_spread"]["mib_per_step"] == pytest.approx(variants["token"]["mib_per_step"])
