"""tests.ports.free_port: below the kernel's ephemeral range, and free."""

import socket

import pytest

from tests import ports


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low = ports._ephemeral_low()
    drawn = {ports.free_port() for _ in range(5)}
    assert all(1024 <= p < low for p in drawn), (drawn, low)
    assert len(drawn) > 1  # system-random: parallel test workers do not all draw the same port
    with socket.socket() as s:
        s.bind(("127.0.0.1", drawn.pop()))


def test_a_listening_port_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_SPAN", 1)  # the range holds only the taken port
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1)
        with pytest.raises(RuntimeError, match=str(taken)):
            ports.free_port()
