"""The bounds of every argument and setting of django-leases, defined once.

Each bound is one that SQLite, PostgreSQL and MariaDB/MySQL all store, so that bad input gets
the same `InvalidArgument` (a `ValueError`) naming the argument and its range on every database,
before anything is written, instead of a database error on one of them and silent acceptance on
another.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from django_leases.exceptions import InvalidArgument, InvalidPayload, PayloadTooLarge

DAY = 24 * 3600
# About 100 years: `database now + MAX_DURATION` stays far inside the DATETIME range of every
# database (MariaDB/MySQL end at year 9999), and `timedelta` never overflows.
MAX_DURATION = 100 * 365 * DAY

# The shortest lease timings a worker runs with, in seconds (a positive 1e-9 is no more usable
# than 0):
# - TTL: a lease must outlast the ordinary pauses between its claim, its start and its first
#   renewal (a statement on a busy database, a garbage collection, a scheduler delay). Shorter
#   than a second, it expires in normal operation and jobs run twice.
# - HEARTBEAT and POLL_INTERVAL: one statement each time (a renewal; an idle worker's claim).
#   Below 10 ms, about the scheduler's time slice, they are a busy loop on the database.
MIN_TTL = 1.0
MIN_HEARTBEAT = 0.01
MIN_POLL_INTERVAL = 0.01
# The lower bounds by setting (every other duration only has to be positive).
MIN_SECONDS = {"TTL": MIN_TTL, "HEARTBEAT": MIN_HEARTBEAT, "POLL_INTERVAL": MIN_POLL_INTERVAL}


def duration_range(minimum: float = 0.0) -> str:
    """Describe the durations from `minimum` seconds (0: any positive one) to `MAX_DURATION`."""
    if minimum:
        return f"a number of seconds from {minimum:g} to {MAX_DURATION} (100 years)"
    return f"a positive number of seconds up to {MAX_DURATION} (100 years)"


def in_duration_range(seconds: float, minimum: float = 0.0) -> bool:
    """Whether `seconds` is in `duration_range(minimum)` (NaN is not)."""
    return (minimum <= seconds if minimum else 0 < seconds) and seconds <= MAX_DURATION


DURATION_RANGE = f"{duration_range()} or a timedelta"
ZERO_OR_MORE_SECONDS = f"zero or more seconds, up to {MAX_DURATION} (100 years)"

# Datetimes given as `run_at`: inside MariaDB/MySQL's DATETIME (years 1000-9999), PostgreSQL's
# timestamptz and Python's datetime, with room for any time zone offset.
EARLIEST_DATETIME = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_DATETIME = datetime(9999, 1, 1, tzinfo=UTC)

# Whole-number arguments and settings: (lowest, highest).
PRIORITY = (-32768, 32767)  # a SMALLINT on every database
# A PositiveIntegerField (signed 32-bit on PostgreSQL); each graceful release adds one more, so
# keep far below 2**31.
MAX_ATTEMPTS = (1, 1_000_000)
# Jobs one claim() takes, and ids in one `IN (...)` list: below SQLite's 32766 bound variables.
CLAIM_LIMIT = (1, 10_000)
BATCH_SIZE = (1, 10_000)
# Completions a worker writes in one statement (ACK_BATCH_SIZE).
ACK_BATCH_SIZE = (1, 1_000)
# One thread and one database connection each.
CONCURRENCY = (1, 1_000)
# `limit=` and the job count of `rate=` of a handler (`throttles.py`).
KIND_LIMIT = (1, 1_000_000)
# Rows the admin counts exactly before it estimates.
EXACT_COUNT_LIMIT = (1, 100_000_000)
MAX_JOBS = (1, 2**31 - 1)
# Worker processes under one `run_lease_worker --processes` supervisor.
PROCESSES = (1, 256)
# A job's id: a BIGINT.
JOB_ID = (1, 2**63 - 1)
# The characters of an error's text stored in `last_error` and the attempt ledger (and logged).
MAX_ERROR_LENGTH = 2000
# MAX_PAYLOAD_BYTES: up to PostgreSQL's bound of one jsonb value (255 MiB, less a margin).
PAYLOAD_BYTES = (1, 256 * 1024 * 1024 - 1024 * 1024)
# Transactions (HORIZON_WARN_XIDS): up to PostgreSQL's wraparound bound of two billion.
XIDS = (1, 2_000_000_000)
# A TCP port to serve metrics on; 0 lets the system choose a free one.
PORT = (0, 65535)

# Characters of each text field (as the model declares them).
KIND_LENGTH = 100
OWNER_LENGTH = 255
PAYMENT_ID_LENGTH = 64
IDEMPOTENCY_KEY_LENGTH = 255
LOCK_LENGTH = 255
CHECKPOINT_LENGTH = 100
# A step's name; its marker in the job's checkpoint is STEP_MARKER + name (CHECKPOINT_LENGTH).
STEP_NAME_LENGTH = 64
STEP_MARKER = "step:"

# JSON: MariaDB's JSON_VALID (the CHECK of its JSON columns) refuses 32 levels of nesting;
# MySQL's JSON type keeps integers of 64 bits exactly.
MAX_JSON_DEPTH = 31
JSON_INT = (-(2**63), 2**63 - 1)

# PostgreSQL refuses NUL in text and jsonb, and no database's UTF-8 can hold a lone surrogate;
# SQLite would store both. Refused everywhere, so that no database is the odd one out.
BAD_CHARACTER = re.compile("[\x00\ud800-\udfff]")


def shown(value: Any, width: int = 60) -> str:
    """Return `repr(value)`, cut to `width` characters for an error message."""
    text = repr(value)
    return text if len(text) <= width else f"{text[: width - 3]}..."


def bad_character(text: str) -> str | None:
    """Describe the first character of `text` that no database stores alike, or None."""
    match = BAD_CHARACTER.search(text)
    if match is None:
        return None
    char = match.group()
    return "a NUL character" if char == "\x00" else f"a lone surrogate (U+{ord(char):04X})"


def check_text(value: Any, name: str, max_length: int, *, blank: bool = False) -> str:
    """Return `value` if it is a string of at most `max_length` characters that every database
    stores; raise `InvalidArgument` naming `name` otherwise."""
    least = 0 if blank else 1
    if not isinstance(value, str) or not least <= len(value) <= max_length:
        size = f"at most {max_length}" if blank else f"1 to {max_length}"
        raise InvalidArgument(f"{name} must be a string of {size} characters, got {shown(value)}")
    problem = bad_character(value)
    if problem:
        raise InvalidArgument(
            f"{name} contains {problem}, which is not stored alike on every database: "
            f"got {shown(value)}"
        )
    return value


def check_kind(value: Any, name: str = "kind") -> str:
    """Return `value` if it is a job kind: a word (`check_word()`) of at most `KIND_LENGTH`
    characters."""
    return check_word(value, name, KIND_LENGTH)


def check_owner(value: Any, name: str = "owner") -> str:
    """Return `value` if it is a worker id (a lease owner): a word (`check_word()`) that fits the
    lease_owner column."""
    return check_word(value, name, OWNER_LENGTH)


def check_word(value: Any, name: str, max_length: int) -> str:
    """Return `value` if it is a string of 1 to `max_length` characters without whitespace or
    control characters; raise `InvalidArgument` naming `name` otherwise.

    Kinds and worker ids are logged as `kind=<kind>`, `owner=<id>`: a space or a line break in
    one would split a log line, or forge a key=value of its own.
    """
    check_text(value, name, max_length)
    for position, char in enumerate(value):
        if char.isspace() or unicodedata.category(char) in ("Cc", "Cf"):
            raise InvalidArgument(
                f"{name} must not contain whitespace or control characters, got {shown(value)} "
                f"({unicodedata.name(char, f'U+{ord(char):04X}')} at position {position})"
            )
    return value


def check_int(value: Any, name: str, bounds: tuple[int, int]) -> int:
    """Return `value` if it is a whole number within `bounds`; raise `InvalidArgument`."""
    low, high = bounds
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidArgument(
            f"{name} must be a whole number from {low} to {high}, got {shown(value)}"
        )
    return value


def check_datetime(value: datetime, name: str) -> datetime:
    """Return `value` if it is an aware datetime within the stored range."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(f"{name} must be an aware datetime (USE_TZ = True), got {value!r}")
    if not EARLIEST_DATETIME <= value < LATEST_DATETIME:
        raise InvalidArgument(
            f"{name} must be from {EARLIEST_DATETIME.isoformat()} to before "
            f"{LATEST_DATETIME.isoformat()}, got {value.isoformat()}"
        )
    return value


