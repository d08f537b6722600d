"""The scheduler process: clients in, plans out, results back, tokens out.

Main loop (asyncio + uvloop)::

    while serving:
        await wake                  # a client message, a step result, or the supervisor's tick
        read_clients()              # at most 64 client frames: validate, admit, abort
        reconcile()                 # apply returned steps, stream tokens, finish requests
        plan_ahead()                # keep pipeline_depth + 1 steps in flight

A reader task queues step results; a supervisor task (every 50 ms) replaces a
dead or hung executor (running requests are recomputed), expires silent clients
and ends a graceful shutdown.  At depth 1 the plan for step N+1 leaves before
step N's tokens are back.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import sys
import time
import uuid
from collections import deque
from typing import Optional

import msgspec
import zmq
import zmq.asyncio

from ipc import protocol as p
from ipc.models import ModelSource, read_tokenizer_files
from ipc.sockets import MAX_CLIENT_MESSAGE_BYTES, ipc_address, new_run_dir
from scheduler_proc.client_messages import ClientMessages
from scheduler_proc.config import ServerConfig
from scheduler_proc.frontend import Frontend, bind_frontend
from scheduler_proc.limits import Limits
from scheduler_proc.grammar import GrammarCompiler
from scheduler_proc.outputs import load_detokenizer
from scheduler_proc.planner import Planner
from scheduler_proc.request import Request, Status
from scheduler_proc.step_log import StepLog, StepTotals
from scheduler_proc.streaming import OutputStream
from scheduler_proc.supervisor import Supervisor

# The transport drops (and disconnects) frames above this; frames between the
# application limit and this one get a clear error instead.
TRANSPORT_MAX_MESSAGE_BYTES = 4 * MAX_CLIENT_MESSAGE_BYTES
TICK_S = 0.05  # the supervisor's period while requests run: executor death and hang checks
CLIENT_CHECK_S = 0.25  # heartbeat expiry and owed-error retries; the supervisor's period while idle


class Server(ClientMessages, OutputStream):
    def __init__(self, cfg: ServerConfig, model: ModelSource):
        self.cfg = cfg
        self.model = model
        self.server_id = uuid.uuid4().hex
        self.owns_run_dir = cfg.run_dir is None
        self.run_dir = cfg.run_dir or new_run_dir()
        self.client_address = cfg.client_address or ipc_address(self.run_dir, "client")
        self.ctx = zmq.asyncio.Context()
        self.frontend: Optional[Frontend] = None
        self.executor = Supervisor(cfg, model.path, self.ctx, self.run_dir)
        self.executor.base = msgspec.structs.replace(self.executor.base, tokenizer=model.tokenizer_path or "")
        self.requests: dict[tuple[bytes, str, int], Request] = {}  # (client, request_id, completion index)
        # Constrained requests whose grammar compiles (scheduler_proc/grammar.py): (client, id) -> aborted.
        self.compiling: dict[tuple[bytes, str], bool] = {}
        self.compile_tasks: set[asyncio.Task] = set()
        self.returned: deque = deque()
        self.wake = asyncio.Event()
        self.failure: Optional[str] = None
        self.shutdown_at: Optional[float] = None  # graceful shutdown: when running requests get an error
        self.suspects: set[int] = set()  # rids in flight at the last executor failure, no step back since
        self._rids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self.stats = {"steps": 0, "requests": 0, "restarts": 0}
        self.api_worker_restarts = 0  # gateway workers restarted (scheduler_proc/launch.py counts them)
        self.step_totals = StepTotals()
        self.step_log = StepLog(cfg.step_log) if cfg.step_log else None

    # ------------------------------------------------------------- start-up

    def bind(self) -> None:
        """Listen for clients (before the model loads: address errors show at once); raises StartupError."""
        self.frontend = bind_frontend(self.ctx, self.client_address, self.cfg, TRANSPORT_MAX_MESSAGE_BYTES)

    def start_executor(self, on_progress=lambda m: None) -> p.ExecutorReady:
        """Spawn the executor and block until it has loaded the model."""
        if self.frontend is None:
            self.bind()
        self.ready = self.executor.start(on_progress)
        self.limits = Limits.of(self.cfg.executor, self.ready)
        self.planner = Planner(self.limits, prefix_cache_id=self._prefix_cache_id() if self.cfg.enable_prefix_caching else None,
                               detokenize=load_detokenizer(self.model.tokenizer_path))
        self.tokenizer_files = read_tokenizer_files(self.model.tokenizer_path)
        self.grammars = GrammarCompiler(
            self.model.tokenizer_path, self.ready.vocab_size, self.ready.eos_token_ids,
            self.cfg.grammar_compile_timeout_s,
            unavailable="structured outputs are not supported with tensor parallelism"
            if self.cfg.executor.tensor_parallel_size > 1 else "")
        return self.ready

    def _prefix_cache_id(self) -> str:
        """What cached KV depends on besides the tokens: model, weights, dtype, block size (in every key)."""
        e = self.cfg.executor
        return f"{self.model.name}|{self.model.path}|{e.load_format}|{self.ready.dtype}|{e.block_size}"

    # ------------------------------------------------------------ main loop

    async def serve(self) -> int:
        """Serve until a shutdown ends or the executor fails for good; returns the process exit status."""
        self.stopping = False
        self._tasks = [asyncio.create_task(t) for t in (self._watch_clients(), self._supervise())]
        self._start_result_reader()
        try:
            while not self.stopping:
                await self._next_wake()
                self.read_clients()
                self.reconcile()
                self.plan_ahead()
        finally:
            for t in self._tasks:
                t.cancel()
            self.executor.shutdown()
            if self.step_log is not None:
                self.step_log.flush()
        return 1 if self.failure else 0

    async def _next_wake(self) -> None:
        # Event.wait() on a set event would not yield: sleep(0) lets sockets and tasks run.
        await (asyncio.sleep(0) if self.wake.is_set() else self.wake.wait())
        self.wake.clear()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    def begin_shutdown(self) -> None:
        """SIGTERM / Ctrl-C: no new requests; running ones get --shutdown-timeout seconds (a second signal: none)."""
        again = self.shutdown_at is not None
        self.shutdown_at = 0.0 if again else time.monotonic() + self.cfg.shutdown_timeout_s
        self.wake.set()
        if not again:
            say(f"shutting down: {len(self.requests)} requests get up to {self.cfg.shutdown_timeout_s:g} s to finish")

    def read_clients(self) -> None:
        """Handle at most a batch of client messages, so that a flood never starves the steps."""
        frames = self.frontend.recv_batch()
        for msg in frames:
            try:
                self._on_client_frames(msg)
            except Exception as e:  # a bug on one request must not stop the server
                self.frontend.send(msg[0], p.Error(code="internal", message=f"{type(e).__name__}: {e}"))
        self._drop_unreachable_clients()
        if frames or self.frontend.has_input():
            self.wake.set()

    def reconcile(self) -> None:
        """Apply every returned step in order and stream its tokens: one message per client batch."""
        planner = self.planner
        while self.returned:
            result = self.returned.popleft()
            if self.step_log is not None:
                self.step_log.record(result, planner.inflight[0])
            if self.suspects:  # a step came back: its requests did not kill the executor
                self.suspects.difference_update(r.rid for r in planner.inflight[0].requests)
            outputs = planner.reconcile(result)
            self.stats["steps"] += 1
            self.step_totals.add(result)
            self._emit_step(outputs)
            if self.cfg.debug_checks:
                planner.check_integrity()
            if self.frontend.has_input():  # plain sends may have taken the edge the client watcher waits on
                self.wake.set()
        self._drop_unreachable_clients()

    def plan_ahead(self) -> None:
        """Plan and send until pipeline_depth + 1 steps are in flight, or pipeline_depth + 2 when the next
        plan carries a prefill chunk (``prefill_ahead``: the executor's host work for a mixed step, ~1-1.4 ms
        on a 1B model, then runs beside two steps on the GPU rather than one; the first token comes sooner)."""
        planner = self.planner
        if not self.executor.running:
            return  # a new executor is loading: requests wait
        depth, ahead, log = self.cfg.pipeline_depth, self.cfg.prefill_ahead, self.step_log
        while planner.room_ahead(depth, ahead):
            t_plan = time.perf_counter() if log is not None else 0.0
            plan = planner.plan()
            if plan is None:
                break
            data = p.encode(plan)
            if log is not None:
                log.sent(plan.step_id, t_plan)
            self.executor.send_plan(data, was_idle=planner.num_inflight == 1)
            if self.cfg.debug_checks:
                planner.check_integrity()

    # -------------------------------------------------------------- clients

    async def _watch_clients(self) -> None:
        """Wake the loop when a client message arrives (the loop itself reads them, in batches)."""
        while True:
            await self.frontend.sock.poll(flags=zmq.POLLIN)
            self.wake.set()
            await asyncio.sleep(0)

    # ---------------------------------------------------------- supervision

    def _start_result_reader(self) -> None:
        self._tasks.append(asyncio.create_task(self._read_results(self.executor.generation, self.executor.results)))

    async def _read_results(self, generation: int, results: zmq.asyncio.Socket) -> None:
        while generation == self.executor.generation:
            try:
                msg = p.executor_output_decoder.decode(await results.recv())
            except zmq.ZMQError:
                return  # the socket of a replaced executor was closed
            if generation != self.executor.generation:
                return  # a late message from a replaced executor
            if isinstance(msg, p.StepResult):
                if self.step_log is not None:
                    self.step_log.received(msg.step_id)
                self.returned.append(msg)
                self.executor.on_result(msg)
            elif isinstance(msg, p.ExecutorFatal):
                first = msg.message.splitlines()[0] if msg.message else ""
                dead = self.executor.dead_ranks()  # the rank that died, before the survivor that told
                self.on_executor_failure(f"the executor {dead}; {first}" if dead else f"the executor failed: {first}")
            self.wake.set()

    async def _supervise(self) -> None:
        """Every TICK_S: the executor's health; every CLIENT_CHECK_S: clients and shutdown.  While nothing runs
        (no request, nothing in flight, the executor up), every CLIENT_CHECK_S only: each tick also wakes the main
        loop, and an idle server ticking 20 times a second spends ~0.6% of a core on it.  An executor that dies
        while idle is found within a quarter second (a request that arrives meanwhile waits that long, once)."""
        last_client_check = 0.0
        while True:
            idle = not (self.requests or self.planner.num_inflight) and self.executor.running
            await asyncio.sleep(CLIENT_CHECK_S if idle else TICK_S)
            now = time.monotonic()
            cause = self.executor.failure(now, self.planner.num_inflight)
            if cause:
                self.on_executor_failure(cause)
            if now - last_client_check >= CLIENT_CHECK_S:
                last_client_check = now
                for client in self.frontend.expired(now):
                    self.drop_client(client)
                self.frontend.flush_owed()
            if self.shutdown_at is not None:
                self._check_shutdown(now)
            self.wake.set()  # also a safety net for an edge-triggered wake-up lost by a plain send

    def _check_shutdown(self, now: float) -> None:
        if self.requests and now >= self.shutdown_at:
            message = f"the server shut down before the request finished (--shutdown-timeout {self.cfg.shutdown_timeout_s:g} s)"
            for req in list(self.requests.values()):
                self.fail_request(req, "shutting_down", message)
        if not self.requests:
            self.stop()

    def on_executor_failure(self, cause: str) -> None:
        """Kill the executor, re-queue every running request for recompute, start a new one."""
        if not self.executor.running or self.failure:
            return
        self.executor.kill()
        if not self.executor.allow_restart(time.monotonic()):  # every live request is told this, none the below
            self._restart_limit(cause)
            return
        planner = self.planner
        inflight = {r.rid: r for step in planner.inflight for r in step.requests if r.status is not Status.FINISHED}
        poison = [r for rid, r in inflight.items() if rid in self.suspects]
        self.suspects = set(inflight) - {r.rid for r in poison}
        self.returned.clear()  # in-flight and unreconciled steps are void: their tokens are recomputed
        if self.step_log is not None:
            self.step_log.void()
        num_requeued = len(planner.running) + len(planner.draining)
        planner.restart()
        for req in poison:
            self.fail_request(req, "executor_failed", f"{cause}; this request was in flight at two executor "
                                                      "failures in a row and is not retried")
        say(f"{cause}; restarting it, {num_requeued} requests will be recomputed")
        self._tasks.append(asyncio.create_task(self._restart()))

    def _begin_restart(self, cause: str) -> None:
        if not self.executor.allow_restart(time.monotonic()):
            self._restart_limit(cause)
            return
        self._tasks.append(asyncio.create_task(self._restart()))

    def _restart_limit(self, cause: str) -> None:
        self.fail_stop(f"{cause}; more than {self.cfg.max_restarts} executor restarts within "
                       f"{self.cfg.restart_window_s:g} s")

    async def _restart(self) -> None:
        t0 = time.monotonic()
        try:
            await self.executor.restart()
        except RuntimeError as e:
            say(str(e))
            self._begin_restart(str(e))
            return
        self.stats["restarts"] += 1
        self._start_result_reader()
        say(f"executor restarted in {time.monotonic() - t0:.2f} s")
        self.wake.set()

    def fail_stop(self, cause: str) -> None:
        """Continuing is unsafe: every live request gets an error naming the cause, then the server exits."""
        if self.failure:
            return
        stops = "the server is shutting down" if self.cfg.replica is None else f"replica {self.cfg.replica} stops"
        self.failure = f"{cause}; {stops}"
        say(self.failure)
        if self.cfg.replica is None:  # a replica's router re-sends its requests to another replica instead
            for req in list(self.requests.values()):
                self.fail_request(req, "executor_failed", self.failure)
        self.stop()

    def close(self) -> None:
        """Stop the executor, close every socket, remove the socket files and the run directory."""
        self.executor.close()
        if self.frontend is not None:
            self.frontend.close()
        self.ctx.term()
        if self.owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)


SPEAKER = "forerun"  # who says it: a data-parallel replica names itself (scheduler_proc/replica.py)


def say(message: str) -> None:
    """One line on stderr for the operator.  A closed or broken stderr (the launching shell or supervisor
    is gone) never stops the server: the line is dropped."""
    try:
        print(f"{SPEAKER}: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # BrokenPipeError, EIO; ValueError: the stream was closed
        pass
