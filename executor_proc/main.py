"""The executor process: owns the device, runs plans in order, streams tokens back.

Main loop (one thread)::

    plan  = receive()            # blocks only when nothing is left to run
    step  = prepare(plan)        # slot-table diffs + device inputs, non-blocking
    tokens = launch(step)        # forward + sample + last-token update, enqueued
    hand_off(step, tokens)       # copy to host on the copy stream; output thread sends

The output thread owns the result socket: it waits for each step's copy event
and sends a StepResult, so the main thread is already enqueuing step N+1 while
step N's tokens travel back.

With tensor parallelism this process is one rank of a group that the scheduler
started together: every rank receives every plan on its own socket and runs it
(the collectives inside the model keep them in step); rank 0 alone reports
(load progress, ExecutorReady, StepResults), any rank reports its own failure.
"""

from __future__ import annotations

import gc
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import msgspec
import zmq

from executor_proc.memory_plan import StartupRefused
from executor_proc.step_profile import StepProfiler, from_env
from ipc.config import ExecutorConfig
from ipc import protocol as p
from ipc.sockets import make_socket

PARENT_POLL_MS = 500
MEMORY_SAMPLE_S = 1.0  # how often a StepResult carries the device memory figures


class GcClock:
    """Seconds the cyclic garbage collector has run in this process (any thread, any generation), from
    ``gc.callbacks``: a collection during a step's host work holds the GIL and delays the step's launch,
    so each StepResult says how much of it fell there (``gc_s``)."""

    def __init__(self):
        self.total_s = 0.0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._started


@dataclass
class LaunchedStep:
    """A step whose work is enqueued; ``tokens`` are valid once ``event`` completes."""

    step_id: int
    tokens: object  # host tensor (pinned on CUDA), or a list
    event: object  # staging.TokenCopy (synchronize, release) on CUDA; None when the tokens are on the host
    t_start: float
    idle_s: float
    gpu_events: Optional[tuple] = None  # (start, end) timing events on the compute stream
    host_s: tuple[float, float] = (0.0, 0.0)  # host seconds of (plan decode + prepare, launch)
    gc_s: float = 0.0  # of which the garbage collector's (GcClock)
    outputs: object = None  # step_outputs.StepOutputs: logprobs, on the host once ``event`` completes


