"""Network timeouts on the worker's and the watcher's database connections, the watchdog that
enforces them, and the worker's keeping of its connections (`keep_usable()`).

A partition that drops packets without a reset leaves a database call waiting forever for an
answer that never comes: the thread that made it can neither renew nor give up its leases, and
after the path is back it still waits. `harden()` bounds every such wait on one thread's
connection by `DJANGO_LEASES["NETWORK_TIMEOUT"]`:

- at the TCP level (PostgreSQL: connect timeout, keepalives, `tcp_user_timeout`; MariaDB/MySQL:
  connect, read and write timeouts), which catches a path that dies between us and the server;
- on the server, a `statement_timeout` (PostgreSQL: `dialects.postgresql.StatementTimeout`), so
  a statement stuck on a live server ends with a clean error;
- on the client, a watchdog that shuts the socket of a call (a statement, a commit, a health
  check) still unanswered a second after the timeout. TCP options cannot see a path that dies
  beyond the first hop (a proxy or a NAT still acknowledges our packets), and a blocked socket
  read cannot be interrupted from Python; shutting the socket down ends it at once with an
  `OperationalError`, and Django reconnects on next use.

Only the connections of the threads that call `harden()` change: a project's web requests keep
their settings. Values the project sets in a database's `OPTIONS` win over these.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import DatabaseError, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from django_leases.conf import leases_settings
from django_leases.dialects import dialect_of, named
from django_leases.limits import DAY

# NETWORK_TIMEOUT = "auto": a third of the TTL, within these bounds (seconds). A third leaves
# a blocked heartbeat time to fail and one more to be retried before the lease runs out.
AUTO = "auto"
AUTO_RANGE = (2.0, 30.0)
# Bounds of an explicit NETWORK_TIMEOUT: the drivers take whole seconds, and a day is far past
# any TTL that makes sense.
TIMEOUT_RANGE = (1.0, float(DAY))
# The watchdog waits this much longer than the server's statement_timeout, so that a slow
# statement on a live server ends with the server's own error, not a cut connection.
CLIENT_SLACK = 1.0


def network_timeout(ttl: float | None = None) -> float | None:
    """Return the network timeout in seconds for leases of `ttl` seconds, or None if it is off.

    `ttl` defaults to `DJANGO_LEASES["TTL"]`; it matters only for the "auto" setting.
    """
    value = leases_settings.NETWORK_TIMEOUT
    if value is None:
        return None
    if value == AUTO:
        return auto_timeout(float(ttl if ttl is not None else leases_settings.TTL))
    return float(value)


def auto_timeout(ttl: float) -> float:
    """Return the network timeout of NETWORK_TIMEOUT = "auto" for leases of `ttl` seconds."""
    low, high = AUTO_RANGE
    return min(max(ttl / 3, low), high)


def hardened_options(vendor: str, timeout: float) -> dict[str, Any]:
    """Return the connection `OPTIONS` that bound every wait on a `vendor` connection by
    `timeout` seconds (nothing for SQLite, which has no network): `Dialect.network_options()`."""
    return named(vendor).network_options(timeout)


def merged_options(vendor: str, timeout: float, user: dict[str, Any]) -> dict[str, Any]:
    """Return `user` (a database's `OPTIONS`) completed with the hardened options it lacks."""
    return {**hardened_options(vendor, timeout), **user}


def statement_timeout(vendor: str, timeout: float, user: dict[str, Any]) -> int | None:
    """Return the `statement_timeout` (ms) that bounds each transaction on a `vendor` connection
    of `OPTIONS` `user` for a network timeout of `timeout` seconds; None on other databases, or
    where the project's own `options` set one (theirs wins): `Dialect.statement_timeout()`."""
    return named(vendor).statement_timeout(timeout, user)


class Watchdog:
    """Shut down the socket of a database call that overran its deadline.

    One daemon thread per process serves every guarded call. A call's socket is shut down under
    the same lock its guard is removed under, so a socket is never touched after its call ended.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls: dict[int, tuple[float, int]] = {}
        self._wakes_at = math.inf
        """When the thread looks at the calls next (under the lock); a call whose deadline is
        later needs no wake-up, and most are: every call gets the same network timeout."""
        self._next_key = 0
        self._thread: threading.Thread | None = None
        self.fired = 0

    @contextmanager
    def guard(self, fd: int, seconds: float) -> Iterator[None]:
        """Shut down socket `fd` if the block is still running after `seconds`."""
        with self._cond:
            self._next_key += 1
            key = self._next_key
            deadline = time.monotonic() + seconds
            self._calls[key] = (deadline, fd)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="django-leases-watchdog", daemon=True
                )
                self._thread.start()
            if deadline < self._wakes_at:
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._calls.pop(key, None)

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for key, (deadline, fd) in list(self._calls.items()):
                    if deadline <= now:
                        del self._calls[key]
                        self.fired += 1
                        shut_down(fd)
                self._wakes_at = min(
                    (deadline for deadline, _ in self._calls.values()), default=math.inf
                )
                self._cond.wait(
                    timeout=None if self._wakes_at == math.inf else self._wakes_at - now
                )


def shut_down(fd: int) -> None:
    """Shut down both directions of socket `fd`: a call blocked on it fails at once."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already disconnected
    finally:
        sock.close()  # closes our duplicate only; the driver still owns `fd`


watchdog = Watchdog()


class Deadline:
    """An execute wrapper (and commit/rollback guard) that bounds each call by the watchdog."""

    def __init__(self, connection: BaseDatabaseWrapper, seconds: float) -> None:
        self.connection = connection
        self.seconds = seconds
        # The driver's base error (psycopg.Error, MySQLdb.Error).
        self.driver_error: type[Exception] = connection.Database.Error  # type: ignore[attr-defined]

    def __call__(
        self,
        execute: Callable[..., Any],
        sql: str,
        params: Any,
        many: bool,
        context: dict[str, Any],
    ) -> Any:
        with self.guarded():
            return execute(sql, params, many, context)

    @contextmanager
    def guarded(self) -> Iterator[None]:
        try:
            fd = self.connection.connection.fileno()
        except (AttributeError, self.driver_error):
            # Not connected, or a connection the driver knows is lost: nothing can block on it.
            yield
            return
        with watchdog.guard(fd, self.seconds):
            yield

    def wrap(self, call: Callable[[], Any]) -> Callable[[], Any]:
        def guarded_call() -> Any:
            with self.guarded():
                return call()

        return guarded_call


UNWRAPPED_CALLS = ("_commit", "_rollback", "is_usable", "init_connection_state")
"""The methods of a connection that talk to the server without going through the execute
wrappers: COMMIT, ROLLBACK, the health check (CONN_HEALTH_CHECKS, and the worker's own after an
error) and the statements Django runs on every new connection. `harden()` guards them."""


def harden(connection: BaseDatabaseWrapper, ttl: float | None = None) -> None:
    """Bound every network wait of `connection` (this thread's) by the network timeout.

    Idempotent. An open connection outside a transaction is closed, so that the next use
    reconnects with the new options; inside a transaction they apply from the next connection.
    """
    # Cheapest first: a worker calls this once per job, and almost always finds it done.
    if any(isinstance(wrapper, Deadline) for wrapper in connection.execute_wrappers):
        return
    timeout = network_timeout(ttl)
    dialect = dialect_of(connection)
    if timeout is None or not dialect.network_options(timeout):
        return  # no network (SQLite)
    settings = connection.settings_dict
    user = dict(settings.get("OPTIONS") or {})
    # A copy: the dict is shared by every thread's connection to this alias.
    connection.settings_dict = {**settings, "OPTIONS": {**dialect.network_options(timeout), **user}}
    deadline = Deadline(connection, timeout + CLIENT_SLACK)
    connection.execute_wrappers.append(deadline)
    milliseconds = dialect.statement_timeout(timeout, user)
    if milliseconds is not None:
        dialect.bound_transactions(connection, milliseconds)
    for name in UNWRAPPED_CALLS:
        setattr(connection, name, deadline.wrap(getattr(connection, name)))
    if connection.connection is not None and not connection.in_atomic_block:
        connection.close()


def keep_usable(*, health_check: bool = False) -> None:
    """Close this thread's broken database connections and keep the others open.

    A worker thread is not a request cycle: Django's `close_old_connections()` would also close
    a connection past CONN_MAX_AGE, and with the default of 0 every job would reconnect. Here a
    connection is closed only if it cannot be trusted: an autocommit mode left changed, or an
    error since which it no longer answers. With `health_check`, a connection of an alias that
    sets CONN_HEALTH_CHECKS is checked again before its next use.
    """
    for conn in connections.all(initialized_only=True):
        if conn.connection is None or conn.in_atomic_block:
            continue
        if conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"]:
            discard(conn)
        elif conn.errors_occurred:
            if conn.is_usable():
                conn.errors_occurred = False
            else:
                discard(conn)
        elif health_check:
            conn.health_check_done = False  # type: ignore[attr-defined]


def discard(connection: BaseDatabaseWrapper) -> None:
    """Close `connection`; the next use reconnects. Closing a broken connection may fail too."""
    with contextlib.suppress(DatabaseError):
        connection.close()
