"""tests.ports.free_port: below the kernel's ephemeral range, and free."""

import socket

import tests.ports as ports
from tests.ports import _ephemeral_low, free_port


def test_free_port_is_below_the_ephemeral_range_and_bindable():
    low = _ephemeral_low()
    ports = {free_port() for _ in range(5)}
    assert all(1024 <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # system-random: parallel test workers do not all draw the same port
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))


def test_a_listening_port_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", free_port()))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_SPAN", 1)
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1)
        try:
            ports.free_port()
        except RuntimeError as e:
            assert str(taken) in str(e)
        else:
            raise AssertionError("free_port returned the one port in its range, which is taken")
