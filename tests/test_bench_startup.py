"""scripts/bench_startup.py runs on the CPU with a tiny random-weight model (no tuner, no graphs there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def test_cases_report_their_stages(tmp_path, tiny_model_dir):
    model = tiny_model_dir
    out = tmp_path / "startup.json"
    run = subprocess.run([sys.executable, "scripts/bench_startup.py", "--device", "cpu", "--model", str(model),
                          "--num-slots", "4", "--cases", "off=0", "--warm", "--json", str(out)],
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    cases = json.loads(out.read_text())["cases"]
    assert [c["case"] for c in cases] == ["off", "off warm"]
    for c in cases:
        stages = [stage for stage, _ in c["stages"]]
        assert stages[:2] == ["importing", "building"] and "initialising weights" in stages, stages
        assert all(s >= 0 for _, s in c["stages"]) and c["total_s"] >= sum(s for _, s in c["stages"]) - 1e-6
        assert c["calls"]["load_model"] > 0 and c["num_kv_blocks"] > 0 and c["num_graphs"] == 0
    assert "built after" in run.stdout and "tuner picks, off warm vs off: 0 of 0 differ" in run.stdout
