"""What is kept of an error's text before it is stored (the ledger, `last_error`) or logged.

Database errors quote the values they refused: PostgreSQL's `DETAIL:  Key (card)=(4111...)
already exists.`, MariaDB/MySQL's `Duplicate entry '4111...' for key ...`. Every text django-leases
keeps from an exception goes through `error_text()`, which calls the `DJANGO_LEASES
["REDACT_ERRORS"]` hook, by default `redact_database_values()`. The package's loggers carry
`RedactExceptions` (installed by `LeasesConfig.ready()`), so that a log call with an exception
(`logger.exception(...)`) prints that text, never the raw one.
"""

from __future__ import annotations

import ast
import logging
import re
import traceback
from collections.abc import Callable
from typing import Any

from django.db import Error as DjangoDatabaseError
from django.utils.module_loading import import_string

from django_leases.conf import leases_settings
from django_leases.limits import MAX_ERROR_LENGTH

Redactor = Callable[[BaseException, str], str]

# The most of an error's text that redaction reads: the stored length, with room for a quoted
# value that redaction shortens to `'…'` and the words after it. Texts are cut to it before any
# pattern sees them, so that one job's error (PostgreSQL quotes a whole refused value) costs
# the worker thread that records it microseconds, not seconds under the GIL; each pattern below
# is linear in the text it reads, so the cut bounds the work.
REDACT_LENGTH = 4 * MAX_ERROR_LENGTH
# What stands for the rest of a text longer than REDACT_LENGTH.
CUT = " […]"

# The driver packages whose exceptions are database errors even when Django did not wrap them.
DRIVER_PACKAGES = ("psycopg", "psycopg2", "MySQLdb", "pymysql", "sqlite3", "_sqlite3")
# PostgreSQL's secondary fields, each on its own line after the primary message: they quote
# rows, keys, values and statements. Everything from the first of them on is dropped. The
# indent is whitespace other than a newline: `\s*` from every line start over a run of newlines
# was quadratic.
SECONDARY_FIELD = re.compile(
    r"^[^\S\n]*(DETAIL|HINT|CONTEXT|WHERE|QUERY|STATEMENT|LINE \d+):", re.MULTILINE
)
# A quoted text of a primary message: '...' (MariaDB/MySQL: "Duplicate entry '4111' for key",
# "Incorrect integer value: 'x'"), and PostgreSQL's `: "..."` ('invalid input syntax for type
# integer: "4111"'). One that follows key, constraint, column, table, index or relation names a
# schema object (`name`): it is kept, the others are values. A quote left open (a text cut at
# REDACT_LENGTH) runs to the end. Every opening quote thus matches, and the loop is possessive,
# so no attempt fails after scanning the rest of the text (which, from each of many quotes, was
# quadratic).
QUOTED = re.compile(
    r"""(?P<name>\b(?:key|constraint|column|table|index|relation) )?'(?:[^'\\]|\\.?|'')*+(?:'|\Z)"""
    r"""|(?<=: )"(?:[^"\\]|\\.?)*+(?:"|\Z)""",
    re.IGNORECASE | re.DOTALL,  # IGNORECASE: MariaDB's "Column 'x' cannot be null"
)
MASK = "'…'"
# MariaDB/MySQL's driver error as str() prints it: (code, 'message'), the message a Python
# literal whose quotes are escaped where it holds both kinds.
DRIVER_TUPLE = re.compile(r"\A\((\d+), (.*)\)\Z", re.DOTALL)
# Messages whose quoted value may hold the quote itself (neither database escapes it): the value
# runs to the last quote before the words that follow it. MariaDB/MySQL: Duplicate entry,
# Incorrect <type> value, Truncated incorrect <type> value, a syntax error's "near"; PostgreSQL:
# value "..." is out of range, <problem>: "..." at the end of the message, a syntax error's
# "at or near". Each names the value `value`. Only the first occurrence of the words before
# the value is tried (the atomic group, matched from the start): the greedy value then scans
# the text once; a search from every occurrence scanned it from each (quadratic).
GREEDY_VALUES = [
    re.compile(rf"(?>.*?{before}(?={quote}))(?P<value>{quote}.*{quote}){after}", re.DOTALL)
    for before, quote, after in (
        (r"Duplicate entry ", "'", " for key "),
        (r"Incorrect \w+ value: ", "'", " for column "),
        (r"Truncated incorrect \w+ value: ", "'", ""),
        (r" near ", "'", r" at line \d"),
        (r"\bvalue ", '"', " is out of range for type "),
        (r": ", '"', r"\s*\Z"),
        (r" at or near ", '"', ""),
    )
]
# A card-like number wherever it is left: 12 to 19 digits, in groups or not. Database errors
# also carry texts no template quotes (a trigger's RAISE or SIGNAL, a value taken for a name).
CARD_NUMBER = re.compile(r"(?<!\d)\d(?:[ -]?\d){11,18}(?!\d)")
# The loggers of django-leases: `install_log_filter()` gives each one `RedactExceptions`.
LOGGERS = (
    "django_leases",
    "django_leases.prune",
    "django_leases.schedules",
    "django_leases.watcher",
    "django_leases.worker",
)


def is_database_error(exc: BaseException) -> bool:
    """Whether `exc` comes from the database: Django's wrapper or a driver's own class."""
    if isinstance(exc, DjangoDatabaseError):
        return True
    return type(exc).__module__.split(".")[0] in DRIVER_PACKAGES


