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
waited out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections

from django_leases.dialects import dialect_of
from django_leases.exceptions import DatabaseMisconfigured
from django_leases.redaction import error_text
from django_leases.sql import MIGRATE

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
