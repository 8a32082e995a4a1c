"""The claim as a named prepared statement of the database session, on PostgreSQL.

Planning the claim costs PostgreSQL more than running it (about 0.3-0.6 ms against 0.5 ms for a
completion and a claim of 10 jobs), once per statement as Django sends it. A prepared statement
is planned once and its generic plan kept (`sql.prepared.prepared_claim()` writes in what the
plan needs to know). Its name is a digest of its text, so behind a pooler that hands one server
session to several clients a statement found under it is this very statement; a session that
lacks it is given it again. Where the sessions keep losing it (transaction pooling), the claim
is sent whole again, as without this module.

A kept plan was made for the tables as they were then: a plan made while the ledger was empty
reads all of it once it has grown. PostgreSQL plans again after an ANALYZE of the tables
(autovacuum's); in between, a statement is prepared anew after `FIRST_REPLAN` executions, then
after twice as many each time up to `REPLAN_EVERY`, and at the latest every `REPLAN_AFTER`
seconds: often while a worker is new, when tables that were just created or emptied fill up
fastest compared with their size, and later on for under 1% of a busy worker's claims (a quiet
one prepares again at nearly every claim, which costs it two more round trips, not throughput).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

from django.db import DatabaseError, connections, models
from django.db.backends.base.base import BaseDatabaseWrapper

from django_leases.dialects import dialect_of
from django_leases.querysets.base import bound_raw, literal_raw
from django_leases.sql import Params, sqlstate
from django_leases.sql import prepared as statements

logger = logging.getLogger("django_leases.worker")

M = TypeVar("M", bound=models.Model)

FIRST_REPLAN = 16
"""Executions of a new prepared statement after which it is prepared (and planned) anew."""

REPLAN_EVERY = 1024
"""The most executions of a prepared statement before it is prepared (and planned) anew."""

REPLAN_AFTER = 10.0
"""Seconds after which a prepared statement is prepared (and planned) anew at its next use."""

MISSES_ALLOWED = 3
"""Statements a session may lose (not found at EXECUTE) before its connection stops preparing."""


@dataclass
class _Statement:
    """A statement prepared in a session: the executions left and the time before it is prepared
    anew, and how many executions this preparation was for."""

    left: int
    until: float
    runs: int


@dataclass
class _Session:
    """What this process prepared in one database connection, by name."""

    statements: dict[str, _Statement] = field(default_factory=dict)
    misses: int = 0


_sessions: WeakKeyDictionary[Any, _Session] = WeakKeyDictionary()


def prepared_claim_raw(queryset: models.QuerySet[M], statement: tuple[str, Params]) -> list[M]:
    """Run the `claim()` `statement` as a prepared statement where it can be, else as it is;
    return its rows as models, as `bound_raw()` does.

    Only in autocommit: an error inside a caller's transaction (a statement the session lost)
    would abort that transaction.
    """
    connection = connections[queryset.db]
    session = _session(connection)
    if session is None:
        return bound_raw(queryset, statement)
    prepared, params = statements.prepared_claim(statement)
    for _attempt in range(2):
        _prepare(connection, session, prepared)
        try:
            return literal_raw(queryset, (prepared.execute, params))
        except DatabaseError as exc:
            state = sqlstate(exc)
            if state == statements.PREPARED_STALE:
                session.statements[prepared.name].left = 0  # deallocate, prepare again
                continue
            if state != statements.PREPARED_GONE:
                raise
        session.statements.pop(prepared.name, None)
        session.misses += 1
        if session.misses >= MISSES_ALLOWED:
            logger.info(
                "database %r keeps losing prepared statements (a transaction pooler?): this "
                "connection's claims are planned at every statement",
                queryset.db,
            )
            break
    return bound_raw(queryset, statement)


def _session(connection: BaseDatabaseWrapper) -> _Session | None:
    """Return what this connection prepared; None where the claim is sent whole."""
    if not dialect_of(connection).prepares or connection.in_atomic_block:
        return None
    connection.ensure_connection()
    try:
        session = _sessions.setdefault(connection.connection, _Session())
    except TypeError:  # a driver connection without weak references
        return None
    return session if session.misses < MISSES_ALLOWED else None


def _prepare(
    connection: BaseDatabaseWrapper, session: _Session, prepared: statements.Prepared
) -> None:
    """Prepare `prepared` in the session unless it is there and still fresh."""
    now = time.monotonic()
    known = session.statements.get(prepared.name)
    if known is not None and known.left > 0 and known.until > now:
        known.left -= 1
        return
    with connection.cursor() as cursor:
        if known is not None:
            try:
                cursor.execute(prepared.deallocate)
            except DatabaseError as exc:
                if sqlstate(exc) != statements.PREPARED_GONE:
                    raise
        try:
            cursor.execute(prepared.prepare)
        except DatabaseError as exc:
            # Prepared in this server session by another client of a pooler: the same text.
            if sqlstate(exc) != statements.PREPARED_TAKEN:
                raise
    runs = FIRST_REPLAN if known is None else min(known.runs * 2, REPLAN_EVERY)
    session.statements[prepared.name] = _Statement(runs - 1, now + REPLAN_AFTER, runs)
