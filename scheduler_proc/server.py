"""The scheduler process: clients in, plans out, results back, tokens out.

Main loop (asyncio + uvloop)::

    while serving:
        await wake                  # a client message, a step result, or a death
        reconcile()                 # apply returned steps, stream tokens, finish requests
        plan_ahead()                # keep pipeline_depth + 1 steps in flight

Client messages are handled as they arrive (validate, admit, abort) by a reader
task; step results are queued by another.  The planner never waits for the
executor: at depth 1 the plan for step N+1 leaves before step N's tokens are
back.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import subprocess
import sys
from collections import deque
from typing import Optional

import msgspec
import zmq
import zmq.asyncio

from ipc import protocol as p
from ipc.models import ModelSource
from ipc.sockets import MAX_CLIENT_MESSAGE_BYTES, ipc_address, make_socket, new_run_dir
from scheduler_proc.config import ServerConfig
from scheduler_proc.executor_process import describe_exit, spawn_executor, wait_ready
from scheduler_proc.limits import Limits
from scheduler_proc.planner import Output, Planner
from scheduler_proc.request import Request
from scheduler_proc.validate import InvalidRequest, decode_client_frame, validate_generate

# The transport drops (and disconnects) frames above this; frames between the
# application limit and this one get a clear error instead.
TRANSPORT_MAX_MESSAGE_BYTES = 4 * MAX_CLIENT_MESSAGE_BYTES
WATCHDOG_INTERVAL_S = 0.05
STEP_LOG_FLUSH = 10_000  # step records kept in memory before they are appended to --step-log


class Server:
    def __init__(self, cfg: ServerConfig, model: ModelSource):
        self.cfg = cfg
        self.model = model
        self.run_dir = cfg.run_dir or new_run_dir()
        self.client_address = cfg.client_address or ipc_address(self.run_dir, "client")
        self.ctx = zmq.asyncio.Context()
        self.requests: dict[tuple[bytes, str], Request] = {}
        self.returned: deque = deque()
        self.wake = asyncio.Event()
        self.failure: Optional[str] = None
        self._rids = itertools.count()
        self.proc: Optional[subprocess.Popen] = None
        self.stats = {"steps": 0, "requests": 0}
        self.batch_clients: set[bytes] = set()  # clients that read TokenDeltas
        self.step_records: Optional[list[tuple]] = [] if cfg.step_log else None

    # ------------------------------------------------------------- start-up

    def start_executor(self, on_progress=lambda m: None) -> p.ExecutorReady:
        """Spawn the executor and block until it has loaded the model."""
        cfg = self.cfg
        plan_addr = ipc_address(self.run_dir, "plans")
        result_addr = ipc_address(self.run_dir, "results")
        self.plans = make_socket(self.ctx, zmq.PUSH, plan_addr, bind=True)
        self.results = make_socket(self.ctx, zmq.PULL, result_addr, bind=True)
        ecfg = msgspec.structs.replace(cfg.executor, model=self.model.path, plan_addr=plan_addr,
                                       result_addr=result_addr, parent_pid=os.getpid())
        self.proc = spawn_executor(ecfg)
        sync_results = zmq.Socket.shadow(self.results.underlying)
        self.ready = wait_ready(self.proc, sync_results, cfg.executor_start_timeout_s, on_progress)
        self.limits = Limits.of(ecfg, self.ready)
        self.planner = Planner(self.limits)
        self.frontend = make_socket(self.ctx, zmq.ROUTER, self.client_address, bind=True,
                                    max_msg_bytes=TRANSPORT_MAX_MESSAGE_BYTES, hwm=0)  # a ROUTER drops at its HWM: never
        # Plain (non-asyncio) views for the per-step sends: an asyncio send costs several
        # times more (a Future and Flag-enum arithmetic per message).
        self._plans_now = zmq.Socket.shadow(self.plans.underlying)
        self._frontend_now = zmq.Socket.shadow(self.frontend.underlying)
        return self.ready

    # ------------------------------------------------------------ main loop

    async def serve(self) -> int:
        """Serve until the executor dies or ``stop()``; returns the process exit status."""
        self.stopping = False
        tasks = [asyncio.create_task(t) for t in (self._read_clients(), self._read_results(), self._watchdog())]
        try:
            while not self.stopping:
                await self.wake.wait()
                self.wake.clear()
                self.reconcile()
                self.plan_ahead()
            if self.failure:
                await asyncio.sleep(0.3)  # let the error replies leave before sockets close
        finally:
            for t in tasks:
                t.cancel()
            self._shutdown_executor()
            self._flush_step_log()
        return 1 if self.failure else 0

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    def reconcile(self) -> None:
        """Apply every returned step in order and stream its tokens: one message per client batch."""
        planner = self.planner
        while self.returned:
            result = self.returned.popleft()
            if self.step_records is not None:
                self._record_step(result)
            outputs = planner.reconcile(result)
            self.stats["steps"] += 1
            self._emit_step(outputs)
            if self.cfg.debug_checks:
                planner.check_integrity()

    def plan_ahead(self) -> None:
        """Plan and send until pipeline_depth + 1 steps are in flight."""
        planner = self.planner
        while planner.num_inflight <= self.cfg.pipeline_depth:
            plan = planner.plan()
            if plan is None:
                break
            data = p.encode(plan)
            try:
                self._plans_now.send(data, zmq.NOBLOCK)
            except zmq.Again:  # the executor's queue is full (it never is at depth <= 2): wait asynchronously
                self.plans.send(data)
            if self.cfg.debug_checks:
                planner.check_integrity()

    # -------------------------------------------------------------- clients

    async def _read_clients(self) -> None:
        while True:
            frames = await self.frontend.recv_multipart(copy=True)
            try:
                self._on_client_frames(frames)
            except Exception as e:  # a bug on one request must not stop the server
                self._send(frames[0], p.Error(code="internal", message=f"{type(e).__name__}: {e}"))
            self.wake.set()

    def _on_client_frames(self, frames: list[bytes]) -> None:
        client = frames[0]
        if len(frames) != 2:
            self._send(client, p.Error(code="bad_frame", message=f"expected 1 frame per message, got {len(frames) - 1}"))
            return
        data = frames[1]
        if len(data) > MAX_CLIENT_MESSAGE_BYTES:
            self._send(client, p.Error(
                code="bad_frame", message=f"message of {len(data)} bytes exceeds the limit of {MAX_CLIENT_MESSAGE_BYTES} bytes"))
            return
        msg = decode_client_frame(data)
        if isinstance(msg, p.Error):
            self._send(client, msg)
        elif isinstance(msg, p.Hello):
            self._on_hello(client, msg)
        elif isinstance(msg, p.Generate):
            self._on_generate(client, msg)
        elif isinstance(msg, p.Abort):
            self._on_abort(client, msg)
        elif isinstance(msg, p.GetStats):
            self._send(client, self.server_stats())

    def server_stats(self) -> p.ServerStats:
        pl = self.planner
        return p.ServerStats(
            num_kv_blocks=pl.limits.num_kv_blocks, num_free_kv_blocks=pl.blocks.num_free,
            num_slots=pl.limits.num_slots, num_free_slots=pl.slots.num_free, num_running=len(pl.running),
            num_waiting=len(pl.waiting), num_draining=len(pl.draining), num_inflight_steps=pl.num_inflight,
            steps=self.stats["steps"], requests=self.stats["requests"], preemptions=pl.num_preemptions)

    def _on_hello(self, client: bytes, msg: p.Hello) -> None:
        if msg.protocol_version != p.PROTOCOL_VERSION:
            self._send(client, p.Error(
                code="protocol", field="protocol_version",
                message=f"client speaks protocol {msg.protocol_version}, server speaks {p.PROTOCOL_VERSION}"))
            return
        r = self.ready
        if msg.batch_deltas:
            self.batch_clients.add(client)
        else:
            self.batch_clients.discard(client)
        self._send(client, p.ServerInfo(
            protocol_version=p.PROTOCOL_VERSION, model_name=self.model.name, max_model_len=r.max_model_len,
            vocab_size=r.vocab_size, tokenizer_path=self.model.tokenizer_path, eos_token_ids=r.eos_token_ids,
            device=r.device, dtype=r.dtype, pipeline_depth=self.cfg.pipeline_depth, batch_deltas=msg.batch_deltas))

    def _on_generate(self, client: bytes, msg: p.Generate) -> None:
        if self.failure:
            self._send(client, p.Error(code="executor_failed", message=self.failure, request_id=msg.request_id))
            return
        try:
            validate_generate(msg, self.limits)
        except InvalidRequest as e:
            self._send(client, p.Error(code="invalid_request", message=e.message, request_id=msg.request_id, field=e.field))
            return
        key = (client, msg.request_id)
        if key in self.requests:
            self._send(client, p.Error(code="duplicate_id", field="request_id", request_id=msg.request_id,
                                       message=f"request_id {msg.request_id!r} is already in use by this client"))
            return
        s = msg.sampling
        req = Request(
            rid=next(self._rids), client=client, request_id=msg.request_id, prompt=msg.prompt_token_ids,
            sampling=s, seed=s.seed if s.seed is not None else random.getrandbits(63),
            max_tokens=s.max_tokens, stop_ids=frozenset(s.stop_token_ids),
        )
        self.requests[key] = req
        self.stats["requests"] += 1
        self.planner.add(req)

    def _on_abort(self, client: bytes, msg: p.Abort) -> None:
        req = self.requests.get((client, msg.request_id))
        if req is None:
            return  # already finished: aborting is idempotent
        out = self.planner.abort(req)
        if out:
            self._emit(out)

    def _emit_step(self, outputs: list[Output]) -> None:
        """Stream a step's outputs: one TokenDeltas per client that reads them, else a TokenDelta per request.

        Finishes go through ``_emit``.  Deltas go out on the plain socket; the
        last message of the step goes through the asyncio socket, whose send
        re-checks for incoming client frames (ZeroMQ's FD is edge-triggered, and
        a plain send may consume the edge the client reader is waiting on).
        """
        batch_clients = self.batch_clients
        batches: dict[bytes, tuple[list[str], list[list[int]]]] = {}
        messages: list[tuple[bytes, bytes]] = []  # (client, encoded message)
        encode = p.encode
        for out in outputs:
            req = out.request
            if out.finish_reason is not None:
                self._emit(out)
                continue
            req.num_sent = len(req.output)
            if req.client in batch_clients:
                batch = batches.get(req.client)
                if batch is None:
                    batch = batches[req.client] = ([], [])
                batch[0].append(req.request_id)
                batch[1].append(out.new_tokens)
            else:
                messages.append((req.client, encode(p.TokenDelta(req.request_id, out.new_tokens))))
        for client, (request_ids, token_ids) in batches.items():
            messages.append((client, encode(p.TokenDeltas(request_ids, token_ids))))
        if messages:
            send, more = self._frontend_now.send, zmq.SNDMORE
            for client, data in messages[:-1]:
                send(client, more)  # two plain sends: half the cost of one send_multipart
                send(data)
            self.frontend.send_multipart(messages[-1])

    def _emit(self, out: Output) -> None:
        req = out.request
        if out.finish_reason is None:
            self._send(req.client, p.TokenDelta(req.request_id, out.new_tokens))
            req.num_sent = len(req.output)
            return
        self.requests.pop((req.client, req.request_id), None)
        self._send(req.client, p.Finished(
            request_id=req.request_id, reason=out.finish_reason, prompt_tokens=len(req.prompt),
            completion_tokens=len(req.output), token_ids=req.output[req.num_sent:]))
        req.num_sent = len(req.output)

    def _send(self, client: bytes, msg) -> None:
        self.frontend.send_multipart([client, p.encode(msg)])

    # ------------------------------------------------------------- step log

    def _record_step(self, result: p.StepResult) -> None:
        rows = len(self.planner.inflight[0].requests)
        self.step_records.append(
            (result.step_id, result.t_start, result.t_end, result.idle_s, rows, len(result.token_ids),
             result.gpu_busy_s, result.gpu_gap_s))
        if len(self.step_records) >= STEP_LOG_FLUSH:
            self._flush_step_log()

    def _flush_step_log(self) -> None:
        """Append the buffered step records to --step-log as JSON lines (rarely: off the hot path)."""
        if not self.step_records:
            return
        keys = ("step_id", "t_start", "t_end", "idle_s", "num_rows", "num_tokens", "gpu_busy_s", "gpu_gap_s")
        with open(self.cfg.step_log, "a") as f:
            f.writelines(json.dumps(dict(zip(keys, r))) + "\n" for r in self.step_records)
        self.step_records.clear()

    # ------------------------------------------------------------- executor

    async def _read_results(self) -> None:
        while True:
            msg = p.executor_output_decoder.decode(await self.results.recv())
            if isinstance(msg, p.StepResult):
                self.returned.append(msg)
            elif isinstance(msg, p.ExecutorFatal):
                self._fail(f"the executor failed: {msg.message.splitlines()[0] if msg.message else ''}")
            self.wake.set()

    async def _watchdog(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        self._fail(f"the executor process {describe_exit(self.proc.returncode)}")

    def _fail(self, cause: str) -> None:
        """The executor is gone: every live request gets an error naming the cause, then we exit."""
        if self.failure:
            return
        self.failure = f"{cause}; the server is shutting down"
        print(f"forerun: {self.failure}", file=sys.stderr, flush=True)
        for (client, request_id) in list(self.requests):
            self._send(client, p.Error(code="executor_failed", message=self.failure, request_id=request_id))
        self.requests.clear()
        self.stop()

    def _shutdown_executor(self) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                self.plans.send(p.encode(p.Shutdown()), flags=zmq.NOBLOCK)
                self.proc.wait(timeout=5)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        for sock in ("frontend", "plans", "results"):
            if hasattr(self, sock):
                getattr(self, sock).close(linger=0)
        self.ctx.term()
