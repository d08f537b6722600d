"""Gateway worker processes: N uvicorn servers on one port, each with its own SDK client.

``forerun serve --port P --api-workers N`` calls :func:`start_gateways` once
the scheduler's client socket is bound.  Each worker is a plain child process
(``python -m ipc.gateway.process CONFIG_JSON``) that binds its own listening
socket with ``SO_REUSEPORT``: the kernel spreads new connections over the N
sockets, no worker blocks another's accepts, and there is no supervisor
process between the scheduler and the workers (uvicorn's ``--workers`` would
add one, and needs the app as an import string).  The workers share
prometheus_client's multiprocess directory (``<run dir>/prometheus``), so any
worker's ``/metrics`` adds up all of them.

The API key reaches the workers through the environment, never the command
line (which any local user can read in ``ps``).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import msgspec

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY_ENV = "FORERUN_API_KEY"
PROFILE_ENV = "FORERUN_GATEWAY_PROFILE"  # a folder: each worker runs under cProfile and writes its stats there
PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 300.0


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    address: str  # the scheduler's client address
    host: str
    port: int
    ready_file: str  # created once the worker serves
    parent_pid: int


class Gateways:
    """The running gateway workers of one server."""

    def __init__(self, procs: list[subprocess.Popen], configs: list[WorkerConfig], metrics_dir: str,
                 requires_key: bool) -> None:
        self.procs = procs
        self.requires_key = requires_key
        self.configs = configs
        self.metrics_dir = metrics_dir

    @property
    def url(self) -> str:
        host = self.configs[0].host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.configs[0].port}"

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Block until every worker serves; RuntimeError naming the first that exited instead."""
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(c.ready_file) for c in self.configs):
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    raise RuntimeError(f"gateway worker {i} exited with status {proc.returncode} while starting "
                                       f"(is port {self.configs[i].port} in use?)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway workers were not ready after {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate every worker (SIGTERM, then SIGKILL after ``timeout``) and drop the metric files."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends SIGTERM when the server process dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the worker also polls its parent pid


def start_gateways(address: str, *, host: str, port: int, workers: int, run_dir: str,
                   api_key: Optional[str] = None) -> Gateways:
    """Start ``workers`` gateway processes serving ``host:port``; returns at once (see wait_ready)."""
    if workers < 1:
        raise ValueError(f"--api-workers must be at least 1, got {workers}")
    metrics_dir = os.path.join(run_dir, "prometheus")
    shutil.rmtree(metrics_dir, ignore_errors=True)
    os.makedirs(metrics_dir)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PROJECT_ROOT, env.get("PYTHONPATH")]))
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    configs = [WorkerConfig(address=address, host=host, port=port, parent_pid=os.getpid(),
                            ready_file=os.path.join(run_dir, f"gateway-{i}.ready")) for i in range(workers)]
    procs = []
    for cfg in configs:
        cmd = [sys.executable, "-m", "ipc.gateway.process", msgspec.json.encode(cfg).decode()]
        procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))
    return Gateways(procs, configs, metrics_dir, requires_key=bool(api_key))


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT, so that every worker can bind the same port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


async def _serve(cfg: WorkerConfig, sock: socket.socket) -> int:
    import uvicorn

    from ipc.gateway.app import create_app

    app = create_app(cfg.address, os.environ.get(API_KEY_ENV) or None)
    # No proxy-headers middleware: nothing here reads the client's address, and it is one more
    # layer on every request.
    server = uvicorn.Server(uvicorn.Config(app, loop="none", http="httptools", lifespan="on", proxy_headers=False,
                                           log_level="warning", access_log=False, timeout_keep_alive=30))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        gc.freeze()  # start-up objects (uvicorn, starlette, the tokenizer) are never scanned again
        open(cfg.ready_file, "w").close()
    while not task.done():
        if os.getppid() != cfg.parent_pid:
            server.should_exit = True  # the server process is gone
        await asyncio.wait((task,), timeout=0.5)
    return 0 if server.started else 1


def main(argv: list[str]) -> int:
    """Entry point of one gateway worker process."""
    cfg = msgspec.json.decode(argv[1], type=WorkerConfig)
    try:
        sock = listening_socket(cfg.host, cfg.port)
    except OSError as e:
        print(f"forerun: gateway cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr, flush=True)
        return 1
    import uvloop

    profile_dir = os.environ.get(PROFILE_ENV)
    if not profile_dir:
        return uvloop.run(_serve(cfg, sock))
    import cProfile

    # Where a worker's time goes (benchmarks): one pstats file per worker, written when it stops.
    # uvicorn raises the SIGTERM it caught again once it has stopped: a no-op handler lets the stats be written.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    with cProfile.Profile() as prof:
        rc = uvloop.run(_serve(cfg, sock))
    prof.dump_stats(os.path.join(profile_dir, f"gateway-{os.getpid()}.prof"))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv))
