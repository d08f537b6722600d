"""The data-parallel router: one client endpoint in front of N replicas (``forerun serve --data-parallel-size N``).

Each replica is a scheduler with its executor group, in its own process (``scheduler_proc/replica.py``) on an
ipc:// address in the router's run directory.  The router binds the public address, speaks the client protocol
there (the SDK and the gateway workers cannot tell it from a scheduler), and is itself one client, a DEALER,
of every replica.

Main loop (asyncio + uvloop)::

    while serving:
        await wake              # a client message, a replica message, or the tick
        read_clients()          # Hello, Generate (routed), Abort, stats (asked of every replica), tokenizer
        read_replicas()         # tokens, finishes and errors relayed to their clients; replicas joining
        supervise()             # every TICK_S: dead replicas' requests re-sent, restarts, silent clients

* **Clients** (``scheduler_proc/router_clients.py``): the client protocol at the router; GetStats is asked of every
  replica and answered with the sums (``ServerStats.replicas``: each one's); the tokenizer files are fetched once.
* **Routing** (``scheduler_proc/routing.py``): to the replica where the request costs least, its cached prefix
  weighed against its queue.
* **Relaying** (``scheduler_proc/router_relay.py``): a replica's TokenDeltas is split per client under the clients'
  request ids (one decode, and one encode per client); the router records each completion's tokens as it relays them.
* **Failover**: a replica whose process exits (killed, or its executor failed for good: it then exits without
  failing its requests) is read to the end, then each unfinished completion it held goes to another replica
  with the tokens already relayed (``scheduler_proc/replica_messages.py``): its client sees a delay and the
  same tokens.  The router restarts the replica (at most ``--max-restarts`` within ``--restart-window``); it
  rejoins once it answers Hello.  With every replica down for good the router fails its requests and exits.  A
  replica that is up but silent (no message for PING_S: it is sent a Ping) for ``--executor-hang-timeout``
  seconds has a stuck loop: the router kills it, and it fails over as a dead one (its executor's hangs are its own
  supervisor's).
* **Shutdown**: SIGTERM goes on to every replica, which drains as a lone server does; the router exits when
  they all have.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections import deque
from typing import Optional

import msgspec
import zmq
import zmq.asyncio

from ipc import protocol as p
from ipc.models import ModelSource
from ipc.sockets import configure, ipc_address, new_run_dir
from scheduler_proc.config import ServerConfig
from scheduler_proc.executor_process import describe_exit
from scheduler_proc.frontend import Frontend, bind_frontend
from scheduler_proc.replica import refusal_file, replica_config, spawn_replica
from scheduler_proc.replica_messages import Job, Leg
from scheduler_proc.router_clients import RouterClients, StatsAsk
from scheduler_proc.router_relay import RouterRelay
from scheduler_proc.routing import PrefixIndex
from scheduler_proc.server import TRANSPORT_MAX_MESSAGE_BYTES, say

TICK_S = 0.05  # replica deaths, restarts (CLIENT_CHECK_S apart while idle)
PING_S = 1.0  # a replica silent this long is sent a Ping (any message it sends shows its loop runs)
CLIENT_CHECK_S = 0.25  # heartbeat expiry and owed-error retries
REPLICA_FRAMES_PER_ITERATION = 256


class Replica:
    """One replica as the router sees it: its process, its socket, what is in flight there."""

    def __init__(self, index: int, cfg: ServerConfig, gpus: Optional[str], run_dir: str) -> None:
        """``run_dir``: the router's, under which the replica makes its own (gone with the router's, whatever
        becomes of the replica)."""
        self.index, self.cfg, self.gpus, self.run_dir = index, cfg, gpus, run_dir
        self.proc = None
        self.sock: Optional[zmq.asyncio.Socket] = None
        self.watcher: Optional[asyncio.Task] = None
        self.up = False  # it answered Hello: requests may go there
        self.retired = False  # down for good: restarted too often
        self.load = 0  # completions in flight there
        self.prefixes = PrefixIndex()
        self.asks: deque[StatsAsk] = deque()
        self.starts: deque[float] = deque()  # when it was (re)started, within the restart window
        self.restarts = 0  # since the server started
        self.last_heard = 0.0  # when its last message came (it joined, at the latest)
        self.pinged = False  # a Ping went since then

    def start(self, ctx: zmq.asyncio.Context, hello: p.Hello) -> None:
        self.starts.append(time.monotonic())
        self.proc = spawn_replica(self.cfg, self.gpus, self.run_dir)
        # No high-water marks: the replica is trusted, and a full pipe would make it drop the router as slow.
        self.sock = configure(ctx.socket(zmq.DEALER), hwm=0)
        self.sock.connect(self.cfg.client_address)  # retried by ZeroMQ until the replica has bound it
        self.now = zmq.Socket.shadow(self.sock.underlying)
        self.send(hello)

    def send(self, msg) -> None:
        self.now.send(p.encode(msg))

    def exit_reason(self, starting: bool = False) -> str:
        """Why its process exited: the refusal it left while starting (scheduler_proc.replica.report_refusal), once,
        or its exit status."""
        path = refusal_file(self.run_dir, self.index)
        try:
            with open(path) as f:
                refusal = f.read()
            os.remove(path)
            return f"replica {self.index}: {refusal}"
        except OSError:
            return f"replica {self.index} {describe_exit(self.proc.returncode)}{' while starting' if starting else ''}"

    def has_input(self) -> bool:
        """A message is waiting (reading ZeroMQ's events also re-arms its edge-triggered descriptor)."""
        return self.sock is not None and bool(self.now.get(zmq.EVENTS) & zmq.POLLIN)

    def recv_batch(self, limit: int) -> list[bytes]:
        out = []
        for _ in range(limit):
            try:
                out.append(self.now.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        return out

    def close(self) -> None:
        """Forget the connection and everything routed by it (the caller re-sends its requests)."""
        if self.watcher is not None:
            self.watcher.cancel()
            self.watcher = None
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.up, self.load = False, 0
        self.prefixes.clear()


class Router(RouterClients, RouterRelay):
    """``forerun serve --data-parallel-size N``: see the module docstring.  Used by ``launch.serve`` as a Server."""

    def __init__(self, cfg: ServerConfig, model: ModelSource, gpus: list[Optional[str]]):
        self.cfg = cfg
        self.model = model
        self.server_id = uuid.uuid4().hex
        self.owns_run_dir = cfg.run_dir is None
        self.run_dir = cfg.run_dir or new_run_dir()
        self.client_address = cfg.client_address or ipc_address(self.run_dir, "client")
        self.ctx = zmq.asyncio.Context()
        self.frontend: Optional[Frontend] = None
        self.replicas = [Replica(i, replica_config(cfg, i, ipc_address(self.run_dir, f"replica{i}"), g, len(gpus)),
                                 g, self.run_dir) for i, g in enumerate(gpus)]
        self.hello = p.Hello(p.PROTOCOL_VERSION, "router", batch_deltas=True, api_key=cfg.api_key or "")
        self.info: Optional[p.ServerInfo] = None  # the first replica's, with the router's server_id
        self.api_worker_restarts = 0  # gateway workers restarted (scheduler_proc/launch.py counts them)
        self.tokenizer: Optional[bytes] = None  # a replica's TokenizerFiles, fetched once, as sent
        self.tokenizer_asked = False
        self.jobs: dict[tuple[bytes, str], Job] = {}
        self.legs: dict[str, Leg] = {}
        self.orphans: deque[Leg] = deque()  # legs waiting for a replica to be up
        self._leg_ids = itertools.count()
        self.wake = asyncio.Event()
        self.failure: Optional[str] = None
        self.shutdown_at: Optional[float] = None
        self.stopping = False
        self.next_tick = self.next_client_check = 0.0
        self.block_size = cfg.executor.block_size
        self.slack = cfg.executor.num_slots  # a whole batch more in flight than the least loaded: go elsewhere

    # ------------------------------------------------------------- start-up

    def bind(self) -> None:
        """Listen for clients (before any replica loads: address errors show at once); raises StartupError."""
        self.frontend = bind_frontend(self.ctx, self.client_address, self.cfg, TRANSPORT_MAX_MESSAGE_BYTES)

    def start_executor(self, on_progress=None) -> None:
        """Start every replica and block until each has answered Hello (and one sent the tokenizer files)."""
        if self.frontend is None:
            self.bind()
        for replica in self.replicas:
            replica.start(self.ctx, self.hello)
        poller = zmq.Poller()
        for replica in self.replicas:
            poller.register(replica.now, zmq.POLLIN)
        deadline = time.monotonic() + self.cfg.executor_start_timeout_s
        while not (all(r.up for r in self.replicas) and self.tokenizer is not None):
            for r in self.replicas:
                if r.proc.poll() is not None:
                    raise RuntimeError(r.exit_reason(starting=True))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the replicas were not ready after {self.cfg.executor_start_timeout_s:.0f} s")
            poller.poll(100)
            self.read_replicas()

    # ------------------------------------------------------------ main loop

    async def serve(self) -> int:
        """Serve until a shutdown ends or every replica is down for good; returns the process exit status."""
        for replica in self.replicas:
            if replica.sock is not None:
                self._watch(replica)
        clients = asyncio.create_task(self._watch_socket(self.frontend.sock))
        ticker = asyncio.create_task(self._tick())
        try:
            while not self.stopping:
                await self._next_wake()
                self.read_clients()
                self.read_replicas()
                self.supervise()
        finally:
            clients.cancel()
            ticker.cancel()
        return 1 if self.failure else 0

    async def _next_wake(self) -> None:
        await (asyncio.sleep(0) if self.wake.is_set() else self.wake.wait())
        self.wake.clear()

    async def _watch_socket(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            await sock.poll(flags=zmq.POLLIN)
            self.wake.set()
            await asyncio.sleep(0)

    async def _tick(self) -> None:
        """Wake the loop for :meth:`supervise` every TICK_S; while idle (no request, every replica up) every
        CLIENT_CHECK_S, as the replicas' own supervisors (a replica that dies then is found within a quarter second;
        pings still go out after PING_S)."""
        while True:
            idle = not (self.jobs or self.orphans) and all(r.up for r in self.replicas)
            await asyncio.sleep(CLIENT_CHECK_S if idle else TICK_S)
            self.wake.set()

    def _watch(self, replica: Replica) -> None:
        replica.watcher = asyncio.create_task(self._watch_socket(replica.sock))

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    def begin_shutdown(self) -> None:
        """SIGTERM / Ctrl-C: no new requests; every replica drains as a lone server does (a second signal: at once)."""
        if self.shutdown_at is None:
            say(f"shutting down: {len(self.jobs)} requests get up to {self.cfg.shutdown_timeout_s:g} s to finish")
        self.shutdown_at = time.monotonic()
        for replica in self.replicas:
            if replica.proc is not None and replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        self.wake.set()

    # ------------------------------------------------------------- replicas

    def read_replicas(self) -> None:
        for replica in self.replicas:
            self._read_replica(replica, REPLICA_FRAMES_PER_ITERATION)
            if replica.has_input():  # more, or an edge a plain send took from the watcher
                self.wake.set()
        self._drop_unreachable_clients()
        if self.frontend.has_input():
            self.wake.set()

    def _read_replica(self, replica: Replica, limit: int) -> None:
        if replica.sock is None:
            return
        frames = replica.recv_batch(limit)
        if frames:
            replica.last_heard, replica.pinged = time.monotonic(), False
        for data in frames:
            try:
                msg = p.server_reply_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:  # a bug: said, never fatal
                say(f"replica {replica.index} sent an undecodable message: {e}")
                continue
            if isinstance(msg, p.TokenDeltas):
                self._relay_deltas(msg)
            elif isinstance(msg, p.Finished):
                self._relay_finished(msg)
            elif isinstance(msg, p.TokenDelta):
                self._relay_deltas(p.TokenDeltas([msg.request_id], [msg.token_ids], [msg.index], [msg.logprobs],
                                                 [msg.prompt_logprobs]))
            elif isinstance(msg, p.Error) and msg.request_id is not None:
                self._relay_error(msg)
            elif isinstance(msg, p.ServerStats):
                self._on_stats(replica, msg)
            elif isinstance(msg, p.ServerInfo):
                self._on_joined(replica, msg)
            elif isinstance(msg, p.TokenizerFiles):
                self.tokenizer = data
            elif isinstance(msg, p.Error):
                say(f"replica {replica.index} answered [{msg.code}] {msg.message}")

    def _on_stats(self, replica: Replica, msg: p.ServerStats) -> None:
        if not replica.asks:
            return
        ask = replica.asks.popleft()
        ask.replies.append(msg)
        ask.waiting.discard(replica.index)
        if not ask.waiting:
            self._answer(ask)

    def _on_joined(self, replica: Replica, info: p.ServerInfo) -> None:
        replica.up, replica.last_heard = True, time.monotonic()
        if self.info is None:
            self.info = msgspec.structs.replace(info, server_id=self.server_id)
        if not self.tokenizer_asked:  # once, of the first replica up (it holds the files the others hold)
            self.tokenizer_asked = True
            replica.send(p.GetTokenizer())
        if self.orphans:
            say(f"replica {replica.index} is back: {len(self.orphans)} waiting requests go to it")
        while self.orphans:
            self._place(self.orphans.popleft())

    # ---------------------------------------------------------- supervision

    def supervise(self) -> None:
        """Every TICK_S: replicas that died (their requests re-sent) and restarts, silent ones pinged or killed;
        every CLIENT_CHECK_S: clients."""
        now = time.monotonic()
        if now < self.next_tick:
            return
        self.next_tick = now + TICK_S
        for replica in self.replicas:
            if replica.proc is not None and replica.proc.poll() is not None:
                self._replica_died(replica, now)
            elif replica.up:
                self._check_alive(replica, now)
        if self.shutdown_at is not None and all(r.proc is None for r in self.replicas):
            self.stop()
        if now >= self.next_client_check:
            self.next_client_check = now + CLIENT_CHECK_S
            for client in self.frontend.expired(now):
                self._drop_client(client)
            self.frontend.flush_owed()

    def _check_alive(self, replica: Replica, now: float) -> None:
        """Ping a replica silent for PING_S; kill one silent past the hang timeout (a live process whose loop is
        stuck): the next tick sees it dead, and its requests fail over."""
        silent = now - replica.last_heard
        if silent > self.cfg.executor_hang_timeout_s:
            say(f"replica {replica.index} answered nothing for {silent:.0f} s (--executor-hang-timeout "
                f"{self.cfg.executor_hang_timeout_s:g}): killing it")
            replica.up = False  # no new request goes there meanwhile
            replica.proc.kill()
        elif silent > PING_S and not replica.pinged:
            replica.pinged = True
            replica.send(p.Ping())

    def _replica_died(self, replica: Replica, now: float) -> None:
        """Read what it sent before dying, re-send its requests' unfinished completions, restart it."""
        self._read_replica(replica, limit=1 << 30)
        why = replica.exit_reason()
        replica.proc = None
        for ask in replica.asks:
            ask.waiting.discard(replica.index)
            if not ask.waiting:
                self._answer(ask)
        replica.asks.clear()
        replica.close()
        lost = [leg for leg in self.legs.values() if leg.replica is replica]
        for leg in lost:
            leg.replica = None  # its load left with the replica
            self._forget_leg(leg)
            self._resend(leg, why)
        if self.shutdown_at is not None:
            return
        window = self.cfg.restart_window_s
        while replica.starts and now - replica.starts[0] > window:
            replica.starts.popleft()
        replica.retired = len(replica.starts) > self.cfg.max_restarts
        others = any(not r.retired for r in self.replicas if r is not replica)
        resent = sum(len(leg.indices) for leg in lost)
        # (with no replica up they wait for one: router_relay._place)
        fate = f"; {resent} request{'s' if resent > 1 else ''} " + ("re-sent to other replicas" if others else
                                                                     "waiting for it to restart")
        if not replica.retired:
            say(f"{why}{fate if resent else ''}; restarting it")
        elif resent and others:
            say(f"{why}{fate}")
        if replica.retired:
            say(f"{why}; it restarted more than {self.cfg.max_restarts} times within {window:g} s: it stays down")
            if not others:
                self.fail_stop("every replica is down for good")
            return
        replica.restarts += 1
        replica.start(self.ctx, self.hello)
        self._watch(replica)

    def fail_stop(self, cause: str) -> None:
        self.failure = f"{cause}; the server is shutting down"
        say(self.failure)
        for job in list(self.jobs.values()):
            self.frontend.send(job.client, p.Error(code="executor_failed", message=self.failure,
                                                   request_id=job.request_id))
            self._end_job(job)
        self.stop()

    def close(self) -> None:
        """Stop the replicas (SIGTERM, then SIGKILL after the shutdown timeout), close every socket."""
        for replica in self.replicas:
            if replica.proc is not None and replica.proc.poll() is None:
                replica.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s + 5
        for replica in self.replicas:
            if replica.proc is not None:
                try:
                    replica.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    replica.proc.kill()
                    replica.proc.wait()
            replica.close()
        if self.frontend is not None:
            self.frontend.close()
        self.ctx.term()
        if self.owns_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