class OutputThread(threading.Thread):
    """Sends each step's tokens once its device->host copy has completed."""

    def __init__(self, sock: zmq.Socket):
        super().__init__(name="forerun-output", daemon=True)
        self.sock = sock
        self.backups_done = lambda step_id: step_id  # the worker's backups_done_through, once built
        self.memory_device = None  # the CUDA device whose memory the results report, once built
        self.grammar = None  # the worker's GrammarSlots (structured outputs), once built
        self._next_memory_sample = 0.0
        self.steps: queue.SimpleQueue = queue.SimpleQueue()
        self._prev_end = None  # the previous step's end event, for the GPU's idle gap

    def _gpu_timing(self, step: LaunchedStep) -> tuple[float, float]:
        """(busy, gap before) in seconds; both events have completed once the copy has."""
        if step.gpu_events is None:
            return 0.0, 0.0
        start, end = step.gpu_events
        end.synchronize()  # a step that samples nothing has no copy event to have waited on
        gap = max(0.0, self._prev_end.elapsed_time(start) / 1e3) if self._prev_end is not None else 0.0
        self._prev_end = end
        return start.elapsed_time(end) / 1e3, gap

    def run(self) -> None:
        """Send results until told to stop; any exception is reported as ExecutorFatal and ends the process."""
        try:
            self._send_results()
        except BaseException as e:
            try:
                self.sock.send(p.encode(p.ExecutorFatal(f"output thread: {type(e).__name__}: {e}\n"
                                                        f"{traceback.format_exc()}")))
                time.sleep(0.2)  # let the message leave before the process ends
            finally:
                os._exit(1)  # the main thread may be blocked on a plan: nothing else would end it

    def _send_results(self) -> None:
        while (step := self.steps.get()) is not None:
            if step.event is not None:
                step.event.synchronize()
            tokens = step.tokens if isinstance(step.tokens, list) else step.tokens.tolist()
            extra = step.outputs.result_fields() if step.outputs is not None else {}
            if getattr(step.outputs, "spec", None) is not None and step.outputs.spec.rows:  # speculative rows' runs
                tokens, spec_fields = step.outputs.spec.split(tokens)
                extra.update(spec_fields)
            if "backups_done_step_id" not in extra:  # polled after the step's copy: never waits
                extra["backups_done_step_id"] = self.backups_done(step.step_id)
            if self.memory_device is not None and time.monotonic() >= self._next_memory_sample:
                import torch

                self._next_memory_sample = time.monotonic() + MEMORY_SAMPLE_S
                extra["device_peak_bytes"] = torch.cuda.max_memory_reserved(self.memory_device)
                extra["device_free_bytes"] = torch.cuda.mem_get_info(self.memory_device)[0]
            release = getattr(step.event, "release", None)  # a pinned ring slot, free again once read
            if release is not None:
                release()
            # A device clock that knows when the step ran (the scripted one) overrides the host's view.
            t_start, t_end, idle_s = getattr(step.event, "timing", None) or (
                step.t_start, time.perf_counter(), step.idle_s)
            busy, gap = self._gpu_timing(step)
            result = p.StepResult(step.step_id, tokens, t_start, t_end, idle_s, busy, gap, *step.host_s,
                                  gc_s=step.gc_s, **extra)
            self.sock.send(p.encode(result))
            grammar = getattr(step.outputs, "grammar", None)
            if grammar is not None:  # after the send: the scheduler need not wait for the next masks
                self.grammar.advance(grammar, tokens)


