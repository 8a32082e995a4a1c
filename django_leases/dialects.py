"""Each database's differences for the lease layer, chosen once per connection.

Django's own pattern (`connection.ops`): `dialect_of(connection)` picks the `Dialect` of the
connection's backend the first time it is asked and keeps it beside that connection. Every
difference between PostgreSQL, SQLite and MariaDB/MySQL that django-leases makes is a member of
it: the claim's path and raw statements (PostgreSQL's run as prepared statements of the session,
kept by `sessions`), the batched and single completions, the enqueue's read
of a lock holder, NOTIFY, row estimates, deadlock and configuration error codes, the fencing
clock, the INSERT's words, the cursors, the network options. Nowhere else in the package is the
backend named. The statements themselves are in `sql/`; a dialect only chooses among them.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterable
from functools import partial
from typing import Any, ClassVar, Literal
from weakref import WeakKeyDictionary

from django.db import DatabaseError, NotSupportedError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from django_leases import passes, sessions, sql
from django_leases.passes import R, Run, Statement
from django_leases.sql import Claim, horizon, mysql, postgresql, sqlite
from django_leases.sql import prepared as statements
from django_leases.sql.insert import InsertDialect
from django_leases.sql.postgresql import LedgerNames

ClaimPath = Literal["postgresql+ledger", "postgresql", "sqlite", "mysql+ledger", "mysql", "orm"]
"""How a claim runs: PostgreSQL's one statement (with the ledger's CTEs, or the ledger written
after it), SQLite's UPDATE ... RETURNING passes, MariaDB/MySQL's passes of row locks, UPDATE and
read-back (with the ledger's rows, or the ledger written after them), or the ORM's SELECT ...
FOR UPDATE SKIP LOCKED then conditional UPDATE (the specification the others are tested
against). A path named "+ledger" writes the stock ledger's rows in its own statements."""

KEEPALIVE_PROBES = 3
"""TCP keepalive probes of a PostgreSQL connection before it is given up on."""

DB = BaseDatabaseWrapper
"""A Django connection."""
Ledger = LedgerNames | None
"""The stock ledger's names, or None: no ledger, or a ledger of its own."""
Key = tuple[int, int]
Groups = list[dict[int, int]]
"""Leases as `querysets.base.key_groups()` splits them: {job id: token} a statement each."""


class Dialect:
    """The differences of one database backend; this base is what a backend without a fast
    path does (the ORM's statements, no NOTIFY, no estimates, no deadlock retries)."""

    name: ClassVar[str]
    fencing_clock: ClassVar[str]
    """The database clock in microseconds since the epoch: the floor of every new token."""
    insert: ClassVar[InsertDialect]
    notifies: ClassVar[bool] = False
    """Whether enqueues are announced with NOTIFY and workers LISTEN."""
    prepares: ClassVar[bool] = False
    """Whether the claim runs as a named prepared statement (`PostgreSQL.claim()`)."""
    completes_at_once: ClassVar[bool] = False
    """Whether `complete()` has a one-statement completion with the ledger (`complete()`)."""
    session_clock: ClassVar[str | None] = None
    """The statement reading the session's time zone, where NOW() depends on it."""
    autovacuum: ClassVar[str | None] = None
    """The statement reading whether the server vacuums by itself, where it can be off."""

    def claim_path(self, ledger: LedgerNames | None) -> ClaimPath:
        """The claim's path, given the stock ledger's names (None: no ledger, or its own)."""
        return "orm"

    def complete_many_path(self, ledger: LedgerNames | None) -> ClaimPath:
        """The batched completion's path: the raw statements write the stock ledger only."""
        return "orm"

    def claim(self, run: Run[R], table: str, claim: Claim, ledger: Ledger, db: DB) -> list[R]:
        """Claim on `db` with this database's raw statements, each run by `run` (rows to
        models)."""
        raise NotSupportedError(f"{self.name} claims through the ORM path")

    def complete(
        self, cursor: CursorWrapper, table: str, ledger: LedgerNames, owner: str, key: Key
    ) -> bool:
        """Complete a job without a lock and close its ledger row in one statement; return
        whether it won. Only where `completes_at_once`."""
        raise NotSupportedError(f"{self.name} completes through the ORM")

    def complete_many(
        self, cursor: CursorWrapper, table: str, ledger: LedgerNames, owner: str, groups: Groups
    ) -> set[Key]:
        """Complete the held jobs without a lock of `groups` ({job id: token} each, as
        `querysets.base.key_groups()` splits them) and close their ledger rows; return the
        (job id, token) pairs completed. Only on a `complete_many_path()` other than "orm"."""
        raise NotSupportedError(f"{self.name} completes batches through the ORM path")

    def share_lock_holder(self, table: str, lock: str) -> Statement:
        """The enqueue's read of the job holding `lock`, holding that row until commit."""
        return sqlite.share_lock_holder(table, lock=lock)

    def gate_bounds(self, connection: DB, *, wait: float, idle: float) -> Statement | None:
        """The statement, first in a kind's gated claim transaction, that bounds its wait for
        a lock by `wait` seconds and its session's idle time in it by `idle` seconds; None
        where the server has neither (SQLite: its busy timeout bounds the wait)."""
        return None

    def gate_bounds_restored(self, connection: DB) -> Statement | None:
        """The statement, after the gated transaction, that undoes `gate_bounds()`; None if
        they ended with the transaction."""
        return None

    def gate_busy(self, exc: BaseException) -> bool:
        """Whether `exc` says a kind's gate was waited for past its bound."""
        return sqlite.LOCKED.search(str(exc)) is not None

    def gate_holders(self, table: str, *, job_model: str, kind: str) -> Statement | None:
        """The read of the sessions holding a kind's gate (SQLite: the writer holding the
        database's write lock, which it does not name); None where there is none."""
        return None

    def horizon_pin(self) -> Statement | None:
        """The statement reading what holds back the removal of dead rows (`sql.horizon`), or
        None where nothing does (SQLite)."""
        return None

    def notify(self, channel: str, message: str) -> Statement:
        raise NotSupportedError(f"{self.name} has no NOTIFY")

    def deadlocked(self, exc: BaseException) -> bool:
        """Whether the database rolled the transaction back to break a deadlock or lock wait."""
        return False

    def read_only(self, exc: BaseException) -> bool:
        """Whether the server refused a write because it takes none now (a standby)."""
        return False

    def estimated_count(
        self, connection: BaseDatabaseWrapper, table: str, status: str | None
    ) -> int | None:
        """The database's estimate of `table`'s rows (in `status`), or None: it keeps none."""
        return None

    def cursor(self, connection: BaseDatabaseWrapper, *, server_binding: bool) -> CursorWrapper:
        """A cursor of `connection`, binding parameters on the server if `server_binding` and
        the driver can; through Django's cursor wrapper either way."""
        return connection.cursor()

    def network_options(self, timeout: float) -> dict[str, Any]:
        """The connection `OPTIONS` that bound every network wait by `timeout` seconds."""
        return {}

    def statement_timeout(self, timeout: float, user: dict[str, Any]) -> int | None:
        """The server's per-statement timeout (ms) for a network timeout of `timeout` seconds
        and the project's `OPTIONS` `user`; None where it has none or the project set one."""
        return None

    def misconfiguration(
        self, exc: BaseException, text: str, *, connecting: bool = False
    ) -> str | None:
        """What `exc` (its message `text`; raised while `connecting`, or by a statement) says is
        misconfigured: "NAME", "USER", "PASSWORD", "OPTIONS" or `sql.MIGRATE`; None for
        anything else (an outage)."""
        return None


class PostgreSQL(Dialect):
    name = "postgresql"
    fencing_clock = postgresql.FENCING_CLOCK
    insert = postgresql.INSERT
    notifies = True
    prepares = True
    completes_at_once = True
    autovacuum = postgresql.AUTOVACUUM

    def claim_path(self, ledger: LedgerNames | None) -> ClaimPath:
        return "postgresql+ledger" if ledger is not None else "postgresql"

    def complete_many_path(self, ledger: LedgerNames | None) -> ClaimPath:
        return "orm" if ledger is None else "postgresql+ledger"

    def claim(self, run: Run[R], table: str, claim: Claim, ledger: Ledger, db: DB) -> list[R]:
        # One statement decides ownership (with `ledger`, writes its rows), prepared (below) in
        # autocommit only: in a caller's transaction a statement the session lost aborts it.
        statement = postgresql.claim(table, claim, ledger=ledger)
        if db.in_atomic_block:
            return run(statement, None)
        db.ensure_connection()
        try:
            session = sessions.SESSIONS.get(db.connection) or sessions.start(db.connection)
        except TypeError:  # a driver connection without weak references: not prepared
            return run(statement, None)
        if session.misses >= sessions.MISSES_ALLOWED:
            return run(statement, None)
        text, params = statement
        shape = tuple(zip(params, map(type, params.values()), strict=True))
        prepared, names = statements.claim_prepared(text, params["limit"], shape)
        values = {name: params[name] for name in names}
        execute: Statement = (
            (prepared.execute, values)
            if session.quote is None
            else (session.literals.execute(prepared.execute, values, session.quote), None)
        )
        literal = partial(self.cursor, db, server_binding=False)
        for _attempt in range(2):
            now = time.monotonic()
            known = session.statements.get(prepared.name)
            if known is not None and known.left > 0 and known.until > now:
                known.left -= 1
            else:
                sessions.prepare(db, session, prepared, known, now)
            try:
                return run(execute, literal)
            except DatabaseError as exc:
                state = sql.sqlstate(exc)
                if state == statements.PREPARED_STALE:
                    session.statements[prepared.name].left = 0  # deallocate, prepare again
                    continue
                if state != statements.PREPARED_GONE:
                    raise
            if sessions.lost(db, session, prepared):
                break
        return run(statement, None)

    def complete(
        self, cursor: CursorWrapper, table: str, ledger: LedgerNames, owner: str, key: Key
    ) -> bool:
        pk, token = key
        cursor.execute(*postgresql.complete(table, ledger, pk=pk, owner=owner, token=token))
        (won,) = cursor.fetchone()
        return bool(won)

    def complete_many(
        self, cursor: CursorWrapper, table: str, ledger: LedgerNames, owner: str, groups: Groups
    ) -> set[Key]:
        # One statement for every group (two array parameters): atomic without a transaction.
        keys = [key for group in groups for key in group.items()]
        pks, tokens = [pk for pk, _ in keys], [token for _, token in keys]
        statement = postgresql.complete_many(table, ledger, owner=owner, pks=pks, tokens=tokens)
        cursor.execute(*statement)
        return {(pk, token) for pk, token in cursor.fetchall()}

    def share_lock_holder(self, table: str, lock: str) -> Statement:
        return postgresql.share_lock_holder(table, lock=lock)

    def horizon_pin(self) -> Statement | None:
        return horizon.postgresql_pin()

    def notify(self, channel: str, message: str) -> Statement:
        return postgresql.notify(channel, message)

    def gate_bounds(self, connection: DB, *, wait: float, idle: float) -> Statement | None:
        return postgresql.gate_bounds(wait=wait, idle=idle)  # SET LOCAL: ends with it

    def gate_busy(self, exc: BaseException) -> bool:
        return sql.sqlstate(exc) in postgresql.LOCK_NOT_AVAILABLE

    def gate_holders(self, table: str, *, job_model: str, kind: str) -> Statement | None:
        return postgresql.gate_holders(table, job_model=job_model, kind=kind)

    def deadlocked(self, exc: BaseException) -> bool:
        return sql.sqlstate(exc) in postgresql.DEADLOCK_SQLSTATES

    def read_only(self, exc: BaseException) -> bool:
        return sql.sqlstate(exc) in postgresql.READ_ONLY_SQLSTATES

    def estimated_count(
        self, connection: BaseDatabaseWrapper, table: str, status: str | None
    ) -> int | None:
        with connection.cursor() as cursor:
            cursor.execute(*postgresql.row_estimate(table, status=status))
            return postgresql.planned_rows(cursor.fetchone()[0])

    def cursor(self, connection: BaseDatabaseWrapper, *, server_binding: bool) -> CursorWrapper:
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

    def misconfiguration(
        self, exc: BaseException, text: str, *, connecting: bool = False
    ) -> str | None:
        state = sql.sqlstate(exc)
        if state is not None:
            return postgresql.MISCONFIGURED_SQLSTATES.get(state)
        return _match(postgresql.MISCONFIGURED_MESSAGES, text)


class SQLite(Dialect):
    name = "sqlite"
    fencing_clock = sqlite.FENCING_CLOCK
    insert = sqlite.INSERT

    def claim_path(self, ledger: LedgerNames | None) -> ClaimPath:
        return "sqlite"

    def complete_many_path(self, ledger: LedgerNames | None) -> ClaimPath:
        return "orm" if ledger is None else "sqlite"

    def claim(self, run: Run[R], table: str, claim: Claim, ledger: Ledger, db: DB) -> list[R]:
        return passes.in_passes(
            claim.limit,
            lambda limit, takeover: run(sqlite.claim_pass(table, claim, limit, takeover), None),
        )

    def complete_many(
        self, cursor: CursorWrapper, table: str, ledger: LedgerNames, owner: str, groups: Groups
    ) -> set[Key]:
        # In the caller's transaction: each group's completions, then their ledger rows.
        done: set[Key] = set()
        for group in groups:
            cursor.execute(*sqlite.complete_many(table, owner=owner, pairs=list(group.items())))
            won = [(pk, token) for pk, token in cursor.fetchall()]
            if won:
                cursor.execute(*sqlite.close_completed(table, ledger, owner=owner, pairs=won))
            done.update(won)
        return done

    def misconfiguration(
        self, exc: BaseException, text: str, *, connecting: bool = False
    ) -> str | None:
        return _match(sqlite.MISCONFIGURED_MESSAGES, text)


class MySQL(Dialect):
    name = "mysql"
    fencing_clock = mysql.FENCING_CLOCK
    insert = mysql.INSERT
    session_clock = mysql.SESSION_CLOCK

    def claim_path(self, ledger: LedgerNames | None) -> ClaimPath:
        return "mysql+ledger" if ledger is not None else "mysql"

    def complete_many_path(self, ledger: LedgerNames | None) -> ClaimPath:
        return "orm" if ledger is None else "mysql+ledger"

    def claim(self, run: Run[R], table: str, claim: Claim, ledger: Ledger, db: DB) -> list[R]:
        with db.cursor() as cursor:
            return passes.locking_passes(cursor, run, table, claim, ledger)

    def complete_many(
        self, cursor: CursorWrapper, table: str, ledger: LedgerNames, owner: str, groups: Groups
    ) -> set[Key]:
        # In the caller's transaction, as the ORM path: lock the rows still held (no UPDATE
        # ... RETURNING to say which won), complete exactly those, close their ledger rows.
        done: set[Key] = set()
        for group in groups:
            cursor.execute(*mysql.lock_held(table, owner=owner, group=group))
            held = dict(cursor.fetchall())
            if held:
                cursor.execute(*mysql.complete_held(table, owner=owner, group=held))
                cursor.execute(*mysql.close_completed(table, ledger, owner=owner, group=held))
                done.update(held.items())
        return done

    def share_lock_holder(self, table: str, lock: str) -> Statement:
        return mysql.share_lock_holder(table, lock=lock)

    def horizon_pin(self) -> Statement | None:
        return horizon.mysql_pin()

    def gate_bounds(self, connection: DB, *, wait: float, idle: float) -> Statement | None:
        return mysql.gate_bounds(wait=wait, idle=idle, mariadb=_mariadb(connection))

    def gate_bounds_restored(self, connection: DB) -> Statement | None:
        return mysql.gate_bounds_restored(mariadb=_mariadb(connection))

    def gate_busy(self, exc: BaseException) -> bool:
        return bool(exc.args) and exc.args[0] == mysql.LOCK_WAIT_TIMEOUT

    def gate_holders(self, table: str, *, job_model: str, kind: str) -> Statement | None:
        return mysql.GATE_HOLDERS, None

    def deadlocked(self, exc: BaseException) -> bool:
        return bool(exc.args) and exc.args[0] in mysql.DEADLOCK_ERRORS

    def read_only(self, exc: BaseException) -> bool:
        return bool(exc.args) and exc.args[0] in mysql.READ_ONLY_ERRORS

    def estimated_count(
        self, connection: BaseDatabaseWrapper, table: str, status: str | None
    ) -> int | None:
        with connection.cursor() as cursor:

            def planned(**where: Any) -> int:
                cursor.execute(*mysql.row_estimate(table, **where))
                columns = [column[0] for column in cursor.description]
                return mysql.planned_rows(columns, cursor.fetchone())

            if status is None:
                return planned()
            equal, other_than = planned(status=status), planned(status=status, other_than=True)
            return mysql.status_estimate(equal, other_than, planned())

    def network_options(self, timeout: float) -> dict[str, Any]:
        seconds = max(1, math.ceil(timeout))
        return {"connect_timeout": seconds, "read_timeout": seconds, "write_timeout": seconds}

    def misconfiguration(
        self, exc: BaseException, text: str, *, connecting: bool = False
    ) -> str | None:
        code = exc.args[0] if exc.args else None
        if not isinstance(code, int):
            return None
        if connecting and code in mysql.MISCONFIGURED_WHILE_CONNECTING:
            return "OPTIONS"
        return mysql.MISCONFIGURED_ERRORS.get(code)


DIALECTS: dict[str, Dialect] = {d.name: d for d in (PostgreSQL(), SQLite(), MySQL())}
"""The dialect of each backend Django names (`connection.vendor`)."""

_chosen: WeakKeyDictionary[BaseDatabaseWrapper, Dialect] = WeakKeyDictionary()


def dialect_of(connection: BaseDatabaseWrapper) -> Dialect:
    """Return the dialect of `connection`, chosen at its first use and kept beside it.

    Raises:
        NotSupportedError: for a backend django-leases does not run on.
    """
    chosen = _chosen.get(connection)
    if chosen is None:
        chosen = _chosen[connection] = named(connection.vendor)
    return chosen


def named(name: str) -> Dialect:
    """Return the dialect of the backend Django calls `name` ("postgresql", "sqlite", "mysql").

    Raises:
        NotSupportedError: for a backend django-leases does not run on.
    """
    try:
        return DIALECTS[name]
    except KeyError:
        raise NotSupportedError(f"django-leases does not run on {name}") from None


def deadlocked(exc: BaseException, vendor: str) -> bool:
    """Whether the `vendor` database rolled the transaction back to break a deadlock or lock
    wait (`Dialect.deadlocked`)."""
    return named(vendor).deadlocked(exc)


def _mariadb(connection: BaseDatabaseWrapper) -> bool:
    return bool(getattr(connection, "mysql_is_mariadb", False))


def _match(patterns: Iterable[tuple[re.Pattern[str], str]], text: str) -> str | None:
    return next((what for pattern, what in patterns if pattern.search(text)), None)
