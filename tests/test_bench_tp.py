"""scripts/bench_tp.py runs on the CPU with tiny settings (a random-weight 2-layer model at 1 and 2 ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def test_both_sizes_run_and_report(tmp_path, tiny_model_dir):
    model = tiny_model_dir
    out = tmp_path / "tp.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "scripts/bench_tp.py", "--device", "cpu", "--model", str(model),
                          "--sizes", "1", "2", "--max-num-seqs", "8", "--input-len", "8", "--decode-tokens", "12",
                          "--idle-batch", "4", "--idle-tokens", "12", "--requests", "8", "--output-len", "8",
                          "--server-flag=--num-kv-blocks=128", "--json", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["tp"] for r in rows] == [1, 2]
    for r in rows:
        assert r["decode_steps"] >= 10 and r["decode_period_us_p50"] > 0
        assert r["idle_steps"] > 0 and r["output_tokens_per_s"] > 0
    assert "decode GPU us" in run.stdout
