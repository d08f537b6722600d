"""Helpers shared by the benchmark scripts: percentiles, summaries, tables, JSON, a server process.

Scripts import it as a sibling module (``from _bench_util import ...``): Python puts the
script's own folder first on ``sys.path``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Iterable, Optional, Sequence

DEFAULT_PERCENTILES = (50, 90, 99)

CHAT_PROMPTS = [
    "Explain how a hash table works, with an example in Python.",
    "Write a short poem about the sea at night.",
    "What are the main causes of the French Revolution?",
    "Give me three ideas for a weekend trip near the mountains.",
    "Summarize the plot of Romeo and Juliet in a paragraph.",
    "How do vaccines train the immune system?",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "What is the difference between TCP and UDP?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a ten-year-old.",
    "List five tips for writing clear technical documentation.",
    "Why is the sky blue?",
    "Describe the water cycle step by step.",
    "Write a function that checks whether a string is a palindrome.",
    "What should I consider when adopting a dog?",
    "Compare electric cars and petrol cars in a short table.",
]


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100) with linear interpolation, as numpy's default; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
              scale: float = 1.0) -> dict[str, Optional[float]]:
    """Mean and percentiles of ``values`` times ``scale`` (e.g. 1000 for seconds -> ms)."""
    scaled = [v * scale for v in values]
    summary: dict[str, Optional[float]] = {"mean": sum(scaled) / len(scaled) if scaled else None}
    for q in percentiles:
        summary[f"p{q:g}"] = percentile(scaled, q)
    return summary


def fmt(value: Optional[float], digits: int = 2) -> str:
    """A number for a table cell; "-" for a missing one."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_table(rows: Sequence[tuple[str, Any]], title: Optional[str] = None) -> str:
    """Two aligned columns (label, value) with an optional centred title."""
    cells = [(label, value if isinstance(value, str) else fmt(value)) for label, value in rows]
    left = max((len(label) for label, _ in cells), default=0)
    right = max((len(value) for _, value in cells), default=0)
    width = max(left + right + 2, len(title) + 4 if title else 0)
    lines = []
    if title:
        lines += [f" {title} ".center(width, "="), ""]
    lines += [f"{label:<{width - right}}{value:>{right}}" for label, value in cells]
    lines.append("=" * width)
    return "\n".join(lines)


def latency_rows(name: str, summary: dict[str, Optional[float]], unit: str = "ms") -> list[tuple[str, Any]]:
    """Table rows for one summarize() result: "Mean TTFT (ms)", "P50 TTFT (ms)", ..."""
    return [(f"{key.capitalize() if key == 'mean' else key.upper()} {name} ({unit})", value)
            for key, value in summary.items()]


def shapes_of(name: str) -> dict[str, tuple[int, int]]:
    """The decode-time linears of ``scripts/configs/<name>`` as ``{weight: (N, K)}``."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", name, "config.json")) as f:
        c = json.load(f)
    h, heads, kvh = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = c.get("head_dim") or h // heads
    return {"qkv": ((heads + 2 * kvh) * d, h), "o": (h, heads * d), "gate_up": (2 * c["intermediate_size"], h),
            "down": (h, c["intermediate_size"]), "lm_head": (c["vocab_size"], h)}


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write benchmark figures as indented JSON, creating the folder if needed."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")


def ipc_address(folder: str) -> str:
    """A fresh ``ipc://`` address in ``folder`` (keep it short: ipc paths are limited to 107 bytes)."""
    return f"ipc://{folder}/c-{uuid.uuid4().hex[:8]}.sock"


def start_server(address: str, *flags: str, run_dir: Optional[str] = None, echo: bool = True,
                 timeout: Optional[float] = None) -> subprocess.Popen:
    """``forerun serve --address ADDRESS --quiet FLAGS``, returned once it prints that it is ready.

    The server's output after that stays unread in ``proc.stdout`` for the caller.  ``timeout``:
    seconds to wait for the "ready at" line before the server is killed (None: no limit).
    """
    cmd = [sys.executable, "-m", "scheduler_proc.launch", "serve", "--address", address, "--quiet", *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"FORERUN_RUN_DIR": run_dir} if run_dir else {}))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    watchdog = None if timeout is None else threading.Timer(timeout, proc.kill)
    if watchdog is not None:
        watchdog.start()
    log = []
    try:
        for line in iter(proc.stdout.readline, ""):
            log.append(line)
            if echo:
                print("  server:", line.rstrip(), flush=True)
            if "ready at" in line:
                return proc
    finally:
        if watchdog is not None:
            watchdog.cancel()
    proc.wait()
    if deadline is not None and time.monotonic() >= deadline:
        raise TimeoutError(f"server not ready within {timeout} s:\n" + "".join(log))
    raise RuntimeError("server exited during start-up:\n" + "".join(log))


def executor_pid(server: subprocess.Popen) -> int:
    """The pid of the server's executor process (its only child)."""
    out = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
    return int(out[0])


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server and wait for it (SIGKILL after 30 s)."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
