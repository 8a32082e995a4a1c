"""Loopback ports for the servers the tests and benchmarks start (PgBouncer, a PostgreSQL
cluster, a proxy's target)."""

import socket


def free_port() -> int:
    """Return a loopback TCP port nothing listens on (the kernel's pick, released at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
