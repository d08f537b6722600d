"""The client frontend's heartbeat expiry on a real ROUTER socket: silence is counted up to the last time the
socket was read to empty, so a loop running behind (an overloaded host) never expires clients whose pings wait
unread, and a client that really went quiet is still expired."""

from __future__ import annotations

import time

import zmq

from ipc.protocol import HEARTBEAT_MISSES, Ping, encode
from scheduler_proc.frontend import Frontend


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
