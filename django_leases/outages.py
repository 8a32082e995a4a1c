"""Tell a database outage, which is waited out, from a configuration error, which is reported.

A worker, the watcher and `prune_jobs` wait out a database that is down, restarting, cut off or
read-only after a failover: it comes back by itself. A login the server refuses, a database or
a connection option it does not know, or tables that were never migrated do not: retrying them
forever only hides the cause. `misconfiguration()` is the one place that tells them apart, by
the driver's error codes (MariaDB/MySQL's numbers, PostgreSQL's SQLSTATE) and, where a driver
has none, by the server's message: libpq reports no SQLSTATE for an error during the connection
handshake (a failed login, an unknown database or startup parameter), so those are read from
PostgreSQL's and PgBouncer's English messages. Anything not recognised counts as an outage, as
before: a server whose `lc_messages` is not English gets its connection errors waited out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError, InterfaceError, OperationalError, connections

from django_leases.exceptions import DatabaseMisconfigured
from django_leases.redaction import error_text
from django_leases.sql import sqlstate

MIGRATE = "migrate"
"""What `misconfiguration()` names for tables (or columns) the database lacks."""

OUTAGES = (OperationalError, InterfaceError)
"""The errors of a database that is down or cut off; waited out unless `misconfiguration()`
recognises them."""

# PostgreSQL's SQLSTATEs of a statement that reached the server (42P01: undefined_table,
# 42703: undefined_column, 42501: insufficient_privilege, 28000: invalid_authorization_
# specification, 28P01: invalid_password, 3D000: invalid_catalog_name).
PG_SQLSTATES = {
    "42P01": MIGRATE,
    "42703": MIGRATE,
    "42501": "USER",
    "28000": "USER",
    "28P01": "PASSWORD",
    "3D000": "NAME",
}
# The handshake's errors, which carry no SQLSTATE: PostgreSQL's FATAL messages, PgBouncer's
# and libpq's own.
PG_MESSAGES = (
    (re.compile(r'database ".*" does not exist'), "NAME"),
    (re.compile(r"no such database"), "NAME"),  # PgBouncer
    (re.compile(r"database .* is not currently accepting connections"), "NAME"),
    (re.compile(r'role ".*" does not exist'), "USER"),
    (re.compile(r'role ".*" is not permitted to log in'), "USER"),
    (re.compile(r"permission denied for database"), "USER"),
    (re.compile(r"no pg_hba\.conf entry"), "USER"),
    (re.compile(r"password authentication failed"), "PASSWORD"),
    (re.compile(r"no password supplied"), "PASSWORD"),
    (re.compile(r"unsupported startup parameter"), "OPTIONS"),  # PgBouncer
    (re.compile(r"unrecognized configuration parameter"), "OPTIONS"),
    (re.compile(r"invalid value for parameter"), "OPTIONS"),
    (re.compile(r"invalid connection option"), "OPTIONS"),  # libpq
)
# MariaDB/MySQL's error numbers: 1045/1698 access denied (password), 1044 no access to the
# database, 1049 unknown database, 1146/1054 unknown table/column, 1142/1143 no privilege on a
# table/column, 1193/1231/1232/1298 an unknown variable or time zone, or a wrong value (an
# init_command), 1115/1273 an unknown character set or collation, 1251/2059 an authentication
# plugin the client lacks.
MYSQL_ERRORS = {
    1045: "PASSWORD",
    1698: "PASSWORD",
    1044: "USER",
    1049: "NAME",
    1146: MIGRATE,
    1054: MIGRATE,
    1142: "USER",
    1143: "USER",
    1193: "OPTIONS",
    1231: "OPTIONS",
    1232: "OPTIONS",
    1115: "OPTIONS",
    1273: "OPTIONS",
    1298: "OPTIONS",
    1251: "OPTIONS",
    2059: "OPTIONS",
}
SQLITE_MESSAGES = (
    (re.compile(r"no such (table|column)"), MIGRATE),
    (re.compile(r"unable to open database file"), "NAME"),
)
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
    vendor = connections[alias].vendor
    text = " ".join(str(exc).split())
    what = _classify(exc, vendor, text)
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


def _classify(exc: BaseException, vendor: str, text: str) -> str | None:
    if vendor == "postgresql":
        state = sqlstate(exc)
        if state is not None:
            return PG_SQLSTATES.get(state)
        return _match(PG_MESSAGES, text)
    if vendor == "mysql":
        code = exc.args[0] if exc.args else None
        return MYSQL_ERRORS.get(code) if isinstance(code, int) else None
    if vendor == "sqlite":
        return _match(SQLITE_MESSAGES, text)
    return None


def _match(patterns: Iterable[tuple[re.Pattern[str], str]], text: str) -> str | None:
    return next((what for pattern, what in patterns if pattern.search(text)), None)


def outage_or_raise(exc: DatabaseError, alias: str) -> None:
    """Return if `exc` is an outage to wait out; raise `DatabaseMisconfigured` for a
    configuration error, and `exc` itself for anything else."""
    message = misconfiguration(exc, alias)
    if message is not None:
        raise DatabaseMisconfigured(message) from None
    if not isinstance(exc, OUTAGES):
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