def check_json(value: Any, name: str) -> None:
    """Raise `InvalidPayload` naming `name` and the place if `value` is not JSON that every
    database stores alike: only dicts, lists, strings, finite numbers, booleans and None, at
    most MAX_JSON_DEPTH levels deep, no NUL or lone surrogate, integers of 64 bits."""
    # Iterative, so that a deeply nested (or self-containing) value is refused by the depth
    # bound instead of a RecursionError. A place is (its container's place, its key or index,
    # whether a key), spelled out only for an error: it was most of the time of a check.
    stack: list[tuple[Any, Any, int]] = [(value, None, 0)]
    while stack:
        item, place, depth = stack.pop()
        if not isinstance(item, dict | list | tuple):
            _check_json_scalar(item, _where(name, place), name)
            continue
        if depth >= MAX_JSON_DEPTH:
            raise InvalidPayload(
                f"{name} is nested deeper than {MAX_JSON_DEPTH} levels (at {_where(name, place)})"
            )
        keyed = isinstance(item, dict)
        pairs: Iterable[tuple[Any, Any]] = (
            item.items() if isinstance(item, dict) else enumerate(item)
        )
        for key, child in pairs:
            if keyed and not _plain(key):
                _check_json_scalar(key, f"a key of {_where(name, place)}", name, key=True)
            if isinstance(child, dict | list | tuple):
                stack.append((child, (place, key, keyed), depth + 1))
            elif not _plain(child):
                _check_json_scalar(child, _where(name, (place, key, keyed)), name)


