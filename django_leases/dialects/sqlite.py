"""SQLite's dialect and its statements: one pass of the claim, the batched completion, the
enqueue's read of a lock holder, its errors. Needs SQLite 3.35+ for RETURNING."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from django.db.backends.utils import CursorWrapper

from django_leases.dialects.base import (
    DB,
    Dialect,
    Groups,
    Jobs,
    Key,
    R,
    Statement,
    in_passes,
    in_transaction,
    match,
)
from django_leases.dialects.insert import InsertDialect
from django_leases.dialects.merge import merge_keys
from django_leases.dialects.statements import (
    MIGRATE,
    Claim,
    LedgerNames,
    completed_attempts,
    lease_length,
    literal,
)
from django_leases.status import COMPLETED, PENDING, PROCESSING

Params = dict[str, Any]

NOW = "STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW')"
"""The database clock, in the text format Django stores datetimes in (UTC)."""

FENCING_CLOCK = (
    "(CAST(STRFTIME('%%s', 'NOW') AS INTEGER) * 1000000"
    " + CAST(SUBSTR(STRFTIME('%%f', 'NOW'), 4) AS INTEGER) * 1000)"
)
"""The database clock in microseconds since the epoch (SQLite's clock has milliseconds; its
`unixepoch('subsec')` needs 3.42): the floor of every new fencing token."""


def _modifier(seconds: float) -> str:
    """Return `seconds` as a modifier of SQLite's date functions."""
    return f"+{seconds:.6f} seconds"


def pairs_in(columns: str, pairs: Sequence[tuple[int, int]]) -> tuple[str, Params]:
    """Return `(a, b) IN (VALUES (...), ...)` for `pairs` ((pk, token) each), two parameters
    each: a row-value list, never a chain of ORs (SQLite refuses expressions deeper than 1000)."""
    rows = ", ".join(f"(%(pk_{i})s, %(token_{i})s)" for i in range(len(pairs)))
    params: Params = {}
    for i, (pk, token) in enumerate(pairs):
        params[f"pk_{i}"], params[f"token_{i}"] = pk, token
    return f"({columns}) IN (VALUES {rows})", params


def complete_many(
    table: str, *, owner: str, pairs: Sequence[tuple[int, int]]
) -> tuple[str, Params]:
    """Return the completion of a batch of jobs without a lock: one UPDATE, each row still
    conditional on its own id, status, owner and fencing token, RETURNING the rows that won
    (the caller closes their ledger rows in the same transaction)."""
    held, params = pairs_in("id, lease_token", pairs)
    sql = f"""
        UPDATE {table}
        SET status = {literal(COMPLETED)}, completed_at = {NOW}, last_error = ''
        WHERE {held} AND status = {literal(PROCESSING)} AND lease_owner = %(owner)s
          AND "lock" = '' AND dependents IS NULL
        RETURNING id, lease_token
    """  # noqa: S608 - names quoted by the caller, values are parameters
    return sql, {**params, "owner": owner}


def close_completed(
    table: str, ledger: LedgerNames, *, owner: str, pairs: Sequence[tuple[int, int]]
) -> tuple[str, Params]:
    """Return the closing of the open ledger rows of `pairs` ((job id, token) each) as
    completed by `owner`, each keeping its job's checkpoint: one UPDATE for the whole batch."""
    held, params = pairs_in(f"{ledger.job_ref}, {ledger.token}", pairs)
    sql = f"""
        UPDATE {ledger.table} {completed_attempts(table, ledger, NOW)}
        WHERE {held} AND {ledger.ended_at} IS NULL
    """  # noqa: S608 - names quoted by the caller, values are parameters
    return sql, {**params, "owner": owner}


SKIP_CONFLICTS = "ON CONFLICT DO NOTHING"
"""The clause after an INSERT's values that leaves out the rows a unique index refuses."""

INSERT = InsertDialect(
    now_plus="STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', %(delay)s)",
    delay=_modifier,
    parameters=999,
)
"""The enqueue's INSERT (`insert.insert_jobs`): the upsert clause skips unique conflicts
only, unlike INSERT OR IGNORE (`SQLite.insert_skipping()`); RETURNING needs SQLite 3.35+. At
most 999 parameters (SQLite's limit before 3.32, Django 5.2's), whatever the limit is now:
SQLite finds a named parameter by a search of those before it, so a statement of n of them
takes ~n² steps (20,000 jobs in statements of 40,000 parameters: 3,600 jobs/s; of 999:
32,000)."""


def share_lock_holder(table: str, *, lock: str) -> tuple[str, Params]:
    """Return the enqueue's read of the job holding `lock`. No row locks: the enqueue's
    transaction holds SQLite's write lock already (IMMEDIATE), which serialises it with the
    holder's finishing transaction."""
    return f"SELECT id FROM {table} WHERE lock_holder = %(lock)s", {"lock": lock}  # noqa: S608


