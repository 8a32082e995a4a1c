"""PostgreSQL's claim as a named prepared statement of the session, and what this process
prepared in each session (`dialects.postgresql.PostgreSQL.claim()` runs it).

Planning the claim costs PostgreSQL more than running it (0.3-0.6 ms against 0.5 ms for a
completion and a claim of 10 jobs). A prepared statement is planned once and its generic plan
kept (`claim_prepared()` writes in what the plan needs to know). Its name is a
digest of its text, so behind a pooler that hands one server session to several clients a
statement found under it is this very statement; a session that lacks it is given it again.
Where the sessions keep losing it (transaction pooling), the claim is sent whole again.
A kept plan was made for the tables as they were then (one made while the ledger was empty
reads all of it once it has grown). PostgreSQL plans again after an ANALYZE; in between, a
statement is prepared anew after `FIRST_REPLAN` executions, then after twice as many each time
up to `REPLAN_EVERY`, and at the latest every `REPLAN_AFTER` seconds: often while a worker is
new, when new or emptied tables fill up fastest for their size, and later for under 1% of a
busy worker's claims (a quiet one prepares at nearly every claim: two more round trips).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any
from weakref import WeakKeyDictionary

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from django_leases.dialects.merge import CANDIDATE_SLACK
from django_leases.dialects.postgresql_statements import Literals
from django_leases.dialects.statements import Params, sqlstate


def prepared_claim(statement: tuple[str, Params]) -> tuple[Prepared, Params]:
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
) -> tuple[Prepared, tuple[str, ...]]:
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


logger = logging.getLogger("django_leases.worker")

FIRST_REPLAN = 16
"""Executions of a new prepared statement after which it is prepared (and planned) anew."""

REPLAN_EVERY = 1024
"""The most executions of a prepared statement before it is prepared (and planned) anew."""

REPLAN_AFTER = 10.0
"""Seconds after which a prepared statement is prepared (and planned) anew at its next use."""

MISSES_ALLOWED = 3
"""Statements a session may lose (not found at EXECUTE) before its connection stops preparing."""


@dataclass
class Kept:
    """What a session keeps of a `Prepared` statement: the executions left and the time before
    it is prepared anew, and how many executions this preparation was for."""

    left: int
    until: float
    runs: int


@dataclass
class Session:
    """What this process prepared in one database connection, by name, the literals its
    EXECUTEs wrote in, and how the driver quotes one (None: the EXECUTE keeps its parameters).
    Only the connection's thread uses it."""

    statements: dict[str, Kept] = field(default_factory=dict)
    misses: int = 0
    literals: Literals = field(default_factory=Literals)
    quote: Callable[[Any], str] | None = None


SESSIONS: WeakKeyDictionary[Any, Session] = WeakKeyDictionary()
"""The session of each driver connection (`start()`), kept beside it."""


def start(driver_connection: Any) -> Session:
    """Keep and return a new session of `driver_connection`.

    Raises:
        TypeError: for a driver connection without weak references (not prepared), as
            `SESSIONS.get()` does.
    """
    return SESSIONS.setdefault(driver_connection, Session(quote=quoter(driver_connection)))


def quoter(driver_connection: Any) -> Callable[[Any], str] | None:
    """How psycopg 3 writes a value into a statement on `driver_connection` as a literal; None
    for another driver (psycopg 2), whose EXECUTEs keep their parameters."""
    try:
        # Imported here: psycopg is an optional dependency, needed only by PostgreSQL users.
        from psycopg import Connection
        from psycopg import sql as composed
    except ImportError:
        return None
    if not isinstance(driver_connection, Connection):
        return None
    return partial(_literal, composed.Literal, driver_connection)


def _literal(literal: Any, driver_connection: Any, value: Any) -> str:
    return str(literal(value).as_string(driver_connection))


def prepare(
    connection: BaseDatabaseWrapper,
    session: Session,
    prepared: Prepared,
    known: Kept | None,
    now: float,
) -> None:
    """Prepare `prepared` in the session: it is not there (`known` None) or no longer fresh."""
    with connection.cursor() as cursor:
        if known is not None:
            try:
                cursor.execute(prepared.deallocate)
            except DatabaseError as exc:
                if sqlstate(exc) != PREPARED_GONE:
                    raise
        try:
            cursor.execute(prepared.prepare)
        except DatabaseError as exc:
            # Prepared in this server session by another client of a pooler: the same text.
            if sqlstate(exc) != PREPARED_TAKEN:
                raise
    runs = FIRST_REPLAN if known is None else min(known.runs * 2, REPLAN_EVERY)
    session.statements[prepared.name] = Kept(runs - 1, now + REPLAN_AFTER, runs)


def lost(connection: BaseDatabaseWrapper, session: Session, prepared: Prepared) -> bool:
    """Note that the session lost `prepared`; return whether its connection stops preparing."""
    session.statements.pop(prepared.name, None)
    session.misses += 1
    if session.misses < MISSES_ALLOWED:
        return False
    logger.info(
        "database %r keeps losing prepared statements (a transaction pooler?): this "
        "connection's claims are planned at every statement",
        connection.alias,
    )
    return True