def redact_database_values(exc: BaseException, text: str) -> str:
    """Return `text` without the values a database error quotes; other errors unchanged.

    For a database error: drop PostgreSQL's DETAIL / HINT / CONTEXT / WHERE / QUERY / STATEMENT
    / LINE n lines and everything after the first of them; replace every quoted value of the
    primary message by `'…'` (MariaDB/MySQL's `Duplicate entry '…'`, PostgreSQL's `value '…' is
    out of range`), a value holding quotes whole, keeping quoted names that follow key,
    constraint, column, table, index or relation; and replace what is left of card-like numbers
    (12 to 19 digits) by `…`. SQLite's messages name constraints and columns, never values (but
    a trigger's RAISE text may hold one). A text longer than REDACT_LENGTH is cut to it first
    (a quote the cut leaves open is a value to its end), and ends in `CUT`.
    """
    if not is_database_error(exc):
        return text
    text, rest = cut(text)
    driver = DRIVER_TUPLE.match(text)
    if driver:
        try:
            message = ast.literal_eval(driver.group(2))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            message = None
        if isinstance(message, str):
            return f"({driver.group(1)}, {_redacted_message(message)!r}){rest}"
    return _redacted_message(text) + rest


def cut(text: str) -> tuple[str, str]:
    """Return `text` cut to REDACT_LENGTH, and `CUT` if that left something out (else "").

    The digits (and their spaces and dashes) that the cut runs through go too: the part of a
    card number left before the cut would be too short for CARD_NUMBER to see.
    """
    if len(text) <= REDACT_LENGTH:
        return text, ""
    return text[:REDACT_LENGTH].rstrip("0123456789 -"), CUT


def _redacted_message(text: str) -> str:
    match = SECONDARY_FIELD.search(text)
    if match:
        text = text[: match.start()].rstrip()
    for pattern in GREEDY_VALUES:
        value = pattern.match(text)
        if value:
            text = text[: value.start("value")] + MASK + text[value.end("value") :]
    text = QUOTED.sub(lambda m: m.group() if m.group("name") else MASK, text)
    return CARD_NUMBER.sub("…", text)


def redactor() -> Redactor:
    """Return the `DJANGO_LEASES["REDACT_ERRORS"]` callable."""
    hook: Redactor = import_string(leases_settings.REDACT_ERRORS)
    return hook


def error_text(exc: BaseException) -> str:
    """Return the text of `exc` to store or log: `str(exc)` through the REDACT_ERRORS hook.

    Never raises: if the hook fails or returns something else than a string, only the
    exception's class name is kept, so that a broken hook cannot leak the raw text. The hook
    is given the text cut to REDACT_LENGTH, and what it returns is cut to it too: the result
    ends in `CUT` if either cut left something out.
    """
    try:
        text, rest = cut(str(exc))
        text = redactor()(exc, text)
    except Exception as hook_error:  # noqa: BLE001 - the raw text must not escape
        return f"[error text withheld: REDACT_ERRORS raised {type(hook_error).__name__}]"
    if not isinstance(text, str):
        return "[error text withheld: REDACT_ERRORS returned no string]"
    text, more = cut(text)
    return text + (rest or more)


def class_path(exc: BaseException) -> str:
    """Return the class of `exc` as a traceback names it: `ValueError`, `django.db.utils.Error`."""
    cls = type(exc)
    if cls.__module__ in ("builtins", "__main__"):
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def describe(exc: BaseException) -> str:
    """Return the last line of the traceback of `exc`, its text through REDACT_ERRORS."""
    text = error_text(exc)
    return f"{class_path(exc)}: {text}" if text else class_path(exc)


CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def redacted_traceback(exc: BaseException) -> str:
    """Return the traceback of `exc` as Python prints it, with every exception of the chain
    (causes and contexts) written by `describe()`; notes and group members left out."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = traceback.format_tb(current.__traceback__) if current.__traceback__ else []
        head = ["Traceback (most recent call last):\n", *frames] if frames else []
        parts.append("".join([*head, describe(current), "\n"]))
        if current.__cause__ is not None:
            parts.append(CAUSE)
            current = current.__cause__
        elif current.__context__ is not None and not current.__suppress_context__:
            parts.append(CONTEXT)
            current = current.__context__
        else:
            current = None
    return "".join(reversed(parts)).rstrip("\n")


class RedactExceptions(logging.Filter):
    """Log what REDACT_ERRORS keeps of a record's exception instead of the exception.

    The message line ends with the exception's class and redacted text; the traceback follows,
    its texts redacted, only when the record's logger is enabled for DEBUG. `exc_info` is
    removed, so no handler formats (or ships) the raw exception. An exception passed as an
    argument of the message is redacted too.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_redacted(arg) for arg in record.args)
        elif isinstance(record.args, dict):
            record.args = {key: _redacted(arg) for key, arg in record.args.items()}
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 - the handler reports a bad format string itself
                message = str(record.msg)
            record.msg, record.args = f"{message}: {describe(exc)}", None
            debug = logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
            record.exc_info, record.exc_text = None, redacted_traceback(exc) if debug else None
        return True


def _redacted(arg: Any) -> Any:
    return describe(arg) if isinstance(arg, BaseException) else arg


def install_log_filter() -> None:
    """Give every logger of `LOGGERS` one `RedactExceptions`; calling it again adds none."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactExceptions) for f in logger.filters):
            logger.addFilter(RedactExceptions())