def check_json_size(value: Any, name: str, limit: int) -> None:
    """Raise `PayloadTooLarge` naming `name`, its size and `limit` if `value` (which passed
    `check_json()`) takes more than `limit` bytes as JSON text (as Django's JSONField writes
    it: ASCII, so characters are bytes)."""
    size = len(json.dumps(value))
    if size > limit:
        raise PayloadTooLarge(
            f"{name} is {size} bytes as JSON, more than MAX_PAYLOAD_BYTES ({limit}): store "
            "large data elsewhere and pass its reference"
        )


def _plain(item: Any) -> bool:
    """Whether `item` is a JSON scalar every database stores alike, at a glance: False may
    still be one (a subclass of str), for `_check_json_scalar` to tell."""
    kind = type(item)
    if kind is str:
        return BAD_CHARACTER.search(item) is None
    if kind is int:
        return JSON_INT[0] <= item <= JSON_INT[1]
    return item is None or kind is bool or (kind is float and math.isfinite(item))


def _where(name: str, place: Any) -> str:
    """Spell out a place of `check_json()`: `payload['items'][0]`."""
    steps = []
    while place is not None:
        place, key, keyed = place
        steps.append(f"[{shown(key, 30)}]" if keyed else f"[{key}]")
    return name + "".join(reversed(steps))


def _check_json_scalar(item: Any, where: str, name: str, *, key: bool = False) -> None:
    if item is None or isinstance(item, bool):
        return
    if isinstance(item, str):
        problem = bad_character(item)
        if problem:
            raise InvalidPayload(f"{name} contains {problem} at {where}")
    elif isinstance(item, int):
        if not JSON_INT[0] <= item <= JSON_INT[1]:
            raise InvalidPayload(
                f"{name} has an integer outside {JSON_INT[0]} to {JSON_INT[1]} at {where}"
            )
    elif isinstance(item, float):
        if not math.isfinite(item):
            raise InvalidPayload(f"{name} has {item!r}, which is not JSON, at {where}")
    else:
        kind = "key" if key else "value"
        raise InvalidPayload(
            f"{name} has a {kind} of type {type(item).__name__}, which is not JSON, at {where}"
        )
