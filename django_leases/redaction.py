"""What is kept of an error's text before it is stored (the ledger, `last_error`) or logged.

Database errors quote the values they refused: PostgreSQL's `DETAIL:  Key (card)=(4111...)
already exists.`, MariaDB/MySQL's `Duplicate entry '4111...' for key ...`. Every text django-leases
keeps from an exception goes through `error_text()`, which calls the `DJANGO_LEASES
["REDACT_ERRORS"]` hook, by default `redact_database_values()`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from django.db import Error as DjangoDatabaseError
from django.utils.module_loading import import_string

from django_leases.conf import leases_settings

Redactor = Callable[[BaseException, str], str]

# The driver packages whose exceptions are database errors even when Django did not wrap them.
DRIVER_PACKAGES = ("psycopg", "psycopg2", "MySQLdb", "pymysql", "sqlite3", "_sqlite3")
# PostgreSQL's secondary fields, each on its own line after the primary message: they quote
# rows, keys, values and statements. Everything from the first of them on is dropped.
SECONDARY_FIELD = re.compile(
    r"^\s*(DETAIL|HINT|CONTEXT|WHERE|QUERY|STATEMENT|LINE \d+):", re.MULTILINE
)
# A quoted value in a primary message: '...' (MariaDB/MySQL: "Duplicate entry '4111' for key",
# "Incorrect integer value: 'x'") unless it names a schema object, and PostgreSQL's `: "..."`
# ('invalid input syntax for type integer: "4111"'). Identifiers after these words are kept.
QUOTED_VALUE = re.compile(
    r"""(?<!\bkey )(?<!\bconstraint )(?<!\bcolumn )(?<!\btable )(?<!\bindex )(?<!\brelation )"""
    r"""'(?:[^'\\]|\\.|'')*'|(?<=: )"(?:[^"\\]|\\.)*\""""
)
MASK = "'…'"


def is_database_error(exc: BaseException) -> bool:
    """Whether `exc` comes from the database: Django's wrapper or a driver's own class."""
    if isinstance(exc, DjangoDatabaseError):
        return True
    return type(exc).__module__.split(".")[0] in DRIVER_PACKAGES


def redact_database_values(exc: BaseException, text: str) -> str:
    """Return `text` without the values a database error quotes; other errors unchanged.

    For a database error: drop PostgreSQL's DETAIL / HINT / CONTEXT / WHERE / QUERY / STATEMENT
    / LINE n lines and everything after the first of them, and replace every quoted value of the
    primary message by `'…'` (MariaDB/MySQL's `Duplicate entry '…'`, PostgreSQL's `type
    integer: '…'`), keeping quoted names that follow key, constraint, column, table, index or
    relation. SQLite's messages name constraints and columns, never values: nothing to remove.
    """
    if not is_database_error(exc):
        return text
    match = SECONDARY_FIELD.search(text)
    if match:
        text = text[: match.start()].rstrip()
    return QUOTED_VALUE.sub(MASK, text)


def redactor() -> Redactor:
    """Return the `DJANGO_LEASES["REDACT_ERRORS"]` callable."""
    hook: Redactor = import_string(leases_settings.REDACT_ERRORS)
    return hook


def error_text(exc: BaseException) -> str:
    """Return the text of `exc` to store or log: `str(exc)` through the REDACT_ERRORS hook.

    Never raises: if the hook fails or returns something else than a string, only the
    exception's class name is kept, so that a broken hook cannot leak the raw text.
    """
    try:
        text = redactor()(exc, str(exc))
    except Exception as hook_error:  # noqa: BLE001 - the raw text must not escape
        return f"[error text withheld: REDACT_ERRORS raised {type(hook_error).__name__}]"
    if not isinstance(text, str):
        return "[error text withheld: REDACT_ERRORS returned no string]"
    return text
