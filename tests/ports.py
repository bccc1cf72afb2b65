"""A free TCP port for a server or torchrun master that a test starts and that binds it seconds later.

A port from `bind(0)` lies in the kernel's ephemeral range, so in the seconds before the server binds it (a vLLM
boot is most of a minute on the CI machine) any other process's outgoing connection or `bind(0)` can take it: CI
once failed on exactly that (EADDRINUSE in tests/rl/test_eval.py). A port below that range is never handed out by the
kernel on its own, so only another explicit choice like this one can collide with it.
"""

import random
import socket
from pathlib import Path

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_SPAN = 10_000  # how far below the ephemeral range to draw from


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port below the ephemeral range that nothing listens on now (system-random, so parallel workers differ)."""
    high = _ephemeral_low()
    low = max(1024, high - _SPAN)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high}) on {host}")