class ExecutorProcess:
    """The process shell: sockets, the main loop, the output thread; the step work is the worker's."""

    def __init__(self, cfg: ExecutorConfig):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.plans = make_socket(self.ctx, zmq.PULL, cfg.plan_addr, bind=False)
        self.results = make_socket(self.ctx, zmq.PUSH, cfg.result_addr, bind=False)
        self.output = OutputThread(self.results)
        self.tp = None  # the tensor-parallel group, once built
        self.expert_counts = None  # --moe-expert-counts (rank 0): executor_proc.model.expert_counts
        self.last_step_id: Optional[int] = None
        self._stream = None  # the compute stream, for the step timing events
        self._event = None  # torch.cuda.Event
        self.gc_clock = GcClock()
        self.gc_ready = 0.0  # the collector's seconds when the last plan was there to read
        self.profiler = StepProfiler("", [], cfg.tp_rank)  # $FORERUN_TORCH_PROFILE's, once set up

    def send(self, msg) -> None:
        self.results.send(p.encode(msg))

    def setup(self) -> None:
        """Load the model, allocate the KV cache, capture the decode graphs, report capacity."""
        try:
            self.profiler = from_env(self.cfg.tp_rank)  # chosen steps under torch's profiler
        except ValueError as e:
            raise StartupRefused(str(e)) from None
        if self.cfg.load_format == "scripted":
            return self._setup_scripted()
        from executor_proc.build import build_worker

        cfg = self.cfg
        lead = cfg.tp_rank == 0
        report = (lambda stage, done, total: self.send(p.LoadProgress(stage, done, total))) if lead else (
            lambda stage, done, total: None)
        built = build_worker(cfg, report)
        self.worker, mcfg, self.tp = built.worker, built.model_config, built.tp
        self.output.backups_done = self.worker.backups_done_through
        self.output.grammar = self.worker.grammar
        if cfg.moe_expert_counts and lead:  # after the start-up passes: the totals are the served steps' only
            from executor_proc.model.expert_counts import ExpertCounts

            self.expert_counts = ExpertCounts(self.worker.model, built.device, cfg.replica)
        if built.device.type == "cuda":
            import torch

            torch.cuda.reset_peak_memory_stats(built.device)  # the peak the results report is the serving one
            self.output.memory_device = built.device
        if self.tp is not None:
            self.tp.barrier()  # every rank is built and listening for plans before the scheduler sends one
            if not lead:  # rank 0 alone reports
                gc.freeze()
                return
        self.send(p.ExecutorReady(
            num_kv_blocks=built.num_kv_blocks, max_model_len=built.max_model_len, vocab_size=mcfg.vocab_size,
            eos_token_ids=list(mcfg.eos_token_ids), device=str(built.device), dtype=cfg.resolved_dtype(),
            fp8_weights=built.fp8_weights, num_host_blocks=built.num_host_blocks, num_graphs=built.num_graphs,
            graph_capture_s=built.graph_capture_s, graph_memory_bytes=built.graph_memory_bytes,
            memory_plan=built.plan.line() + built.plan_note, memory_plan_bytes=built.plan.as_dict()))
        gc.freeze()  # the hot loop must not pay for scanning start-up objects (see _setup_scripted)

    def _setup_scripted(self) -> None:
        """``--load-format scripted``: the test double of :mod:`executor_proc.testing.scripted` (overlap benchmark)."""
        from executor_proc.testing.scripted import ScriptedRunner, ScriptedWorker

        cfg, script = self.cfg, self.cfg.scripted
        num_blocks = cfg.num_kv_blocks or 4096
        self.worker = ScriptedWorker(ScriptedRunner(
            cfg.num_slots, num_blocks, cfg.block_size, vocab_size=script.vocab_size,
            eos_at=dict(script.eos_at), tokens_at={s: dict(t) for s, t in script.tokens_at.items()},
            num_host_blocks=cfg.num_host_kv_blocks or 0, backup_lag=script.backup_lag_steps,
            num_speculative_tokens=cfg.speculative.num_tokens if cfg.speculative.method else 0),
            step_latency_s=script.step_latency_s)
        self.send(p.ExecutorReady(
            num_kv_blocks=num_blocks, max_model_len=cfg.max_model_len or 4096, vocab_size=script.vocab_size,
            eos_token_ids=[2], device="cpu", dtype="none", num_host_blocks=cfg.num_host_kv_blocks or 0))
        # Start-up objects (torch's ~170k, where it is loaded) make a full GC pass slow; frozen, they are never
        # scanned again.
        gc.freeze()

    def receive(self):
        """The next message; while waiting, exit if the parent (the scheduler) is gone.

        ``t_ready`` is when a message was there to read: the wait before it is idle
        time, reading and decoding it is the step's own work.
        """
        while not self.plans.poll(PARENT_POLL_MS):
            if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
                return p.Shutdown()
        self.t_ready = time.perf_counter()
        self.gc_ready = self.gc_clock.total_s
        return p.executor_input_decoder.decode(self.plans.recv())

    def _record_gpu_event(self):
        """A timing event on the compute stream (CUDA only): where the GPU is in the step stream."""
        if not self.cfg.device.startswith("cuda"):
            return None
        if self._stream is None:  # looked up once, not per step (torch too: the scripted executor never loads it)
            import torch

            self._stream, self._event = torch.cuda.current_stream(), torch.cuda.Event
        event = self._event(enable_timing=True)
        event.record(self._stream)
        return event

    def in_order(self, plan: p.StepPlan) -> None:
        """Fail loudly on a gap in the step ids: a rank that missed a plan would no longer match the others."""
        if self.last_step_id is not None and plan.step_id != self.last_step_id + 1:
            raise RuntimeError(f"plan {plan.step_id} arrived after plan {self.last_step_id}; a plan is missing")
        self.last_step_id = plan.step_id

    def run(self) -> None:
        if self.cfg.tp_rank:
            return self.run_follower()
        self.output.start()
        worker = self.worker
        while True:
            t_wait = time.perf_counter()
            plan = self.receive()
            if isinstance(plan, p.Shutdown):
                break
            self.in_order(plan)
            self.profiler.before(plan.step_id)
            t_start = self.t_ready
            events = self._record_gpu_event()
            step = worker.prepare(plan)
            t_prepared = time.perf_counter()
            tokens = worker.launch(step)
            if events is not None:
                events = (events, self._record_gpu_event())
            host, event = worker.copy_out(tokens, step)
            host_s = (t_prepared - t_start, time.perf_counter() - t_prepared)
            self.output.steps.put(LaunchedStep(plan.step_id, host, event, t_start, t_start - t_wait, events,
                                               host_s, self.gc_clock.total_s - self.gc_ready,
                                               getattr(step, "outputs", None)))
            self.profiler.after(plan.step_id)
        self.output.steps.put(None)
        self.output.join(timeout=5)
        if self.expert_counts is not None:
            print("\n".join(self.expert_counts.report()), file=sys.stderr, flush=True)

    def run_follower(self) -> None:
        """A rank other than 0: run every plan as rank 0 does (its collectives need ours); report nothing."""
        worker = self.worker
        while not isinstance(plan := self.receive(), p.Shutdown):
            self.in_order(plan)
            self.profiler.before(plan.step_id)
            worker.launch(worker.prepare(plan))
            worker.backups_done_through(plan.step_id)  # forgets completed backup events (nobody else polls)
            self.profiler.after(plan.step_id)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m executor_proc.main CONFIG_JSON", file=sys.stderr)
        return 2
    cfg = msgspec.json.decode(argv[0], type=ExecutorConfig)
    if cfg.kernels == "triton" and not cfg.device.startswith("cuda"):
        # Triton runs on a CPU only in its interpreter, which it chooses when a kernel is defined (at import)
        os.environ["TRITON_INTERPRET"] = "1"
    # torch is imported here, not at the top: the scripted test double never needs it (~1.6 s of CPU a start).
    # One core is left to the scheduler and clients: OpenMP matmuls that share a core slow down tenfold.
    # Tensor-parallel ranks on the CPU share the rest.
    real = cfg.load_format != "scripted"
    if real:
        import torch

        torch.set_num_threads(cfg.threads or max(1, ((os.cpu_count() or 2) - 1) // cfg.tensor_parallel_size))
    ex = ExecutorProcess(cfg)
    try:
        ex.setup()
        if real and cfg.threads is None and cfg.device.startswith("cuda"):
            torch.set_num_threads(1)  # loading may use every core; serving on a GPU needs none (see ExecutorConfig)
        ex.run()
        if ex.tp is not None:
            ex.tp.exit_process(0)
    except StartupRefused as e:  # a configuration the executor will not run (it does not fit): one line
        try:
            ex.send(p.ExecutorFatal(str(e), refused=True))
            time.sleep(0.2)  # let the message leave before the context is torn down
        except Exception:
            pass
        return 1
    except BaseException as e:  # report every failure to the scheduler before dying
        rank = f"rank {cfg.tp_rank}: " if cfg.tensor_parallel_size > 1 else ""
        msg = f"{rank}{type(e).__name__}: {e}\n{traceback.format_exc()}"
        if ex.output.is_alive():  # the result socket has one owner at a time
            ex.output.steps.put(None)
            ex.output.join(timeout=2)
        try:
            ex.send(p.ExecutorFatal(msg))
            time.sleep(0.2)  # let the message leave before the context is torn down
        except Exception:
            pass
        print(msg, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # No interpreter teardown: everything was sent (sockets linger 0) and it only adds noise, e.g.
    # nanobind's "leaked instance" lines for Triton objects still alive at exit, hundreds per shutdown.
    os._exit(code)
