"""ZeroMQ socket helpers: addresses, options, and bounded decoding.

Every socket gets explicit high-water marks, ``linger=0`` (closing never
blocks on unsent messages) and, for sockets that read untrusted bytes, a
maximum message size enforced by libzmq itself (oversized frames are dropped
by the transport and the peer is disconnected, the server keeps serving).
"""

from __future__ import annotations

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


def new_run_dir() -> str:
    """A private per-server directory for ipc:// socket files, named after this process; the run directories of
    this user's servers that died without removing theirs (SIGKILL, an OOM kill) are removed first."""
    base = os.environ.get("FORERUN_RUN_DIR") or tempfile.gettempdir()
    remove_dead_run_dirs(base)
    os.makedirs(base, exist_ok=True)
    while True:
        path = os.path.join(base, f"forerun-{os.getpid()}-{uuid.uuid4().hex[:4]}")
        try:
            os.mkdir(path, mode=0o700)
            return path
        except FileExistsError:  # this process's own, made before
            continue


def remove_dead_run_dirs(base: str) -> None:
    """Remove the run directories in ``base`` of this user whose process is gone."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        match = _RUN_DIR_NAME.fullmatch(name)
        path = os.path.join(base, name)
        try:
            if match is None or os.stat(path).st_uid != os.getuid() or process_alive(int(match.group(1))):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


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
