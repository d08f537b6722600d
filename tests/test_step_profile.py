"""``FORERUN_TORCH_PROFILE``: the windows it names, its refusals, and the table a window leaves behind."""

from __future__ import annotations

import os

import pytest
import torch

from executor_proc.step_profile import ENV, StepProfiler, from_env, parse_windows


def test_windows_and_refusals():
    assert parse_windows("/tmp/p:300:20") == ("/tmp/p", [(300, 319)])
    assert parse_windows("out:0:1,10:5") == ("out", [(0, 0), (10, 14)])
    for bad in ("/tmp/p", "/tmp/p:3", "/tmp/p:3:0", "/tmp/p:-1:2", ":3:2", "/tmp/p:a:b"):
        with pytest.raises(ValueError, match=ENV):
            parse_windows(bad)


def test_a_window_writes_its_table_and_only_its_steps_are_profiled(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    idle = from_env(0)
    idle.before(0), idle.after(0)
    assert idle.active is None and not idle.windows
    prof = StepProfiler(str(tmp_path), [(2, 3)], rank=1)
    x = torch.randn(64, 64)
    for step in range(6):
        prof.before(step)
        assert (prof.active is not None) == (step in (2, 3))
        x = x @ x.T / 64
        prof.after(step)
    stem = f"pid{os.getpid()}-rank1-steps2-3"
    assert sorted(os.listdir(tmp_path)) == [stem + ".json", stem + ".txt"]
    assert "aten::mm" in (tmp_path / (stem + ".txt")).read_text()
    assert '"aten::mm"' in (tmp_path / (stem + ".json")).read_text()
