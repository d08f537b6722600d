"""scripts/bench_memory.py: --help, and one cell on the CPU with a tiny random-weight model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.server_proc import ROOT, python_path


def test_help():
    run = subprocess.run([sys.executable, "scripts/bench_memory.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and "--max-num-batched-tokens" in run.stdout and "--json" in run.stdout


def test_one_cpu_cell_starts_prints_its_plan_and_serves(tmp_path, tiny_model_dir):
    out = tmp_path / "memory.json"
    run = subprocess.run([sys.executable, "scripts/bench_memory.py", "--device", "cpu", "--cells",
                          f"{tiny_model_dir}:4:64", "--output-len", "4", "--json", str(out)],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=python_path()), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell["ok"] and cell["started"] and not cell["errors"], cell
    assert "host memory is not planned" in cell["plan_line"] and cell["plan"]["kv_tokens"] > 0
    assert cell["requests"] == 4 + 2 * 1 + 4 + 4 + 1 + 1  # decode, prefill, prompt logprobs, two drains, host, last
    assert "memory plan vs serving" in run.stdout
