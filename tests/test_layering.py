"""The scheduler and the executor are peers over a shared floor (ipc/): neither imports the other."""

from __future__ import annotations

import subprocess
import sys

from tests.server_proc import ROOT


def _modules_after_import(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_scheduler_side_loads_no_torch_and_no_executor():
    mods = _modules_after_import(
        "import scheduler_proc.launch, scheduler_proc.server, scheduler_proc.planner, scheduler_proc.validate")
    assert "torch" not in mods
    assert not any(m == "executor_proc" or m.startswith("executor_proc.") for m in mods)


def test_executor_side_imports_no_scheduler():
    mods = _modules_after_import("import executor_proc.main, executor_proc.build")
    assert not any(m == "scheduler_proc" or m.startswith("scheduler_proc.") for m in mods)


def test_executor_product_path_imports_no_test_doubles():
    """The process shell and the build reach executor_proc.testing only lazily (--load-format scripted),
    and no kernel module applies the Triton-interpreter patch on import."""
    mods = _modules_after_import(
        "import executor_proc.main, executor_proc.build, executor_proc.backends.triton_backend")
    assert not any(m.startswith("executor_proc.testing") for m in mods)
    assert "kernels.interpreter_patch" not in mods
