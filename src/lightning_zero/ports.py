"""A free TCP port on this machine for a local rendezvous (``MASTER_PORT``).

One function for every place that starts ranks on one machine: the planner's calibration
(``planner/measure.py``), the benchmark harness (``benchmarks/_harness.py``) and the tests
(``tests/distributed.py``). The port is free when asked; a process that binds it between this
call and the rendezvous makes the rendezvous fail, which callers report as a failed launch.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that no socket on 127.0.0.1 holds right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
