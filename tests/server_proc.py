"""Start a real `forerun serve` process for integration tests and stop it afterwards."""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

from ipc import protocol as p
from ipc.client.raw import RawConnection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_dir(prefix: str = "fr") -> str:
    """A new folder for a server's sockets, short (ipc addresses are limited to 107 bytes: under /tmp, not under
    pytest's tmp_path), removed when the test process exits."""
    folder = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def python_path() -> str:
    """PYTHONPATH for a child process: ROOT first, then the caller's path (GPU machines carry pyzmq, msgspec, ... in a
    --target folder named there)."""
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)


class ServerProcess:
    def __init__(self, *args: str, tmpdir: str, timeout: float = 300.0, address: str | None = None,
                 new_session: bool = False):
        """``new_session``: the server leads its own process group (a test may signal the whole group)."""
        self.address = address or f"ipc://{tmpdir}/c-{uuid.uuid4().hex[:8]}.sock"
        env = dict(os.environ, PYTHONPATH=python_path(), PYTHONUNBUFFERED="1", FORERUN_RUN_DIR=tmpdir)
        cmd = [sys.executable, "-m", "scheduler_proc.launch", "serve", "--address", self.address, "--quiet", *args]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=new_session)
        self.log: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited during start-up:\n" + "".join(self.log))
            self.log.append(line)
            if "ready at" in line:
                return
        raise TimeoutError("server not ready:\n" + "".join(self.log))

    def executor_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return int(out[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def server_stats(address: str, msg=None) -> p.ServerStats:
    """Ask a server for its pool counters over a raw connection (the SDK has no need for them).

    ``msg``: send this instead of GetStats (ResetPrefixCache, whose reply is ServerStats too).
    """
    async with RawConnection(address, timeout=10) as conn:
        await conn.hello("stats")  # the server answers nothing but Hello and Ping before a Hello
        if msg is None:
            return await conn.stats()
        await conn.send(msg)
        return await conn.recv()


async def reset_prefix_cache(address: str) -> p.ServerStats:
    """Make a server forget its cached KV blocks (raw socket, until the SDK has the call)."""
    return await server_stats(address, p.ResetPrefixCache())


async def wait_idle(address: str, timeout: float = 120.0) -> p.ServerStats:
    """Stats once nothing is running, waiting, draining or in flight (or the last seen after ``timeout`` s: a step
    launched ahead on a GPU may first compile its kernels)."""
    deadline = time.monotonic() + timeout
    while True:
        s = await server_stats(address)
        if not (s.num_running or s.num_waiting or s.num_draining or s.num_inflight_steps) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.05)


def assert_no_leak(s: p.ServerStats) -> None:
    """Every KV block and slot is back in its pool."""
    assert s.num_free_kv_blocks == s.num_kv_blocks, s
    assert s.num_free_slots == s.num_slots, s
