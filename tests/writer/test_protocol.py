"""The parent/worker protocol: strict frames, and a dead peer always reads as ChannelClosed."""

from __future__ import annotations

import os
import socket

import pytest

from ckptstore.writer import protocol as P


def test_round_trip_and_unknown_kind_refused():
    a, b = socket.socketpair()
    with a, b:
        P.send(a.fileno(), P.Progress(cut="step-000000000001-abcdef01", bytes_done=5))
        msg = P.recv(b.fileno(), timeout=5)
        assert isinstance(msg, P.Progress) and msg.bytes_done == 5
        a.sendall(len(b'{"kind": "rm -rf"}').to_bytes(4, "little") + b'{"kind": "rm -rf"}')
        with pytest.raises(ValueError):
            P.recv(b.fileno(), timeout=5)


def test_peer_that_died_with_unread_bytes_is_channel_closed_not_a_crash():
    """A peer closing with our bytes unread makes the next read fail with ECONNRESET (seen when a
    trainer SIGKILLed its writer mid-cut, in the soak): that must read as a closed channel."""
    a, b = socket.socketpair()
    P.send(b.fileno(), P.Shutdown())  # lands in a's receive buffer, never read
    a.close()
    with b, pytest.raises(P.ChannelClosed):
        P.recv(b.fileno(), timeout=5)
    c, d = socket.socketpair()
    c.close()
    with d, pytest.raises(P.ChannelClosed):
        P.send(d.fileno(), P.Shutdown())


def test_descriptor_passing():
    a, b = socket.socketpair()
    r, w = os.pipe()
    with a, b:
        P.send_fd(a.fileno(), w)
        got = P.recv_fd(b.fileno())
        os.write(got, b"x")
        assert os.read(r, 1) == b"x"
        for fd in (r, w, got):
            os.close(fd)
