"""The client frontend: one ROUTER socket, the clients that said Hello, sends that never block.

* Binding comes first (before the model loads), so a busy port, a bad address
  or a live server on the same ipc path is one clear line at once.  A socket
  file that nobody listens on (left by a killed server) is replaced.
* Reads are bounded: at most ``CLIENT_FRAMES_PER_ITERATION`` frames per loop
  iteration, so a flood from one client delays planning and streaming by one
  batch at most (the ROUTER already fair-queues between peers).
* Sends never block and never grow memory without bound: the ROUTER has a
  send high-water mark per client and ``ROUTER_MANDATORY``, so a full pipe
  raises (the client stopped reading: *slow*) and so does a vanished peer
  (*gone*) instead of libzmq dropping the message silently.  The server aborts
  those clients' requests; a slow one is owed an error, sent once it reads again.
* Clients whose Hello set ``heartbeat_s`` are expired after
  ``HEARTBEAT_MISSES`` silent intervals, counted up to the last time the socket
  was read empty: a loop running behind (an overloaded host) has not read what
  its clients sent, which is not their silence.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time
from collections import deque
from typing import Optional

import zmq

from ipc.protocol import HEARTBEAT_MISSES, encode
from ipc.sockets import check_address, configure, ipv6_for

CLIENT_FRAMES_PER_ITERATION = 64
OWED_TTL_S = 60.0  # an error owed to a client that never reads again is dropped after this


class StartupError(Exception):
    """The server cannot start; the message is one line for the operator."""


class ClientState:
    __slots__ = ("heartbeat_s", "last_seen", "batch_deltas", "admin", "tokenizer_sent")

    def __init__(self, heartbeat_s: float, last_seen: float, batch_deltas: bool, admin: bool):
        self.heartbeat_s = heartbeat_s
        self.last_seen = last_seen
        self.batch_deltas = batch_deltas
        self.admin = admin  # may send admin messages (the server has no API key, or this client gave it)
        self.tokenizer_sent = False  # the tokenizer files (megabytes) go once per connection, never queued twice


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def tcp_host(address: str) -> Optional[str]:
    """The host of a ``tcp://HOST:PORT`` address (None for other addresses)."""
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://"):].rpartition(":")[0]


def is_remote(address: str) -> bool:
    """Whether clients on other machines can reach ``address`` (a tcp:// address not on loopback)."""
    host = tcp_host(address)
    return host is not None and host not in LOOPBACK_HOSTS and not host.startswith("127.")


def bind_frontend(ctx: zmq.Context, address: str, cfg, max_msg_bytes: int) -> "Frontend":
    """The client socket of a server or a data-parallel router (``cfg``: its ServerConfig), bound before any model
    loads so that address errors show at once; a reachable address without an API key is refused (StartupError)."""
    host = tcp_host(address)
    if host and host != "*" and not _resolves(host.strip("[]")):  # before it is called reachable: it is nowhere
        raise StartupError(f"cannot listen on {address}: {host!r} is neither an address, a host name that resolves "
                           f"nor a network interface of this machine")
    if is_remote(address) and not cfg.api_key and not cfg.allow_unauthenticated:
        raise StartupError(f"{address} is reachable from other machines and no API key is set: anyone could send "
                           "requests; set --api-key-file (or FORERUN_API_KEY), or pass --allow-unauthenticated")
    return Frontend(ctx, address, send_hwm=cfg.client_send_hwm, max_msg_bytes=max_msg_bytes)


def _resolves(host: str) -> bool:
    """Whether ZeroMQ can bind to ``host``: an address, a name DNS resolves, or an interface's name (eth0)."""
    import socket

    try:
        socket.getaddrinfo(host, None)
        return True
    except (socket.gaierror, UnicodeError):
        return host in {name for _, name in socket.if_nameindex()}


def claim_ipc_path(path: str) -> int:
    """Claim an ipc:// socket path for this server's life: lock ``PATH.lock`` (the descriptor returned; two servers
    started at once on one path both passed the check below before either bound, and ZeroMQ's bind replaces the
    file), then refuse a path a live server listens on and remove a stale socket file (connection refused)."""
    lock = _locked(path + ".lock", path)
    try:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return lock
        if not stat.S_ISSOCK(mode):
            raise StartupError(f"{path} exists and is not a socket; choose another --address")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nobody listens: a killed server's leftover
            return lock
        finally:
            probe.close()
        raise StartupError(f"another server is already serving at ipc://{path}; stop it or choose another --address")
    except BaseException:
        _release(lock, path + ".lock")
        raise


def _release(lock: int, lock_path: str) -> None:
    """Remove the lock file while still holding it (a server that opened it meanwhile finds it gone: _locked), then
    let it go."""
    try:
        os.unlink(lock_path)
    except FileNotFoundError:
        pass
    os.close(lock)


