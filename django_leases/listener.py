"""LISTEN/NOTIFY wake-ups on PostgreSQL: an idle worker starts an enqueued job at once.

Polling stays the fallback: on other databases, with USE_NOTIFY off, and whenever the listening
connection is down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from django.db import connections

from django_leases.backoff import reconnect_delay
from django_leases.dialects import dialect_of
from django_leases.network import CLIENT_SLACK, network_timeout, watchdog
from django_leases.outages import one_line
from django_leases.querysets.notices import notifies, notify_channel
from django_leases.redaction import error_text

logger = logging.getLogger("django_leases.worker")

# Reconnects of a failed listening connection: the first after RETRY_FIRST seconds, each later
# one after twice as long, up to RETRY_MAX (jittered). The worker polls meanwhile, so a slow
# return costs wake-up latency only, and a long outage costs few connection attempts.
RETRY_FIRST = 0.5
RETRY_MAX = 30.0
STILL_DOWN_EVERY = 300.0
"""Seconds between two "still failing" lines of one outage of the listening connection."""


class Wakeups(Protocol):
    """What wakes an idle worker loop: its own `Listener`, or its supervisor's
    (`supervisor.Link`)."""

    def waiting(self) -> AbstractContextManager[None]:
        """Say that the loop waits for work while the block runs."""

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a wake-up; return whether one came."""

    def close(self) -> None: ...


class Listener:
    """A dedicated connection that LISTENs on the enqueue channel of one table (the dialect's,
    `Dialect.listening()`), connected again after a failure with a growing delay.

    Every wait on it is bounded: the connection by the `connect_timeout` of its (hardened)
    parameters, the LISTEN by the watchdog (`watchdog_guard()`), the wait for a notification
    by its own timeout. A path that swallows packets (a proxy or a firewall that still
    acknowledges them) would otherwise keep the worker's loop waiting for a reply forever.
    """

    def __init__(self, listening: Any) -> None:
        self._listening = listening
        self._failures = 0
        self._failing_since = 0.0
        self._retry_at = 0.0
        self._next_report = 0.0

    @classmethod
    def for_model(cls, model: type[Any], using: str, ttl: float | None = None) -> Listener | None:
        """Return a listener for `model`'s table, or None where NOTIFY is not available; its
        LISTEN is bounded by the network timeout for leases of `ttl` seconds."""
        connection = connections[using]
        if not notifies(connection):
            return None
        timeout = network_timeout(ttl)
        guard = watchdog_guard(None if timeout is None else timeout + CLIENT_SLACK)
        params = connection.get_connection_params()
        return cls(dialect_of(connection).listening(params, notify_channel(model), guard))

    def waiting(self) -> AbstractContextManager[None]:
        return nullcontext()  # the notifications come whether or not the loop waits

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for an enqueue notification; return whether one came."""
        listening = self._listening
        if not listening.connected and time.monotonic() < self._retry_at:
            time.sleep(min(timeout, self._retry_at - time.monotonic()))
            return False
        try:
            if not listening.connected:
                listening.connect()
                self._back()
            return bool(listening.wait(timeout))
        except listening.error as exc:
            self.close()
            self._failed(exc)
            time.sleep(min(timeout, max(0.0, self._retry_at - time.monotonic())))
        return False

    def _failed(self, exc: Exception) -> None:
        """Log a failure of the listening connection (the first of an outage, then "still
        failing" every `STILL_DOWN_EVERY` seconds) and set the time of the next try."""
        now = time.monotonic()
        self._failures += 1
        if self._failures == 1:
            self._failing_since = self._next_report = now
            self._next_report += STILL_DOWN_EVERY
            logger.warning(
                "LISTEN connection failed (%s); polling until it is back",
                one_line(error_text(exc)),
            )
        elif now >= self._next_report:
            self._next_report = now + STILL_DOWN_EVERY
            logger.warning(
                "LISTEN connection still failing after %.0fs (%s); polling meanwhile",
                now - self._failing_since,
                one_line(error_text(exc)),
            )
        delay = reconnect_delay(self._failures, RETRY_FIRST, RETRY_MAX)
        logger.debug("LISTEN connection failed; next try in %.2fs", delay)
        self._retry_at = now + delay

    def _back(self) -> None:
        """Note that the listening connection is up; log the end of an outage of it."""
        if self._failures:
            logger.warning(
                "LISTEN connection back after %.1fs", time.monotonic() - self._failing_since
            )
        self._failures = 0

    def close(self) -> None:
        self._listening.close()


def watchdog_guard(deadline: float | None) -> Callable[[int], AbstractContextManager[Any]]:
    """What bounds a call on a socket by the watchdog: it shuts the socket down `deadline`
    seconds after the call began (None: unbounded)."""
    if deadline is None:
        return lambda fd: nullcontext()
    return lambda fd: watchdog.guard(fd, deadline)
