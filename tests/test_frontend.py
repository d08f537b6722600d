"""The client frontend's heartbeat expiry on a real ROUTER socket: silence is counted up to the last time the
socket was read to empty, so a loop running behind (an overloaded host) never expires clients whose pings wait
unread, and a client that really went quiet is still expired."""

from __future__ import annotations

import os
import time

import pytest
import zmq

from ipc.protocol import HEARTBEAT_MISSES, Ping, encode
from scheduler_proc.frontend import Frontend, StartupError, claim_ipc_path


def test_unread_pings_are_not_silence(tmp_path):
    ctx = zmq.Context()
    front = Frontend(ctx, f"ipc://{tmp_path}/f.sock", send_hwm=100, max_msg_bytes=1 << 20)
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.IDENTITY, b"c1")
    client.connect(front.address)
    try:
        hb = 0.05
        client.send(encode(Ping()))
        deadline = time.monotonic() + 5
        while not front.has_input() and time.monotonic() < deadline:  # arrived (a loaded host may take a while)
            time.sleep(0.01)
        assert front.recv_batch() and front.recv_batch() == []  # read to empty
        front.hello(b"c1", hb, batch_deltas=False)
        time.sleep(HEARTBEAT_MISSES * hb + 0.05)
        client.send(encode(Ping()))  # sent in time, but the loop is behind: not read yet
        deadline = time.monotonic() + 5
        while not front.has_input() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert front.expired(time.monotonic()) == []  # its silence counts only up to the last read
        frames = front.recv_batch()  # the loop catches up: the ping is read (the server then updates last_seen)
        assert frames and frames[0][0] == b"c1"
        front.clients[b"c1"].last_seen = time.monotonic()
        assert front.expired(time.monotonic()) == []
        time.sleep(HEARTBEAT_MISSES * hb + 0.05)  # now really silent, and the socket read to empty since
        assert front.recv_batch() == []
        assert front.expired(time.monotonic()) == [b"c1"] and b"c1" not in front.clients
    finally:
        client.close(linger=0)
        front.close(linger_ms=0)
        ctx.term()


def test_listens_on_an_ipv6_address():
    """A ``tcp://[...]`` address serves (ZeroMQ's sockets are IPv4-only unless IPv6 is switched on), and the SDK's
    sockets (ipc.sockets.make_socket) connect to it."""
    import socket

    import pytest

    from ipc.sockets import make_socket

    try:  # a host without IPv6 loopback cannot take the test
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    ctx = zmq.Context()
    front = Frontend(ctx, f"tcp://[::1]:{port}", send_hwm=100, max_msg_bytes=1 << 20)
    client = make_socket(ctx, zmq.DEALER, front.address, bind=False)
    try:
        client.send(encode(Ping()))
        deadline = time.monotonic() + 5
        while not front.has_input() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(front.recv_batch()) == 1
    finally:
        client.close(linger=0)
        front.close(linger_ms=0)
        ctx.term()


def test_one_ipc_path_takes_one_server_even_when_two_start_at_once(tmp_path):
    """Two servers that check an ipc:// path before either binds (started at the same moment) both found it free,
    and ZeroMQ's bind replaced the first one's socket file: both served, one unreachable, and stopping it removed the
    other's file.  The claim is a lock held from the check to the server's end: the second is refused, with or
    without a bound socket yet; once the first stops (its socket and lock files gone) the path is free again."""
    path = str(tmp_path / "s.sock")
    first = claim_ipc_path(path)  # checked, not yet bound: the window two servers raced through
    with pytest.raises(StartupError, match="another server is already serving \\(or starting\\) at ipc://"):
        claim_ipc_path(path)
    os.close(first)
    ctx = zmq.Context()
    front = Frontend(ctx, f"ipc://{path}", send_hwm=100, max_msg_bytes=1 << 20)
    with pytest.raises(StartupError, match="already serving"):
        Frontend(ctx, f"ipc://{path}", send_hwm=100, max_msg_bytes=1 << 20)
    assert os.path.exists(path)  # the refused one left the first one's socket file alone
    front.close(linger_ms=0)
    assert sorted(os.listdir(tmp_path)) == []
    Frontend(ctx, f"ipc://{path}", send_hwm=100, max_msg_bytes=1 << 20).close(linger_ms=0)
    ctx.term()
