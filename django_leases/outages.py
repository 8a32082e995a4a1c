"""Tell a database outage, which is waited out, from a configuration error, which is reported.

A worker, the watcher and `prune_jobs` wait out a database that is down, restarting, cut off or
read-only after a failover (`is_outage()`): it comes back by itself. A login the server refuses,
a database or a connection option it does not know, or tables that were never migrated do not:
retrying them forever only hides the cause. `misconfiguration()` is the one place that tells
them apart, by the driver's error codes (MariaDB/MySQL's numbers, PostgreSQL's SQLSTATE) and,
where a driver has none, by the server's message: libpq reports no SQLSTATE for an error during
the connection handshake (a failed login, an unknown database or startup parameter), so those
are read from PostgreSQL's and PgBouncer's English messages. Anything not recognised counts as
an outage, as before: a server whose `lc_messages` is not English gets its connection errors
waited out. `Outages` is the back-off every worker thread shares while the database is away.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connections,
)

from django_leases.backoff import reconnect_delay
from django_leases.dialects import dialect_of
from django_leases.dialects.statements import MIGRATE
from django_leases.exceptions import DatabaseMisconfigured
from django_leases.redaction import error_text

logger = logging.getLogger("django_leases.worker")

OUTAGES = (OperationalError, InterfaceError)
"""The errors of a database that is down or cut off; waited out unless `misconfiguration()`
recognises them."""


def one_line(text: str) -> str:
    """Return `text` (a driver's message, often several lines) on one line."""
    return " ".join(text.split())


def is_outage(exc: BaseException, alias: str) -> bool:
    """Whether `exc`, raised by database `alias`, says it is away for now: down or cut off
    (`OUTAGES`), or taking no writes (a standby after a failover: `Dialect.read_only()`, which
    Django raises as an `InternalError` on PostgreSQL)."""
    return isinstance(exc, OUTAGES) or dialect_of(connections[alias]).read_only(exc)


MYSQL_TEXT = re.compile(r"""^\((\d+), ["'](.*)["']\)$""")
FIX = {
    "NAME": "['NAME'] (does that database exist on the server?)",
    "USER": "['USER'] (and that role's login and privileges on the server)",
    "PASSWORD": "['USER'] and ['PASSWORD']",
    "OPTIONS": "['OPTIONS']",
}


def misconfiguration(exc: BaseException, alias: str) -> str | None:
    """Return one line naming what to fix if `exc`, raised by database `alias`, is a
    configuration error (the settings, or tables not migrated); None for anything else."""
    text = " ".join(str(exc).split())
    connection = connections[alias]
    # A statement that fails while connecting is the project's (MariaDB/MySQL's init_command).
    what = dialect_of(connection).misconfiguration(
        exc, text, connecting=connection.connection is None
    )
    if what is None:
        return None
    detail = " ".join(error_text(exc).split())
    # PostgreSQL's handshake errors say where they connected to before the server's words;
    # mysqlclient's are the repr of (number, message).
    detail = detail.split("FATAL:", 1)[-1].strip()
    detail = MYSQL_TEXT.sub(r"\2 (error \1)", detail)
    if what == MIGRATE:
        return (
            f"database {alias!r} is not migrated ({detail}): run "
            f'"manage.py migrate --database {alias}"'
        )
    return f"database {alias!r} refused the connection settings ({detail}): fix DATABASES" + (
        f"[{alias!r}]{FIX[what]}"
    )


def outage_or_raise(exc: DatabaseError, alias: str) -> None:
    """Return if `exc` is an outage to wait out; raise `DatabaseMisconfigured` for a
    configuration error, and `exc` itself for anything else."""
    message = misconfiguration(exc, alias)
    if message is not None:
        raise DatabaseMisconfigured(message) from None
    if not is_outage(exc, alias):
        raise exc


def check_tables(alias: str, models: Iterable[type[Any]]) -> None:
    """Raise `DatabaseMisconfigured` if database `alias` lacks a table of `models`, or refuses
    the connection settings; an outage raises Django's `OperationalError`."""
    connection = connections[alias]
    try:
        with connection.cursor() as cursor:
            tables = set(connection.introspection.table_names(cursor))
    except DatabaseError as exc:
        outage_or_raise(exc, alias)
        raise
    missing = [m._meta.db_table for m in models if m._meta.db_table not in tables]
    if missing:
        raise DatabaseMisconfigured(
            f"database {alias!r} is not migrated (no table {', '.join(missing)}): run "
            f'"manage.py migrate --database {alias}"'
        )


OUTAGE_BACKOFF_MAX = 5.0
"""The longest wait (seconds) between two tries of a database that is away: an outcome must
still land while its lease may be live."""
STILL_DOWN_EVERY = 60.0
"""Seconds between two "still unavailable" lines of one outage."""


class Counts(Protocol):
    """Where `Outages` counts each failed try (a worker's `WorkerStats`)."""

    def add(self, name: str, count: int = 1, *, kind: str | None = None) -> None: ...


class Outages:
    """Log a database outage once, drop the broken connection and back off: exponentially,
    with jitter, up to `OUTAGE_BACKOFF_MAX` seconds; "still unavailable" once a minute
    (`STILL_DOWN_EVERY`), each retry at DEBUG, and the end of the outage once."""

    def __init__(
        self, stats: Counts, using: str, poll_interval: float, stopping: threading.Event
    ) -> None:
        self.stats = stats
        self.using = using
        self.poll_interval = poll_interval
        self.stopping = stopping
        self._lock = threading.Lock()
        self._since: float | None = None
        """Monotonic time of the first failure of the current outage; None: no outage."""
        self._failures = 0
        self._next_report = 0.0

    def away(self, exc: BaseException) -> bool:
        """Whether `exc` says the database is away, not that it refused the statement: it
        takes no writes now (`outages.is_outage()`), or the connection no longer answers."""
        if not is_outage(exc, self.using):
            return False
        return not isinstance(exc, OUTAGES) or not connections[self.using].is_usable()

    def pause(self, what: str, exc: Exception, *, wait: threading.Event | None = None) -> None:
        """Back off unless `wait` (default: the stop request) is set first."""
        self.stats.add("outages")
        now = time.monotonic()
        with self._lock:
            first = self._since is None
            if self._since is None:
                self._since = now
                self._next_report = now + STILL_DOWN_EVERY
            report = not first and now >= self._next_report
            if report:
                self._next_report = now + STILL_DOWN_EVERY
            self._failures += 1
            since, failures = self._since, self._failures
        pause = reconnect_delay(
            failures, min(self.poll_interval, OUTAGE_BACKOFF_MAX), OUTAGE_BACKOFF_MAX
        )
        if first:
            logger.warning(
                "database unavailable during %s: %s; retrying", what, one_line(error_text(exc))
            )
        elif report:
            logger.warning(
                "database still unavailable after %.0fs (%s failed: %s); retrying every %.0fs "
                "at most",
                now - since,
                what,
                one_line(error_text(exc)),
                OUTAGE_BACKOFF_MAX,
            )
        else:
            logger.debug(
                "database unavailable during %s: %s; retrying in %.2fs",
                what,
                one_line(error_text(exc)),
                pause,
            )
        close_old_connections()
        connections[self.using].close()
        (wait or self.stopping).wait(timeout=pause)

    def over(self) -> None:
        """Note that a database call succeeded: log the end of an outage, if one was on."""
        if self._since is None:  # the common case, read without the lock
            return
        with self._lock:
            since, self._since, self._failures = self._since, None, 0
        if since is not None:
            logger.warning("database available again after %.1fs", time.monotonic() - since)
