"""Gateway worker processes: N uvicorn servers on one port, each with its own SDK client.

``forerun serve --port P --api-workers N`` binds the port once, in the server
process, before the model loads (:func:`listening_socket`: a port in use is
one line and exit 1, never a second server sharing it), and calls
:func:`start_gateways` once the scheduler's client socket is bound.  Each
worker is a plain child process (``python -m ipc.gateway.process
CONFIG_JSON``) that inherits the listening socket and accepts on it; there is
no supervisor process between the scheduler and the workers (uvicorn's
``--workers`` would add one, and needs the app as an import string).  The
workers share prometheus_client's multiprocess directory (``<run
dir>/prometheus``), so any worker's ``/metrics`` adds up all of them.

The server process owns the workers' lives: they ignore SIGINT (a Ctrl-C goes
to the whole process group; the server drains, then stops them) and stop on
SIGTERM, after the responses in flight.

The API key reaches the workers through the environment, never the command
line (which any local user can read in ``ps``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import msgspec

from ipc.gateway.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TOKENIZER_THREADS

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
API_KEY_ENV = "FORERUN_API_KEY"
PROFILE_ENV = "FORERUN_GATEWAY_PROFILE"  # a folder: each worker runs under cProfile and writes its stats there
PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 300.0


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True):
    address: str  # the scheduler's client address
    host: str
    port: int
    fd: int  # the listening socket, bound by the server process and inherited
    ready_file: str  # created once the worker serves
    parent_pid: int
    max_request_bytes: int
    tokenizer_threads: int
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a request body idle this long is a 408; a head this long: closed


class Gateways:
    """The running gateway workers of one server."""

    def __init__(self, configs: list[WorkerConfig], env: dict[str, str], metrics_dir: str, sock: socket.socket,
                 requires_key: bool) -> None:
        self.sock = sock
        self.requires_key = requires_key
        self.configs = configs
        self.env = env
        self.metrics_dir = metrics_dir
        self._lock = threading.Lock()  # a restart (the server's watcher thread) against stop
        self._stopped = False
        self.procs = [self._spawn(cfg) for cfg in configs]

    def _spawn(self, cfg: WorkerConfig) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "ipc.gateway.process", msgspec.json.encode(cfg).decode()]
        return subprocess.Popen(cmd, env=self.env, preexec_fn=_die_with_parent, pass_fds=(self.sock.fileno(),))

    def restart(self, i: int) -> None:
        """Start worker ``i`` again after it exited: its ready file removed and its live gauges dropped from the
        shared metrics (its counters stay: they only go up)."""
        from prometheus_client import multiprocess

        with self._lock:
            if self._stopped:
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.configs[i].ready_file)
            multiprocess.mark_process_dead(self.procs[i].pid, self.metrics_dir)
            self.procs[i] = self._spawn(self.configs[i])

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
                    raise RuntimeError(f"gateway worker {i} exited with status {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway workers were not ready after {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self, timeout: float = 5.0) -> None:
        """Terminate every worker (SIGTERM, then SIGKILL after ``timeout``) and drop the metric files."""
        with self._lock:
            self._stopped = True
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
        self.sock.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends SIGTERM when the server process dies; SIGINT is
    ignored (an ignored signal stays ignored across exec), so a Ctrl-C in the terminal leaves the
    stopping to the server process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the worker also polls its parent pid


def start_gateways(address: str, *, workers: int, run_dir: str, sock: Optional[socket.socket] = None,
                   host: str = "127.0.0.1", port: int = 0, api_key: Optional[str] = None,
                   max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                   tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS,
                   body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> Gateways:
    """Start ``workers`` gateway processes accepting on ``sock`` (else a new listening_socket(host, port),
    which raises OSError when the port is taken); returns at once (see wait_ready)."""
    if workers < 1:
        raise ValueError(f"--api-workers must be at least 1, got {workers}")
    if max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be at least 1024, got {max_request_bytes}")
    if tokenizer_threads < 1:
        raise ValueError(f"--api-tokenizer-threads must be at least 1, got {tokenizer_threads}")
    if not body_timeout_s > 0:
        raise ValueError(f"the request body timeout must be positive, got {body_timeout_s}")
    if sock is None:
        sock = listening_socket(host, port)
    host, port = sock.getsockname()[:2]
    metrics_dir = os.path.join(run_dir, "prometheus")
    shutil.rmtree(metrics_dir, ignore_errors=True)
    os.makedirs(metrics_dir)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=metrics_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PROJECT_ROOT, env.get("PYTHONPATH")]))
    env.pop(API_KEY_ENV, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    configs = [WorkerConfig(address=address, host=host, port=port, fd=sock.fileno(), parent_pid=os.getpid(),
                            ready_file=os.path.join(run_dir, f"gateway-{i}.ready"),
                            max_request_bytes=max_request_bytes, tokenizer_threads=tokenizer_threads,
                            body_timeout_s=body_timeout_s)
               for i in range(workers)]
    return Gateways(configs, env, metrics_dir, sock, requires_key=bool(api_key))


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """The HTTP port, bound and listening in the server process; its workers inherit it.

    No SO_REUSEPORT: with it a second server (or any program of the same user) could bind the same port
    and the kernel would split the connections between them.  SO_REUSEADDR only lets a restarted server
    bind while the last one's connections are in TIME_WAIT.  Raises OSError (EADDRINUSE: the port is taken)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(False)  # passed to the workers alone (pass_fds), not to the executor
    return sock


def head_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's httptools protocol with a deadline for each request's head (request line and headers): from the
    connection's opening, or from the first byte of a later request on it, to the end of the headers.  A client
    that opens connections and sends nothing, or stalls inside its headers, is closed after ``timeout_s`` (uvicorn
    has no such timer: its keep-alive one runs only between requests, and any byte stops it), so such clients
    cannot hold a worker's sockets and buffers."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class HeadTimeoutProtocol(HttpToolsProtocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._head_timer is None:
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_timer = self.loop.call_later(timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol


async def _serve(cfg: WorkerConfig, sock: socket.socket) -> int:
    import uvicorn

    from ipc.gateway.app import create_app

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own handlers would stop on SIGINT and raise the signal again once stopped (a
            # KeyboardInterrupt traceback): this worker stops on SIGTERM alone, from the server process.
            yield

    app = create_app(cfg.address, os.environ.get(API_KEY_ENV) or None, max_request_bytes=cfg.max_request_bytes,
                     tokenizer_threads=cfg.tokenizer_threads, body_timeout_s=cfg.body_timeout_s,
                     exit_on_start_failure=True)
    # No proxy-headers middleware: nothing here reads the client's address, and it is one more
    # layer on every request.
    server = Server(uvicorn.Config(app, loop="none", http=head_timeout_protocol(cfg.body_timeout_s), lifespan="on",
                                   proxy_headers=False, log_level="warning", access_log=False, timeout_keep_alive=30))
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
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
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server process stops this worker (SIGTERM)
    sock = socket.socket(fileno=cfg.fd)  # bound and listening: inherited from the server process
    import uvloop

    profile_dir = os.environ.get(PROFILE_ENV)
    if not profile_dir:
        return uvloop.run(_serve(cfg, sock))
    import cProfile

    # Where a worker's time goes (benchmarks): one pstats file per worker, written when it stops.
    with cProfile.Profile() as prof:
        rc = uvloop.run(_serve(cfg, sock))
    prof.dump_stats(os.path.join(profile_dir, f"gateway-{os.getpid()}.prof"))
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv))
