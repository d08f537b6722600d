"""The executor, supervised: start it, notice death, a fatal error or a hang, start another.

Each executor process is a *generation* with its own plan and result sockets
(``plans<N>.sock``, ``results<N>.sock`` in the run directory), so nothing a
dead executor sent or was sent can reach its successor.  Later generations
are started with the capacity the first one reported (KV blocks, context
length), so every request the scheduler accepted still fits.

A hang is no step result for ``hang_timeout()`` seconds while a step is in
flight: ``max(--executor-hang-timeout, 50 x p99 step time)`` over the last
1,000 steps, so a slow model is not taken for a hung one.

With ``--tensor-parallel-size N`` a generation is N processes (ranks) started
together, each with its own plan socket (``plans<N>.sock``, ``plans<N>r<rank>.sock``)
and one shared result socket (only rank 0 sends results; any rank may send
ExecutorFatal).  The group is one executor: any rank's death is the
executor's death, and every rank is killed and restarted together.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections import deque
from typing import Callable, Optional

import msgspec
import zmq
import zmq.asyncio

from ipc import protocol as p
from ipc.sockets import ipc_address, make_socket
from scheduler_proc.config import ServerConfig
from scheduler_proc.executor_process import describe_exit, spawn_executor, wait_ready

HANG_STEP_MULTIPLE = 50
STEP_TIME_WINDOW = 1000


class Supervisor:
    """Owns the executor process and its two sockets, one generation at a time."""

    def __init__(self, cfg: ServerConfig, model_path: str, ctx: zmq.asyncio.Context, run_dir: str):
        self.cfg = cfg
        self.ctx = ctx
        self.run_dir = run_dir
        self.base = msgspec.structs.replace(cfg.executor, model=model_path, parent_pid=os.getpid())
        self.generation = 0
        self.procs: list[subprocess.Popen] = []  # rank 0 first
        self.plans: Optional[zmq.asyncio.Socket] = None  # rank 0's
        self.followers: list[tuple[zmq.Socket, zmq.asyncio.Socket]] = []  # ranks 1..N-1: (sync, async) sockets
        self.results: Optional[zmq.asyncio.Socket] = None
        self.ready: Optional[p.ExecutorReady] = None  # the first generation's capacity
        self.running = False  # the current generation is ready and not known to have failed
        self.restarts: deque[float] = deque()  # when each restart began (within the window)
        self.step_times: deque[float] = deque(maxlen=STEP_TIME_WINDOW)
        self.progress_at = 0.0  # last step result, or the send that ended an idle spell

    # ------------------------------------------------------------- start-up

    @property
    def proc(self) -> Optional[subprocess.Popen]:
        """Rank 0's process (the only one without tensor parallelism)."""
        return self.procs[0] if self.procs else None

    def _spawn(self) -> None:
        """A new generation: fresh sockets, new processes (their loading is awaited by the caller)."""
        self._close_sockets()
        self.generation += 1
        result_addr = ipc_address(self.run_dir, f"results{self.generation}")
        self.results = make_socket(self.ctx, zmq.PULL, result_addr, bind=True)
        ecfg = msgspec.structs.replace(self.base, result_addr=result_addr)
        if self.ready is not None:  # same capacity as the first generation
            ecfg = msgspec.structs.replace(ecfg, num_kv_blocks=self.ready.num_kv_blocks,
                                           max_model_len=self.ready.max_model_len,
                                           num_host_kv_blocks=self.ready.num_host_blocks)
        size = ecfg.tensor_parallel_size
        if size > 1:  # a fresh rendezvous file per generation: a dead group's file is never joined
            ecfg = msgspec.structs.replace(ecfg, tp_init_method=f"file://{self.run_dir}/tp{self.generation}.store")
        self.procs = []
        for rank in range(size):
            plan_addr = ipc_address(self.run_dir, f"plans{self.generation}" + (f"r{rank}" if rank else ""))
            plans = make_socket(self.ctx, zmq.PUSH, plan_addr, bind=True)
            if rank == 0:
                self.plans, self._plans_now = plans, zmq.Socket.shadow(plans.underlying)
            else:
                self.followers.append((zmq.Socket.shadow(plans.underlying), plans))
            self.procs.append(spawn_executor(msgspec.structs.replace(ecfg, plan_addr=plan_addr, tp_rank=rank)))

    def start(self, on_progress: Callable[[p.LoadProgress], None]) -> p.ExecutorReady:
        """The first generation, blocking until it has loaded the model."""
        self._spawn()
        sync_results = zmq.Socket.shadow(self.results.underlying)
        self.ready = wait_ready(self.procs, sync_results, self.cfg.executor_start_timeout_s, on_progress)
        self._serving()
        return self.ready

    async def restart(self) -> None:
        """Kill the current generation and start the next; raise RuntimeError if it cannot load."""
        self.kill()
        self._spawn()
        deadline = time.monotonic() + self.cfg.executor_start_timeout_s
        while time.monotonic() < deadline:
            if await self.results.poll(100, zmq.POLLIN):
                msg = p.executor_output_decoder.decode(await self.results.recv())
                if isinstance(msg, p.ExecutorReady):
                    if (msg.num_kv_blocks, msg.max_model_len, msg.num_host_blocks) != (
                            self.ready.num_kv_blocks, self.ready.max_model_len, self.ready.num_host_blocks):
                        raise RuntimeError(f"the new executor has {msg.num_kv_blocks} KV blocks and context "
                                           f"{msg.max_model_len}, the first had {self.ready.num_kv_blocks} and "
                                           f"{self.ready.max_model_len}")
                    self._serving()
                    return
                if isinstance(msg, p.ExecutorFatal):
                    raise RuntimeError(f"the new executor failed while loading: {_first_line(msg.message)}")
            elif (dead := self._dead()) is not None:
                raise RuntimeError(f"the new executor {dead} while loading")
        raise RuntimeError(f"the new executor was not ready after {self.cfg.executor_start_timeout_s:.0f} s")

    def _serving(self) -> None:
        self.running = True
        self.progress_at = time.monotonic()

    def allow_restart(self, now: float) -> bool:
        """Count a restart; False once more than --max-restarts fall within --restart-window."""
        window = self.restarts
        while window and now - window[0] > self.cfg.restart_window_s:
            window.popleft()
        window.append(now)
        return len(window) <= self.cfg.max_restarts

    # --------------------------------------------------------------- serving

    def send_plan(self, data: bytes, was_idle: bool) -> None:
        if was_idle:
            self.progress_at = time.monotonic()  # the hang clock starts with the first step in flight
        try:
            self._plans_now.send(data, zmq.NOBLOCK)
        except zmq.Again:  # the executor's queue is full (it never is at depth <= 2): send asynchronously
            self.plans.send(data)
        for now, later in self.followers:  # every rank gets every plan (none without tensor parallelism)
            try:
                now.send(data, zmq.NOBLOCK)
            except zmq.Again:
                later.send(data)

    def on_result(self, result: p.StepResult) -> None:
        self.step_times.append(result.t_end - result.t_start)
        self.progress_at = time.monotonic()

    def hang_timeout(self) -> float:
        floor = self.cfg.executor_hang_timeout_s
        if not self.step_times:
            return floor
        times = sorted(self.step_times)
        return max(floor, HANG_STEP_MULTIPLE * times[int(0.99 * (len(times) - 1))])

    def failure(self, now: float, num_inflight: int) -> Optional[str]:
        """Why the running executor must be replaced (dead or hung), or None."""
        if not self.running:
            return None
        if (dead := self._dead()) is not None:
            return f"the executor {dead}"
        if num_inflight:
            silent = now - self.progress_at
            timeout = self.hang_timeout()
            if silent > timeout:
                floor = self.cfg.executor_hang_timeout_s
                why = "--executor-hang-timeout" if timeout <= floor else \
                    f"{HANG_STEP_MULTIPLE} x the p99 step time; --executor-hang-timeout {floor:g} is its floor"
                return f"the executor returned no step for {silent:.1f} s (hang timeout {timeout:.1f} s: {why})"
        return None

    def dead_ranks(self) -> Optional[str]:
        """With several ranks, those already gone (a survivor's error about a lost peer comes first, and names only
        itself), or None."""
        return self._dead() if len(self.procs) > 1 else None

    def _dead(self) -> Optional[str]:
        """How the generation's dead processes ended ("process was killed by ...", "rank 1 (pid) ..."), or None."""
        dead = [(rank, proc) for rank, proc in enumerate(self.procs) if proc.poll() is not None]
        if not dead:
            return None
        if len(self.procs) == 1:
            return f"process {describe_exit(dead[0][1].returncode)}"
        return "; ".join(f"rank {rank} (pid {proc.pid}) {describe_exit(proc.returncode)}" for rank, proc in dead)

    # -------------------------------------------------------------- shutdown

    def kill(self) -> None:
        """Kill every rank of the generation and reap them (no process is left behind)."""
        self.running = False
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()

    def shutdown(self) -> None:
        """Ask every rank to exit; kill them all if they have not within 5 s."""
        self.running = False
        if not any(proc.poll() is None for proc in self.procs):
            return
        try:
            for sock in [self._plans_now] + [now for now, _ in self.followers]:
                sock.send(p.encode(p.Shutdown()), flags=zmq.NOBLOCK)
            deadline = time.monotonic() + 5
            for proc in self.procs:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (zmq.ZMQError, subprocess.TimeoutExpired):
            self.kill()

    def _close_sockets(self) -> None:
        for sock in [self.plans, self.results] + [later for _, later in self.followers]:
            if sock is not None:
                sock.close(linger=0)
        self.plans = self.results = None
        self.followers = []

    def close(self) -> None:
        self.kill()
        self._close_sockets()


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""
