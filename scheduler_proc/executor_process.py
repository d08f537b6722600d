"""Start the executor process (or the ranks of a tensor-parallel group), wait for it to load, notice when it dies."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional, Sequence

import msgspec
import zmq

from ipc.config import ExecutorConfig
from ipc import protocol as p

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PR_SET_PDEATHSIG = 1
# NVLink multicast (NVLS) off in NCCL, PyTorch's symmetric memory and NVSHMEM: on the shared multi-GPU
# hosts a program using it can take the host's GPUs out of service (the device notes, KINDS.md).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def die_with_parent() -> None:
    """Runs in the child before exec: the kernel kills it when its parent (the scheduler; a replica's router)
    dies.  SIGINT and SIGTERM are ignored (and stay ignored across exec): a Ctrl-C or a supervisor's
    ``kill -TERM -PGID`` reaches the whole process group, and the parent, which drains and then stops its children
    (SIGKILL), is the one to act on it; a KeyboardInterrupt or a death here would look like a crash (the executor
    restarted in the middle of the drain)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the executor also polls its parent pid


def spawn_executor(cfg: ExecutorConfig) -> subprocess.Popen:
    """``python -m executor_proc.main CONFIG_JSON`` (one rank), killed by the kernel when this process dies."""
    env = dict(os.environ, **NO_MULTICAST_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PROJECT_ROOT, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "executor_proc.main", msgspec.json.encode(cfg).decode()]
    return subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)


def describe_exit(returncode: Optional[int]) -> str:
    if returncode is None:
        return "is still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        return f"was killed by signal {name}"
    return f"exited with status {returncode}"


def wait_ready(
    procs: Sequence[subprocess.Popen], results: zmq.Socket, timeout_s: float,
    on_progress: Callable[[p.LoadProgress], None] = lambda m: None,
) -> p.ExecutorReady:
    """Read load progress until the executor (rank 0, once every rank is built) is ready; raise with the
    cause if it is not (an ExecutorFatal from any rank, or any rank's exit)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if results.poll(100):
            msg = p.executor_output_decoder.decode(results.recv())
            if isinstance(msg, p.ExecutorReady):
                return msg
            if isinstance(msg, p.LoadProgress):
                on_progress(msg)
            elif isinstance(msg, p.ExecutorFatal):
                if msg.refused:  # the configuration does not fit: the executor's one line says why
                    raise RuntimeError(msg.message)
                raise RuntimeError(f"the executor failed while loading:\n{msg.message}")
        elif (proc := next((q for q in procs if q.poll() is not None), None)) is not None:
            rank = f" (rank {list(procs).index(proc)})" if len(procs) > 1 else ""
            raise RuntimeError(f"the executor process{rank} {describe_exit(proc.returncode)} while loading")
    raise TimeoutError(f"the executor was not ready after {timeout_s:.0f} s")