def _locked(lock_path: str, path: str) -> int:
    """A descriptor of ``lock_path`` holding its exclusive lock; StartupError while another server holds it.  A lock
    file its holder removed while this one opened it is opened again (the inode the path names is the one locked)."""
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            reason = "no such directory" if e.errno == errno.ENOENT else e.strerror
            raise StartupError(f"cannot listen on ipc://{path}: {reason}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StartupError(f"another server is already serving (or starting) at ipc://{path}; stop it or "
                               f"choose another --address") from None
        try:
            if os.fstat(fd).st_ino == os.stat(lock_path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


class Frontend:
    """The ROUTER that clients connect to, with who they are and what is owed to them."""

    def __init__(self, ctx: zmq.Context, address: str, *, send_hwm: int, max_msg_bytes: int):
        self.address = address
        # Any tcp:// address (loopback too: every local user can connect) needs the API key at Hello when the
        # server has one; an ipc:// socket lives in a private (0700) run directory.
        self.tcp = address.startswith("tcp://")
        self.clients: dict[bytes, ClientState] = {}
        self.batch_clients: set[bytes] = set()  # clients that read TokenDeltas
        self.slow: set[bytes] = set()  # a send found their pipe full since the last take_dropped()
        self.gone: set[bytes] = set()  # a send found no connection since the last take_dropped()
        self.owed: dict[bytes, deque[tuple[float, bytes]]] = {}
        self.read_all_at = time.monotonic()  # when the socket was last read to empty (recv_batch)
        self.ipc_path: Optional[str] = None
        self._ipc_lock: Optional[int] = None  # claim_ipc_path's lock, held while the socket file is ours
        try:
            check_address(address)
            if address.startswith("ipc://"):
                self._ipc_lock = claim_ipc_path(address[len("ipc://"):])
            sock = ipv6_for(configure(ctx.socket(zmq.ROUTER), max_msg_bytes=max_msg_bytes, hwm=send_hwm), address)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or vanished peer raises, never a silent drop
            try:
                sock.bind(address)
            except zmq.ZMQError as e:
                sock.close(linger=0)
                raise StartupError(f"cannot listen on {address}: {_bind_error(e)}") from None
        except (ValueError, StartupError) as e:
            self._release_ipc_lock()
            raise StartupError(str(e)) from None
        self.sock = sock
        if address.startswith("ipc://"):
            self.ipc_path = address[len("ipc://"):]
        # A plain view for the hot path: an asyncio send costs a Future per message.
        self.now = zmq.Socket.shadow(sock.underlying)

    # ----------------------------------------------------------------- input

    def recv_batch(self) -> list[list[bytes]]:
        """At most CLIENT_FRAMES_PER_ITERATION waiting messages, without blocking."""
        out = []
        recv = self.now.recv_multipart
        for _ in range(CLIENT_FRAMES_PER_ITERATION):
            try:
                out.append(recv(zmq.NOBLOCK))
            except zmq.Again:
                self.read_all_at = time.monotonic()  # every message sent before now is read
                break
        return out

    def has_input(self) -> bool:
        """A client message is waiting (also re-arms ZeroMQ's edge-triggered descriptor after plain sends)."""
        return bool(self.now.get(zmq.EVENTS) & zmq.POLLIN)

    # ---------------------------------------------------------------- output

    def send(self, client: bytes, msg) -> bool:
        return self.send_data(client, encode(msg))

    def send_data(self, client: bytes, data: bytes) -> bool:
        """Send one message; False (and the client noted as slow or gone) when it cannot leave now."""
        try:
            self.now.send(client, zmq.SNDMORE | zmq.NOBLOCK)
        except zmq.Again:
            self.slow.add(client)
            return False
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self.gone.add(client)
            return False
        self.now.send(data, zmq.NOBLOCK)  # the second frame follows the first once the first is accepted
        return True

    def take_dropped(self) -> tuple[set[bytes], set[bytes]]:
        """(slow, gone) clients since the last call; gone clients are forgotten."""
        slow, gone = self.slow - self.gone, self.gone
        self.slow, self.gone = set(), set()
        for client in gone:
            self.forget(client)
            self.owed.pop(client, None)
        return slow, gone

    def owe(self, client: bytes, msg) -> None:
        """Queue a message for a client whose pipe is full; ``flush_owed`` retries it."""
        self.owed.setdefault(client, deque()).append((time.monotonic() + OWED_TTL_S, encode(msg)))

    def flush_owed(self) -> None:
        now = time.monotonic()
        for client in list(self.owed):
            queue = self.owed[client]
            while queue and (queue[0][0] < now or self.send_data(client, queue[0][1])):
                queue.popleft()
            if not queue:
                del self.owed[client]
        self.slow.clear()  # a retry that found the pipe still full is not news
        for client in self.gone:
            self.owed.pop(client, None)

    # --------------------------------------------------------------- clients

    def hello(self, client: bytes, heartbeat_s: float, batch_deltas: bool, admin: bool = True) -> None:
        self.clients[client] = ClientState(heartbeat_s, time.monotonic(), batch_deltas, admin)
        if batch_deltas:
            self.batch_clients.add(client)
        else:
            self.batch_clients.discard(client)

    def forget(self, client: bytes) -> None:
        self.clients.pop(client, None)
        self.batch_clients.discard(client)

    def expired(self, now: float) -> list[bytes]:
        """Heartbeating clients silent for HEARTBEAT_MISSES intervals up to the socket's last read to empty (not
        ``now``: what waits unread says nothing of its senders): forgotten and returned."""
        heard_until = min(now, self.read_all_at)
        dead = [c for c, st in self.clients.items()
                if st.heartbeat_s > 0 and heard_until - st.last_seen > HEARTBEAT_MISSES * st.heartbeat_s]
        for client in dead:
            self.forget(client)
        return dead

    def close(self, linger_ms: int = 1000) -> None:
        """Close (replies already queued get ``linger_ms`` to leave) and remove the socket file and its lock."""
        self.sock.close(linger=linger_ms)
        if self.ipc_path is not None:
            try:
                os.unlink(self.ipc_path)
            except FileNotFoundError:
                pass
        self._release_ipc_lock()

    def _release_ipc_lock(self) -> None:
        if self._ipc_lock is not None:
            _release(self._ipc_lock, self.address[len("ipc://"):] + ".lock")
            self._ipc_lock = None


def _bind_error(e: zmq.ZMQError) -> str:
    if e.errno == errno.EADDRINUSE:
        return "the address is in use (another server?)"
    if e.errno == errno.ENOENT:
        return "no such directory"
    return str(e)
