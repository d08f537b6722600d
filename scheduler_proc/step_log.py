"""Executor step timings: running totals for the stats, and ``--step-log`` (JSON lines)."""

from __future__ import annotations

import time

import msgspec

from ipc.protocol import StepResult
from scheduler_proc.steps import InflightStep

# Step records kept in memory before they are appended. A flush runs in the serving loop: 512 records are
# about 1 ms of encoding (10,000 with the json module took 90-200 ms: a 200 ms stall of every running request
# at 40 req/s, a TTFT p99 of 100-150 ms).
FLUSH_EVERY = 512
_ENCODER = msgspec.json.Encoder()
# num_rows: requests in the step; num_tokens: tokens sampled; num_prefill: prefill tokens computed; num_backups:
# KV blocks the host tier backs up behind it; gc_s: of the host time, the executor's garbage collector's;
# num_drafts: the drafts its speculative rows verify (0: a step without speculation).
# The scheduler's side, on the same clock (perf_counter is CLOCK_MONOTONIC, one per host): t_sent, when it sent
# the step's plan; plan_s, how long planning and encoding it took; t_recv, when it read the result.
KEYS = ("step_id", "t_start", "t_end", "idle_s", "num_rows", "num_tokens", "num_prefill", "num_backups",
        "gpu_busy_s", "gpu_gap_s", "prepare_s", "launch_s", "gc_s", "t_sent", "plan_s", "t_recv", "num_drafts")


class StepLog:
    def __init__(self, path: str):
        try:  # the file is appended to every FLUSH_EVERY steps: a path it cannot write is refused at start-up
            open(path, "ab").close()
        except OSError as e:
            raise ValueError(f"--step-log {path}: {e.strerror or e}") from None
        self.path = path
        self.records: list[tuple] = []
        self._sent: dict[int, tuple[float, float]] = {}  # step_id -> (t_sent, plan_s)
        self._received: dict[int, float] = {}  # step_id -> t_recv

    def sent(self, step_id: int, t_plan: float) -> None:
        """The step's plan is encoded and leaves now (planning began at ``t_plan``)."""
        now = time.perf_counter()
        self._sent[step_id] = (now, now - t_plan)

    def received(self, step_id: int) -> None:
        self._received[step_id] = time.perf_counter()

    def void(self) -> None:
        """The steps in flight will never be recorded (an executor restart)."""
        self._sent.clear()
        self._received.clear()

    def record(self, result: StepResult, step: InflightStep) -> None:
        t_sent, plan_s = self._sent.pop(result.step_id, (0.0, 0.0))
        self.records.append((result.step_id, result.t_start, result.t_end, result.idle_s, len(step.requests),
                             len(result.token_ids), step.num_prefill, step.num_backups, result.gpu_busy_s,
                             result.gpu_gap_s, result.prepare_s, result.launch_s, result.gc_s, t_sent, plan_s,
                             self._received.pop(result.step_id, 0.0), sum(k for _, k in step.spec)))
        if len(self.records) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Append the buffered records as JSON lines (every FLUSH_EVERY steps and at shutdown)."""
        if not self.records:
            return
        data = _ENCODER.encode_lines([dict(zip(KEYS, r)) for r in self.records])
        with open(self.path, "ab") as f:
            f.write(data)
        self.records.clear()


class StepTotals:
    """Seconds summed over every returned step: the step's work, GPU busy, GPU gap, executor idle; and the
    executor's device memory samples: the peak reserved bytes, the least free bytes (0: none yet)."""

    __slots__ = ("step_s", "gpu_busy_s", "gpu_gap_s", "idle_s", "device_peak_bytes", "device_free_min_bytes",
                 "grammar_steps", "grammar_wait_steps", "grammar_wait_s")

    def __init__(self) -> None:
        self.step_s = self.gpu_busy_s = self.gpu_gap_s = self.idle_s = self.grammar_wait_s = 0.0
        self.device_peak_bytes = self.device_free_min_bytes = self.grammar_steps = self.grammar_wait_steps = 0

    def add(self, result: StepResult) -> None:
        self.step_s += result.t_end - result.t_start
        self.gpu_busy_s += result.gpu_busy_s
        self.gpu_gap_s += result.gpu_gap_s
        self.idle_s += result.idle_s
        if result.grammar_rows:  # structured outputs: steps whose sampling waited for grammar masks
            self.grammar_steps += 1
            self.grammar_wait_steps += result.grammar_wait_s > 0
            self.grammar_wait_s += result.grammar_wait_s
        if result.device_peak_bytes:
            self.device_peak_bytes = max(self.device_peak_bytes, result.device_peak_bytes)
            free = result.device_free_bytes
            self.device_free_min_bytes = min(self.device_free_min_bytes or free, free)
