"""``FORERUN_TORCH_PROFILE=DIR:FIRST:COUNT[,FIRST:COUNT...]``: torch's profiler over chosen steps of a server.

Every rank profiles the steps with ids FIRST to FIRST + COUNT - 1 (each window) and, once a window's last step
has run, writes per-kernel device times (the kernels inside replayed CUDA graphs included) to
``DIR/pid<pid>-rank<r>-steps<first>-<last>.txt`` and the timeline to ``... .json`` (Chrome's trace format):
where a served step's GPU time goes, rank by rank, under the same plans, batches and graphs as in serving.  A
window is closed by synchronising the device, so the steps around it are not representative; nothing happens
when the variable is unset, and a value that does not parse refuses the start in one line.

    FORERUN_TORCH_PROFILE=/tmp/prof:300:20 forerun serve --model ... --tensor-parallel-size 2
"""

from __future__ import annotations

import os

ENV = "FORERUN_TORCH_PROFILE"


def parse_windows(spec: str) -> tuple[str, list[tuple[int, int]]]:
    """``DIR:FIRST:COUNT[,FIRST:COUNT...]`` -> (DIR, [(first, last), ...]); ValueError naming the variable."""
    folder, _, rest = spec.partition(":")
    try:
        windows = []
        for part in rest.split(","):
            first, count = (int(v) for v in part.split(":"))
            if first < 0 or count < 1:
                raise ValueError
            windows.append((first, first + count - 1))
    except ValueError:
        raise ValueError(f"{ENV}={spec!r}: expected DIR:FIRST:COUNT[,FIRST:COUNT...] with FIRST >= 0, COUNT >= 1")
    if not folder:
        raise ValueError(f"{ENV}={spec!r}: no folder before the first ':'")
    return folder, windows


class StepProfiler:
    """Starts torch's profiler before a window's first step and writes its table after the last."""

    def __init__(self, folder: str, windows: list[tuple[int, int]], rank: int):
        self.folder, self.windows, self.rank = folder, sorted(windows), rank
        self.active = None

    def before(self, step_id: int) -> None:
        if self.windows and self.active is None and step_id >= self.windows[0][0]:
            import torch
            from torch.profiler import ProfilerActivity, profile

            cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self.active = profile(activities=[ProfilerActivity.CPU, *cuda])
            self.active.__enter__()

    def after(self, step_id: int) -> None:
        if self.active is None or step_id < self.windows[0][1]:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof, self.active = self.active, None
        prof.__exit__(None, None, None)
        first, last = self.windows.pop(0)
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"pid{os.getpid()}-rank{self.rank}-steps{first}-{last}")
        with open(path + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
        prof.export_chrome_trace(path + ".json")  # the timeline: chrome://tracing or ui.perfetto.dev


def from_env(rank: int) -> StepProfiler:
    """The profiler ``$FORERUN_TORCH_PROFILE`` asks for (unset: one with no window, whose calls do nothing)."""
    spec = os.environ.get(ENV)
    return StepProfiler(*parse_windows(spec), rank) if spec else StepProfiler("", [], rank)
