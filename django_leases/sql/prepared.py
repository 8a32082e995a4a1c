"""PostgreSQL's claim as a named prepared statement of the session (`dialects.PostgreSQL` runs it).

Separate from `postgresql`: the statements there are plain text; here one is turned into a
PREPARE (its parameters numbered and typed, some integers written in) and an EXECUTE."""

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from django_leases.sql import Params
from django_leases.sql.merge import CANDIDATE_SLACK


def prepared_claim(statement: tuple[str, Params]) -> tuple["Prepared", Params]:
    """Return a `claim()` statement as a prepared statement (`prepared()`), its read window
    written in, rounded up to a power of two: PostgreSQL then plans it once per window (at most
    15 of them) and keeps that generic plan, where a LIMIT given as a parameter would have it
    plan every execution anew (its generic plan's estimate assumes 10% of the rows)."""
    return prepared(statement, written_in=read_window(statement[1]["limit"]))


def read_window(limit: int) -> dict[str, int]:
    """The integers `prepared_claim()` writes into a claim of `limit` jobs."""
    window = 1 << (limit - 1).bit_length()
    return {"window": window, "candidates": window + CANDIDATE_SLACK}


@lru_cache(maxsize=256)
def claim_prepared(
    sql: str, limit: int, shape: tuple[tuple[str, type], ...]
) -> tuple["Prepared", tuple[str, ...]]:
    """`prepared_claim()` of a claim's text, `limit` and its parameters' (name, class) pairs,
    built once per shape: the prepared statement and the names of its EXECUTE's parameters.
    A list is one of the claim's arrays of checked job ids or tokens (`bigint[]`)."""
    written_in = read_window(limit)
    types = tuple((name, _class_type(name, cls)) for name, cls in shape if name not in written_in)
    names = tuple(name for name, _ in types)
    return _prepared(sql, tuple(sorted(written_in.items())), types), names


PREPARED_PREFIX = "django_leases_"
"""The names of `prepared()` statements begin with it; the rest is a digest of the text."""

_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),  # before int: a bool is an int
    (int, "bigint"),
    (float, "double precision"),
    (str, "text"),
)
"""Parameter types a PREPARE declares, by the value's class or a subclass of it (a `StrEnum`
kind, an `IntEnum` pk)."""


@dataclass(frozen=True)
class Prepared:
    """A statement as a named prepared statement of the database session (`prepared()`)."""

    name: str
    prepare: str
    """The PREPARE: the statement's text, its parameters numbered and typed."""
    execute: str
    """The EXECUTE, its values as named parameters that the client writes in as literals:
    PostgreSQL takes no bind parameters in an EXECUTE."""

    @property
    def deallocate(self) -> str:
        return f"DEALLOCATE {self.name}"


def prepared(
    statement: tuple[str, Params], *, written_in: Mapping[str, int]
) -> tuple[Prepared, Params]:
    """Return `statement` as a named prepared statement, and the parameters of its EXECUTE.

    The name is a digest of the PREPARE's text, so a statement found under that name in a
    session is this very statement, whichever client prepared it: no name can meet another
    statement's, even where a pooler hands one server session to several clients (psycopg's
    own names, `_pg3_0` and on, are numbered per client connection).

    `written_in`: integer parameters written into the text (the planner then knows them).
    """
    sql, params = statement
    for name, value in written_in.items():
        if type(value) is not int:
            raise TypeError(f"only integers are written in, got {name}={value!r}")
    values = {name: value for name, value in params.items() if name not in written_in}
    types = tuple((name, _type(name, value)) for name, value in values.items())
    return _prepared(sql, tuple(sorted(written_in.items())), types), values


def _type(name: str, value: Any) -> str:
    """Return the PostgreSQL type a PREPARE declares for the parameter `name` of `value`."""
    if isinstance(value, list) and all(_type(name, item) == "bigint" for item in value):
        return "bigint[]"
    for python_type, sql_type in _TYPES:
        if isinstance(value, python_type):
            return sql_type
    raise TypeError(f"no type to prepare parameter {name} of {value!r} with")


def _class_type(name: str, cls: type) -> str:
    """`_type()` of a value of class `cls` (a list: of checked bigints)."""
    if issubclass(cls, list):
        return "bigint[]"
    for python_type, sql_type in _TYPES:
        if issubclass(cls, python_type):
            return sql_type
    raise TypeError(f"no type to prepare parameter {name} of {cls.__name__} with")


@lru_cache(maxsize=256)
def _prepared(
    sql: str, written_in: tuple[tuple[str, int], ...], types: tuple[tuple[str, str], ...]
) -> Prepared:
    """Build `prepared()`'s statement once per text, written-in values and parameter types."""
    for name, value in written_in:
        sql = sql.replace(f"%({name})s", str(value))
    numbers = {name: n for n, (name, _) in enumerate(types, start=1)}
    body = re.sub(r"%\((\w+)\)s", lambda match: f"${numbers[match.group(1)]}", sql)
    body = body.replace("%%", "%")
    declared = ", ".join(sql_type for _, sql_type in types)
    digest = hashlib.blake2b(f"({declared}) {body}".encode(), digest_size=12).hexdigest()
    name = PREPARED_PREFIX + digest
    if not types:
        return Prepared(name, f"PREPARE {name} AS {body}", f"EXECUTE {name}")
    arguments = ", ".join(f"%({param})s" for param, _ in types)
    return Prepared(name, f"PREPARE {name} ({declared}) AS {body}", f"EXECUTE {name} ({arguments})")


PREPARED_GONE = "26000"
"""invalid_sql_statement_name: no prepared statement of that name in the session (a new server
session, a pooler's, or one reset with DISCARD ALL)."""

PREPARED_TAKEN = "42P05"
"""duplicate_prepared_statement: the session has one of that name already."""

PREPARED_STALE = "0A000"
"""feature_not_supported, as "cached plan must not change result type": the table's columns
changed since the PREPARE (a migration while the worker runs)."""
