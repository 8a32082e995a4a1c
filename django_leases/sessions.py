"""What this process prepared in each PostgreSQL session: the claim's prepared statements.

Planning the claim costs PostgreSQL more than running it (0.3-0.6 ms against 0.5 ms for a
completion and a claim of 10 jobs). A prepared statement is planned once and its generic plan
kept (`sql.prepared.claim_prepared()` writes in what the plan needs to know). Its name is a
digest of its text, so behind a pooler that hands one server session to several clients a
statement found under it is this very statement; a session that lacks it is given it again.
Where the sessions keep losing it (transaction pooling), the claim is sent whole again.
A kept plan was made for the tables as they were then (one made while the ledger was empty
reads all of it once it has grown). PostgreSQL plans again after an ANALYZE; in between, a
statement is prepared anew after `FIRST_REPLAN` executions, then after twice as many each time
up to `REPLAN_EVERY`, and at the latest every `REPLAN_AFTER` seconds: often while a worker is
new, when new or emptied tables fill up fastest for their size, and later for under 1% of a
busy worker's claims (a quiet one prepares at nearly every claim: two more round trips).
`dialects.PostgreSQL.claim()` runs the statements; this module keeps their books.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from weakref import WeakKeyDictionary

from django.db import DatabaseError
from django.db.backends.base.base import BaseDatabaseWrapper

from django_leases import sql
from django_leases.sql import postgresql
from django_leases.sql import prepared as statements

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
class Prepared:
    """A statement prepared in a session: the executions left and the time before it is prepared
    anew, and how many executions this preparation was for."""

    left: int
    until: float
    runs: int


@dataclass
class Session:
    """What this process prepared in one database connection, by name, the literals its
    EXECUTEs wrote in, and how the driver quotes one (None: the EXECUTE keeps its parameters).
    Only the connection's thread uses it."""

    statements: dict[str, Prepared] = field(default_factory=dict)
    misses: int = 0
    literals: postgresql.Literals = field(default_factory=postgresql.Literals)
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
    prepared: statements.Prepared,
    known: Prepared | None,
    now: float,
) -> None:
    """Prepare `prepared` in the session: it is not there (`known` None) or no longer fresh."""
    with connection.cursor() as cursor:
        if known is not None:
            try:
                cursor.execute(prepared.deallocate)
            except DatabaseError as exc:
                if sql.sqlstate(exc) != statements.PREPARED_GONE:
                    raise
        try:
            cursor.execute(prepared.prepare)
        except DatabaseError as exc:
            # Prepared in this server session by another client of a pooler: the same text.
            if sql.sqlstate(exc) != statements.PREPARED_TAKEN:
                raise
    runs = FIRST_REPLAN if known is None else min(known.runs * 2, REPLAN_EVERY)
    session.statements[prepared.name] = Prepared(runs - 1, now + REPLAN_AFTER, runs)


def lost(connection: BaseDatabaseWrapper, session: Session, prepared: statements.Prepared) -> bool:
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