def claim_pass(table: str, claim: Claim, limit: int, takeover: bool) -> tuple[str, Params]:
    """Return one pass of the claim of at most `limit` jobs: expired leases (`takeover`, not
    the ones `claim.guard` leaves to the watcher) or due pending jobs.

    SQLite runs one writer at a time and evaluates the IN (... LIMIT n) subquery once into a
    temporary table, so this single statement claims at most `limit` rows and no two
    connections can claim one row. The UPDATE is the transaction's first statement, so it takes
    the write lock at once (waiting up to the busy timeout) instead of failing to upgrade a read
    lock.
    """
    kinds = claim.kinds
    guard_sql, guard_params = claim.guard if takeover else ("", {})
    if takeover:
        predicate = f"status = {literal(PROCESSING)} AND lease_until < {NOW}"
        order = "lease_until"
    else:
        # `+run_at`: once ANALYZE has run, SQLite would rather range-scan run_at and sort every
        # due job; the unary plus keeps it walking the due index in claim order.
        predicate = f"status = {literal(PENDING)} AND +run_at <= {NOW}"
        order = "priority DESC, run_at, id"
    where = f"{predicate} AND attempts < max_attempts {guard_sql}"
    picked = _picked(table, where, order, kinds, claim.paused)
    length_sql, length_params = lease_length(claim.lengths, "kind", "%(lease)s", _modifier)
    sql = f"""
        UPDATE {table}
        SET status = {literal(PROCESSING)},
            lease_owner = %(owner)s,
            lease_until = STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', {length_sql}),
            heartbeat_at = {NOW},
            lease_token = MAX(lease_token + 1, {FENCING_CLOCK}),
            attempts = attempts + 1
        WHERE id IN ({picked}
        )
        RETURNING *
    """  # noqa: S608 - names quoted by the caller, values are parameters
    params = {
        **kinds[1],
        **guard_params,
        **length_params,
        "owner": claim.owner,
        "lease": _modifier(claim.seconds),
        "limit": limit,
    }
    return sql, params


def _picked(table: str, where: str, order: str, kinds: tuple[str, Params], paused: str) -> str:
    """Return the ids of the first `limit` rows matching `where` and `kinds`, in `order`.

    Every kind, or one: one ordered range of a partial index. Several kinds: SQLite would walk
    the index led by `status` filtering on kind, past every other kind's backlog, so each kind's
    first `limit` rows come from its own range of the index led by `kind` and the outer SELECT
    orders and limits those (no row locks to skip here: one writer at a time).
    """
    kind_sql, kind_params = kinds
    # Every kind but some (`other_kind_*`, `kind NOT IN (...)`) is one range too.
    named = [name for name in kind_params if name.startswith("kind_")]
    if len(named) < 2:
        limit = _limit(named[0] if named else None, paused)
        return f"""
            SELECT id FROM {table} WHERE {where} {kind_sql}
            ORDER BY {order} LIMIT {limit}"""  # noqa: S608 - names quoted by the caller
    keys, by_key = merge_keys(order.split(", "))
    arms = " UNION ALL ".join(
        f"SELECT * FROM (SELECT {keys} FROM {table} WHERE {where} AND kind = %({name})s"  # noqa: S608
        f" ORDER BY {order} LIMIT {_limit(name, paused)})"
        for name in named
    )
    return f"SELECT key_id FROM ({arms}) ORDER BY {by_key} LIMIT %(limit)s"  # noqa: S608


def _limit(kind: str | None, paused: str) -> str:
    """Return the LIMIT of a range of one kind (`kind`, its parameter's name): 0 if that kind is
    paused (`paused`, the subquery). SQLite computes a LIMIT once, before it reads a row, but
    tests a condition that names no column on each row it reads: as a WHERE term, the paused
    check walked the kind's whole backlog (50-70 ms a claim at 100k jobs,
    bench/paused_claims.py)."""
    if kind is None or not paused:
        return "%(limit)s"
    return f"(CASE WHEN %({kind})s IN ({paused}) THEN 0 ELSE %(limit)s END)"


LOCKED = re.compile(r"database (table )?is locked")
"""SQLite's error once its busy timeout passed while another connection held the write lock."""

# What a missing table or database file says (`dialects.SQLite.misconfiguration`).
MISCONFIGURED_MESSAGES = (
    (re.compile(r"no such (table|column)"), MIGRATE),
    (re.compile(r"unable to open database file"), "NAME"),
)


class SQLite(Dialect):
    name = "sqlite"
    fencing_clock = FENCING_CLOCK
    insert = INSERT

    def claim(self, jobs: Jobs[R], request: Claim, *, atomic: bool = True) -> list[R]:
        # Each pass one UPDATE ... RETURNING; the ledger's rows by the ORM, in one transaction.
        run = jobs.rows
        with in_transaction(jobs, atomic):
            claimed: list[R] = in_passes(
                request.limit,
                lambda limit, takeover: run(claim_pass(jobs.table, request, limit, takeover), None),
                takeover=request.takeover,
            )
            jobs.open_attempts(claimed)
        return claimed

    def complete_many(self, jobs: Jobs[Any], owner: str, groups: Groups) -> set[Key]:
        if jobs.ledger is None:
            return super().complete_many(jobs, owner, groups)
        # In `completion_block()`: each group's completions, then their ledger rows.
        done: set[Key] = set()
        cursor: CursorWrapper
        with jobs.connection.cursor() as cursor:
            for group in groups:
                cursor.execute(*complete_many(jobs.table, owner=owner, pairs=list(group.items())))
                won = [(pk, token) for pk, token in cursor.fetchall()]
                if won:
                    cursor.execute(
                        *close_completed(jobs.table, jobs.ledger, owner=owner, pairs=won)
                    )
                done.update(won)
        return done

    def share_lock_holder(self, table: str, lock: str) -> Statement:
        return share_lock_holder(table, lock=lock)

    def insert_skipping(self, connection: DB) -> tuple[str, str]:
        # Not Django's INSERT OR IGNORE, which skips a row that breaks any constraint (NOT
        # NULL, CHECK) as well: only a unique conflict may leave a row out.
        return "INSERT INTO", SKIP_CONFLICTS

    def gate_busy(self, exc: BaseException) -> bool:
        return LOCKED.search(str(exc)) is not None

    def lazy_write_lock(self, options: dict[str, Any]) -> bool:
        return str(options.get("transaction_mode", "")).upper() != "IMMEDIATE"

    def misconfiguration(
        self, exc: BaseException, text: str, *, connecting: bool = False
    ) -> str | None:
        return match(MISCONFIGURED_MESSAGES, text)
