"""PostgreSQL's dialect: its claim (one statement, run as a prepared statement of the session),
its completions, NOTIFY and LISTEN, estimates, cursors, network options and the server's bound
of each transaction. Its statements are in `postgresql_statements.py`, the prepared claim's
books in `postgresql_prepared.py`. Tested on 15.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from contextlib import nullcontext
from functools import partial
from typing import Any

from django.db import DatabaseError
from django.db.backends.utils import CursorWrapper

from django_leases.dialects import horizon
from django_leases.dialects import postgresql_prepared as prepared_claims
from django_leases.dialects import postgresql_statements as statements
from django_leases.dialects.base import (
    DB,
    Dialect,
    Groups,
    Jobs,
    Key,
    R,
    Statement,
    in_transaction,
    match,
)
from django_leases.dialects.statements import Claim, LedgerNames, sqlstate

KEEPALIVE_PROBES = 3
"""TCP keepalive probes of a PostgreSQL connection before it is given up on."""

DJANGO_ONLY = {"context", "cursor_factory", "prepare_threshold", "server_side_binding"}
"""Connection parameters Django adds for its own cursors; a plain listening connection needs
none."""


class PostgreSQL(Dialect):
    name = "postgresql"
    fencing_clock = statements.FENCING_CLOCK
    insert = statements.INSERT
    notifies = True
    completes_at_once = True
    autovacuum = statements.AUTOVACUUM

    def claim(self, jobs: Jobs[R], request: Claim, *, atomic: bool = True) -> list[R]:
        # One statement decides ownership and, with the stock ledger, writes its rows: atomic
        # without a transaction block. A ledger of its own is written by the ORM after it.
        run = jobs.rows
        statement = statements.claim(jobs.table, request, ledger=jobs.ledger)
        if jobs.ledger is None:
            with in_transaction(jobs, atomic):
                claimed: list[R] = run(statement, None)
                jobs.open_attempts(claimed)
            return claimed
        db = jobs.connection
        # Prepared in autocommit only: in a caller's transaction a statement the session lost
        # aborts it.
        if db.in_atomic_block:
            return run(statement, None)
        db.ensure_connection()
        try:
            session = prepared_claims.SESSIONS.get(db.connection) or prepared_claims.start(
                db.connection
            )
        except TypeError:  # a driver connection without weak references: not prepared
            return run(statement, None)
        if session.misses >= prepared_claims.MISSES_ALLOWED:
            return run(statement, None)
        text, params = statement
        shape = tuple(zip(params, map(type, params.values()), strict=True))
        prepared, names = prepared_claims.claim_prepared(text, params["limit"], shape)
        values = {name: params[name] for name in names}
        execute: Statement = (
            (prepared.execute, values)
            if session.quote is None
            else (session.literals.execute(prepared.execute, values, session.quote), None)
        )
        literal = partial(self._cursor, db, server_binding=False)
        for _attempt in range(2):
            now = time.monotonic()
            known = session.statements.get(prepared.name)
            if known is not None and known.left > 0 and known.until > now:
                known.left -= 1
            else:
                prepared_claims.prepare(db, session, prepared, known, now)
            try:
                return run(execute, literal)
            except DatabaseError as exc:
                state = sqlstate(exc)
                if state == prepared_claims.PREPARED_STALE:
                    session.statements[prepared.name].left = 0  # deallocate, prepare again
                    continue
                if state != prepared_claims.PREPARED_GONE:
                    raise
            if prepared_claims.lost(db, session, prepared):
                break
        return run(statement, None)

    def fuses_completion_and_claim(self, ledger: LedgerNames | None) -> bool:
        return ledger is not None

    def completion_block(self, jobs: Jobs[Any]) -> ContextManager[Any]:
        # With the stock ledger one statement completes the jobs without a lock: atomic
        # without a transaction block; the jobs of a lock take one of their own after it.
        if jobs.ledger is None:
            return super().completion_block(jobs)
        return nullcontext()

    def complete_many(self, jobs: Jobs[Any], owner: str, groups: Groups) -> set[Key]:
        if jobs.ledger is None:
            return super().complete_many(jobs, owner, groups)
        # One statement for every group (two array parameters): atomic without a transaction.
        keys = [key for group in groups for key in group.items()]
        pks, tokens = [pk for pk, _ in keys], [token for _, token in keys]
        statement = statements.complete_many(
            jobs.table, jobs.ledger, owner=owner, pks=pks, tokens=tokens
        )
        with self.bound_cursor(jobs.connection) as cursor:
            cursor.execute(*statement)
            return {(pk, token) for pk, token in cursor.fetchall()}

    def complete(
        self, cursor: CursorWrapper, table: str, ledger: LedgerNames, owner: str, key: Key
    ) -> bool:
        pk, token = key
        cursor.execute(*statements.complete(table, ledger, pk=pk, owner=owner, token=token))
        (won,) = cursor.fetchone()
        return bool(won)

    def share_lock_holder(self, table: str, lock: str) -> Statement:
        return statements.share_lock_holder(table, lock=lock)

    def horizon_pin(self) -> Statement | None:
        return horizon.postgresql_pin()

    def notify(self, channel: str, message: str) -> Statement:
        return statements.notify(channel, message)

    def listening(
        self, params: dict[str, Any], channel: str, guard: Callable[[int], ContextManager[Any]]
    ) -> Listening:
        return Listening(params, channel, guard)

    def gate_bounds(self, connection: DB, *, wait: float, idle: float) -> Statement | None:
        return statements.gate_bounds(wait=wait, idle=idle)  # SET LOCAL: ends with it

    def gate_busy(self, exc: BaseException) -> bool:
        return sqlstate(exc) in statements.LOCK_NOT_AVAILABLE

    def gate_holders(self, table: str, *, job_model: str, kind: str) -> Statement | None:
        return statements.gate_holders(table, job_model=job_model, kind=kind)

    def deadlocked(self, exc: BaseException) -> bool:
        return sqlstate(exc) in statements.DEADLOCK_SQLSTATES

    def read_only(self, exc: BaseException) -> bool:
        return sqlstate(exc) in statements.READ_ONLY_SQLSTATES

    def estimated_count(self, connection: DB, table: str, status: str | None) -> int | None:
        with connection.cursor() as cursor:
            cursor.execute(*statements.row_estimate(table, status=status))
            return statements.planned_rows(cursor.fetchone()[0])

    def bound_cursor(self, connection: DB) -> CursorWrapper:
        """A cursor that sends parameters apart from the statement's text where that is what
        prepares it.

        With psycopg 3 the text is then the same at every call, so psycopg prepares it once
        the project allows prepared statements (`"prepare_threshold"` in the database's
        OPTIONS, Django's switch, off by default for connection poolers): the server then
        parses and plans the lease layer's statements once per connection, not once per job.
        Without that option, Django's client-binding cursor, which can carry the worker's
        statement timeout (`StatementTimeout`); with psycopg 2, Django's usual cursor.
        """
        options = connection.settings_dict.get("OPTIONS") or {}
        prepares = options.get("prepare_threshold") is not None
        return self._cursor(connection, server_binding=prepares)

    def literal_cursor(self, connection: DB) -> CursorWrapper:
        """What an EXECUTE of a prepared statement needs, which takes no bind parameters,
        whatever Django's `server_side_binding` option says."""
        return self._cursor(connection, server_binding=False)

    def _cursor(self, connection: DB, *, server_binding: bool) -> CursorWrapper:
        # psycopg 3's cursor classes, as Django defines them; psycopg 2 has neither.
        from django.db.backends.postgresql import base

        factory = getattr(base, "ServerBindingCursor" if server_binding else "Cursor", None)
        if factory is None:
            return connection.cursor()
        connection.close_if_health_check_failed()
        connection.ensure_connection()
        connection.validate_thread_sharing()
        with connection.wrap_database_errors:
            cursor: Any = factory(connection.connection)
        if connection.queries_logged:
            return connection.make_debug_cursor(cursor)
        return connection.make_cursor(cursor)

    def network_options(self, timeout: float) -> dict[str, Any]:
        seconds = max(1, math.ceil(timeout))
        return {
            # libpq reads connect_timeout in whole seconds and takes 1 as 2.
            "connect_timeout": max(2, seconds),
            # An idle connection is probed after half the timeout and given up on by the end.
            "keepalives": 1,
            "keepalives_idle": max(1, seconds // 2),
            "keepalives_interval": max(1, seconds // (2 * KEEPALIVE_PROBES)),
            "keepalives_count": KEEPALIVE_PROBES,
            # Data sent and not acknowledged for this long (ms) closes the connection.
            "tcp_user_timeout": seconds * 1000,
        }

    def statement_timeout(self, timeout: float, user: dict[str, Any]) -> int | None:
        if "statement_timeout" in str(user.get("options") or ""):
            return None
        return round(timeout * 1000)

    def bound_transactions(self, connection: DB, milliseconds: int) -> None:
        # psycopg 3's client-binding cursors carry it; psycopg 2 has the watchdog alone.
        if hasattr(connection.Database, "ClientCursor"):  # type: ignore[attr-defined]
            connection.execute_wrappers.append(StatementTimeout(connection, milliseconds))

    def misconfiguration(
        self, exc: BaseException, text: str, *, connecting: bool = False
    ) -> str | None:
        state = sqlstate(exc)
        if state is not None:
            return statements.MISCONFIGURED_SQLSTATES.get(state)
        return match(statements.MISCONFIGURED_MESSAGES, text)


class StatementTimeout:
    """An execute wrapper that bounds each transaction of a PostgreSQL connection on the server.

    The first statement of a transaction (any statement in autocommit), when a client-binding
    cursor sends it (Django's default with psycopg 3), goes as `SET LOCAL statement_timeout =
    <ms>; <statement>`: one simple query, so one implicit transaction in autocommit, in which
    PostgreSQL bounds the statement after the SET. A later statement of a transaction keeps the
    bound, or whatever the transaction set itself since; an aborted transaction gets nothing, so
    that its ROLLBACK TO SAVEPOINT still runs.

    Set at the start of each transaction, in the same round trip as its first statement, not as
    the `options` startup parameter, which a connection pooler may refuse (PgBouncer's default
    configuration does) or drop; a transaction pooler runs each transaction on one server
    session, so the bound goes wherever it goes. Statements sent apart from their parameters (a
    project's `prepare_threshold`) cannot carry it: the watchdog alone bounds them.
    """

    def __init__(self, connection: DB, milliseconds: int) -> None:
        self.prefix = statements.statement_timeout(milliseconds)
        driver: Any = connection.Database  # type: ignore[attr-defined]
        self.client_cursor: type[Any] = driver.ClientCursor
        self.idle = driver.pq.TransactionStatus.IDLE  # between transactions

    def __call__(
        self,
        execute: Callable[..., Any],
        sql: str,
        params: Any,
        many: bool,
        context: dict[str, Any],
    ) -> Any:
        cursor = context["cursor"].cursor
        if (
            many
            or not isinstance(sql, str)
            or not isinstance(cursor, self.client_cursor)
            or cursor.connection.info.transaction_status != self.idle
            or statements.OUTSIDE_TRANSACTIONS.match(sql)
        ):
            return execute(sql, params, many, context)
        result = execute(self.prefix + sql, params, many, context)
        cursor.nextset()  # from the SET's result to the statement's own
        return result


class Listening:
    """A dedicated autocommit psycopg 3 connection, of a Django connection's parameters
    (`get_connection_params()`, less those of Django's own cursors), that LISTENs on one
    channel; on any error (`error`) the caller closes it and connects again later."""

    def __init__(
        self, params: dict[str, Any], channel: str, guard: Callable[[int], ContextManager[Any]]
    ) -> None:
        # Imported here: psycopg is an optional dependency, needed only by PostgreSQL users.
        import psycopg

        self._psycopg = psycopg
        self.error: type[Exception] = psycopg.Error
        self._params = {key: value for key, value in params.items() if key not in DJANGO_ONLY}
        self._channel = channel
        self._guard = guard
        self._conn: Any = None

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def connect(self) -> None:
        """Connect (bounded by the parameters' `connect_timeout`), then `listen()`."""
        self._conn = self._psycopg.connect(autocommit=True, **self._params)
        self.listen()

    def listen(self) -> None:
        """LISTEN on the channel, bounded by `guard` (the watchdog's, on the socket)."""
        with self._guard(self._conn.fileno()):
            self._conn.execute(statements.listen(self._channel))

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for a notification; return whether one came."""
        return any(True for _ in self._conn.notifies(timeout=timeout, stop_after=1))

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None
