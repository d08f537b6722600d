"""ZeroMQ socket helpers: addresses, options, and bounded decoding.

Every socket gets explicit high-water marks, ``linger=0`` (closing never
blocks on unsent messages) and, for sockets that read untrusted bytes, a
maximum message size enforced by libzmq itself (oversized frames are dropped
by the transport and the peer is disconnected, the server keeps serving).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import uuid

import zmq

# Unix domain socket paths are limited to 107 bytes on Linux (sun_path is 108).
MAX_IPC_PATH = 107
DEFAULT_HWM = 100_000
# The largest client frame: a 1M-token prompt as msgpack ints is about 5 MB.
MAX_CLIENT_MESSAGE_BYTES = 16 * 1024 * 1024


# forerun-PID-HEX: a server's run directory (no longer than the 20 characters of forerun-HEX12 it once was at a
# 7-digit process id: its socket paths must fit ipc's 107 bytes)
_RUN_DIR_NAME = re.compile(r"forerun-(\d+)-[0-9a-f]{4}")
# In each run directory: a file its process holds an exclusive lock on for its life (a process id says nothing across
# PID namespaces: containers sharing /tmp)
ALIVE_FILE = ".alive"
_held: list[int] = []  # this process's run directories' locks, held until it exits


def new_run_dir() -> str:
    """A private per-server directory for ipc:// socket files, locked for this process's life (:data:`ALIVE_FILE`);
    the run directories of servers that died without removing theirs (SIGKILL, an OOM kill) are removed first."""
    base = os.environ.get("FORERUN_RUN_DIR") or tempfile.gettempdir()
    remove_dead_run_dirs(base)
    os.makedirs(base, exist_ok=True)
    while True:
        path = os.path.join(base, f"forerun-{os.getpid()}-{uuid.uuid4().hex[:4]}")
        try:
            os.mkdir(path, mode=0o700)
            break
        except FileExistsError:  # this process's own, made before
            continue
    # locked under another name, then named: a server cleaning up never finds the lock file unheld
    fd = os.open(os.path.join(path, ALIVE_FILE + ".new"), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else holds it
    os.rename(os.path.join(path, ALIVE_FILE + ".new"), os.path.join(path, ALIVE_FILE))
    _held.append(fd)
    return path


def remove_dead_run_dirs(base: str) -> None:
    """Remove the run directories in ``base`` whose lock no process holds (one without a lock file is being made, or
    is not ours to judge)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if _RUN_DIR_NAME.fullmatch(name) is None:
            continue
        path = os.path.join(base, name)
        try:
            fd = os.open(os.path.join(path, ALIVE_FILE), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its server lives
            os.close(fd)
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts: it is not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ipc_address(run_dir: str, name: str) -> str:
    path = os.path.join(run_dir, f"{name}.sock")
    if len(path.encode()) > MAX_IPC_PATH:
        raise ValueError(
            f"ipc socket path {path!r} is {len(path.encode())} bytes; the limit is "
            f"{MAX_IPC_PATH}. Set FORERUN_RUN_DIR to a shorter directory."
        )
    return f"ipc://{path}"


def check_address(addr: str) -> str:
    """Validate a user-supplied ``ipc://`` or ``tcp://`` address."""
    if not isinstance(addr, str):
        raise TypeError(f"address must be a string, ipc://PATH or tcp://HOST:PORT; got {type(addr).__name__}")
    if addr.startswith("ipc://"):
        path = addr[len("ipc://") :]
        if len(path.encode()) > MAX_IPC_PATH:
            raise ValueError(f"ipc path {path!r} is longer than {MAX_IPC_PATH} bytes")
        return addr
    if addr.startswith("tcp://"):
        return addr
    raise ValueError(f"address {addr!r} must start with ipc:// or tcp://")


def ipv6_for(sock: zmq.Socket, addr: str) -> zmq.Socket:
    """IPv6 on for a ``tcp://[...]`` address (ZeroMQ's sockets are IPv4-only unless asked, and a bracketed host is
    refused with "No such device"); other addresses leave the socket as it is."""
    if addr.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    return sock


def configure(sock: zmq.Socket, *, max_msg_bytes: int | None = None, hwm: int = DEFAULT_HWM) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if max_msg_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    return sock


def make_socket(ctx: zmq.Context, kind: int, addr: str, *, bind: bool,
                max_msg_bytes: int | None = None, hwm: int = DEFAULT_HWM) -> zmq.Socket:
    """Create, configure and bind or connect one socket."""
    sock = ipv6_for(configure(ctx.socket(kind), max_msg_bytes=max_msg_bytes, hwm=hwm), addr)
    if bind:
        sock.bind(check_address(addr))
    else:
        sock.connect(check_address(addr))
    return sock
