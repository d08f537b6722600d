"""On a GPU: a server started at 256 slots serves every step kind at its largest size (scripts/bench_memory.py's
load) and its device memory's peak while serving stays within the plan it printed at start-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server_proc import ROOT, python_path

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_every_step_kind_stays_within_the_plan(tmp_path):
    out = tmp_path / "memory.json"
    path = python_path()
    run = subprocess.run([sys.executable, "scripts/bench_memory.py", "--cells", "llama-3.2-1b:256:8192",
                          "--json", str(out)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=path),
                         capture_output=True, text=True, timeout=600)
    (cell,) = json.loads(out.read_text())["cells"]
    assert run.returncode == 0 and cell["ok"], run.stdout[-3000:] + run.stderr[-3000:]
    assert cell["within_plan"] and cell["peak_gib"] <= cell["planned_gib"] + 0.02
    plan = cell["plan"]
    assert plan["graphs"] > 0 and plan["activations"] > 0 and plan["kv_tokens"] >= 131072
