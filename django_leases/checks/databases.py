"""System checks that read the databases themselves (`manage.py check --database ALIAS`,
`migrate`) or their settings' session options: the clock lease times are compared with, the
vacuuming the claim's indexes need, SQLite's write lock, pending jobs no handler runs."""

import difflib
from collections.abc import Iterable
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.db import DatabaseError, connections

from django_leases.dialects import dialect_of, dialect_of_engine
from django_leases.handlers import registered_kinds
from django_leases.horizon import oldest_pin
from django_leases.limits import shown
from django_leases.tables import leased_jobs

# The names MariaDB/MySQL report for a UTC session zone (named zones need the zone tables).
UTC_ZONES = {"+00:00", "-00:00", "utc", "etc/utc", "gmt", "etc/gmt", "universal", "zulu"}


def database_clock_problems(alias: str) -> list[str]:
    """Return what is wrong with the clock of database `alias`'s session, one line each.

    Lease times are written and compared with the database's `NOW()`. On MariaDB/MySQL, `NOW()`
    is in the session's time zone while Django stores UTC: with any other zone every lease
    comparison is off by the offset (and a DST change looks like mass expiry). PostgreSQL's
    `now()` is a `timestamptz` and SQLite's is UTC, whatever the session says: nothing to check.
    """
    connection = connections[alias]
    clock = dialect_of(connection).session_clock
    if clock is None:
        return []
    with connection.cursor() as cursor:
        cursor.execute(clock)
        session_zone, system_zone, offset = cursor.fetchone()
    zone = system_zone if session_zone == "SYSTEM" else session_zone
    if offset == 0 and str(zone).lower() in UTC_ZONES:
        return []
    shown = f"SYSTEM ({system_zone})" if session_zone == "SYSTEM" else session_zone
    return [
        f"database {alias!r}: the session time zone is {shown!r} (NOW() is {offset:+d} s from "
        'UTC), not UTC; lease times would be off by that offset. Add "OPTIONS": '
        '{"init_command": "SET time_zone = \'+00:00\'"} to its DATABASES entry.'
    ]


def check_database_clock(
    app_configs: Any = None, databases: Iterable[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Report a MariaDB/MySQL session whose time zone is not UTC (`check --database ALIAS`)."""
    return [
        Error(
            problem,
            hint="django-leases compares lease times with the database's NOW(), which must be "
            "UTC like the times Django stores.",
            id="django_leases.E013",
        )
        for alias in databases or ()
        for problem in database_clock_problems(alias)
    ]


def autovacuum_problems(alias: str) -> list[str]:
    """Return what keeps database `alias` from vacuuming the job table, one line each.

    No update of a job row is HOT (each changes an indexed column), so every claim, heartbeat
    and completion leaves a dead entry in a partial index right where the next claim starts
    reading; only a vacuum removes it. Without autovacuum a claim reads further with every job
    processed since the last manual VACUUM (bench/README.md: about one index page per 95 jobs).
    """
    connection = connections[alias]
    autovacuum = dialect_of(connection).autovacuum
    if autovacuum is None:
        return []
    with connection.cursor() as cursor:
        cursor.execute(autovacuum)
        (running,) = cursor.fetchone()
    if running:
        return []
    return [
        f"database {alias!r}: autovacuum is off; claims slow down with every job processed "
        "until a VACUUM of the job table."
    ]


def check_autovacuum(
    app_configs: Any = None, databases: Iterable[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Warn about a PostgreSQL server without autovacuum (`check --database ALIAS`)."""
    return [
        Warning(
            problem,
            hint="Turn autovacuum on (postgresql.conf: autovacuum = on), or VACUUM the job and "
            "ledger tables every few minutes; see the Autovacuum section of docs/operations.md.",
            id="django_leases.W008",
        )
        for alias in databases or ()
        for problem in autovacuum_problems(alias)
    ]


def sqlite_without_immediate(databases: dict[str, Any]) -> list[str]:
    """Return the aliases of databases in `databases` (a DATABASES setting) whose transactions
    do not take the write lock when they start (SQLite without "IMMEDIATE":
    `Dialect.lazy_write_lock()`)."""
    return [
        alias
        for alias, config in databases.items()
        for dialect in [dialect_of_engine(str(config.get("ENGINE", "")))]
        if dialect is not None and dialect.lazy_write_lock(config.get("OPTIONS") or {})
    ]


def check_sqlite_transaction_mode(**kwargs: Any) -> list[CheckMessage]:
    """Warn about SQLite databases whose transactions do not take the write lock at once."""
    return [
        Warning(
            f'SQLite database {alias!r} has no "OPTIONS": {{"transaction_mode": '
            '"IMMEDIATE"}}: an operator action reads before it writes, and another process\'s '
            "write in between makes it fail with 'database is locked' instead of waiting.",
            hint='Add "transaction_mode": "IMMEDIATE" to the OPTIONS of this database '
            "(Django 5.1+).",
            id="django_leases.W003",
        )
        for alias in sqlite_without_immediate(settings.DATABASES)
    ]


def check_pending_kinds(
    app_configs: Any = None, databases: Iterable[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Warn of pending jobs of JOB_MODEL whose kind no handler is registered for
    (`check --database ALIAS`): `enqueue("captur")` is accepted, and its job waits for ever.

    The handlers are those this process registers (its installed apps' jobs.py modules), as for
    W006 and W009. A table not migrated yet is left to the other checks.
    """
    known = registered_kinds()
    folded = {kind.casefold(): kind for kind in known}
    messages: list[CheckMessage] = []
    for alias in databases or ():
        jobs = leased_jobs(None, alias)
        try:
            pending = set(jobs.pending().order_by().values_list("kind", flat=True).distinct())
        except DatabaseError:
            continue
        for kind in sorted(pending - set(known)):
            close = [folded[k] for k in difflib.get_close_matches(kind.casefold(), folded, n=1)]
            messages.append(
                Warning(
                    f"database {alias!r}: {jobs.model._meta.label} has pending jobs of kind "
                    f"{shown(kind)}, for which no handler is registered: no worker runs them.",
                    hint=(f"Did you mean {close[0]!r}? " if close else "")
                    + "Register a @job_handler for the kind, or cancel its jobs in the admin "
                    "(the queue overview lists the kinds no live worker serves).",
                    id="django_leases.W014",
                )
            )
    return messages


def check_horizon(
    app_configs: Any = None, databases: Iterable[str] | None = None, **kwargs: Any
) -> list[CheckMessage]:
    """Warn of a transaction, replication slot or prepared transaction holding the removal of
    dead rows back past HORIZON_WARN_AFTER (`check --database ALIAS`)."""
    messages: list[CheckMessage] = []
    for alias in databases or ():
        pin = oldest_pin(alias)
        if pin is not None and pin.pinned:
            messages.append(
                Warning(
                    f"database {alias!r}: the removal of dead rows is held back by "
                    f"{pin.describe()}; claims slow down with every job completed while it "
                    "lasts.",
                    hint="End it, and bound such sessions on the server "
                    "(idle_in_transaction_session_timeout, statement timeouts; drop an unused "
                    "replication slot); see 'What holds vacuum back' in docs/operations.md.",
                    id="django_leases.W015",
                )
            )
    return messages
