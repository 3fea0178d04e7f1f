"""``gefen_titan.distributed.free_port``: the rendezvous port of ranks started on this host (the
validation's launches, the suite's rank harnesses, a single-process ``gefen_titan.train``)."""

import socket

import gefen_titan.distributed as gd


def test_the_port_is_free_and_below_the_ephemeral_range():
    # A port of the ephemeral range can be handed to any outgoing connection between the pick and the
    # store's listen (a fault-tolerance group's start once failed so, EADDRINUSE): none is picked there.
    low = gd._ephemeral_low()
    for _ in range(50):
        port = gd.free_port()
        assert 10_000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free now


def test_a_taken_port_is_not_picked(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(gd, "_ephemeral_low", lambda: port + 1)
        picks = iter([port, port - 1])
        monkeypatch.setattr(gd.random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        assert gd.free_port() == port - 1


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(gd, "_ephemeral_low", lambda: 5_000)
    with socket.socket() as s:
        s.bind(("127.0.0.1", gd.free_port()))
