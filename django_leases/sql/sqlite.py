"""SQLite statements: one pass of the claim, the batched completion, the enqueue's read of a
lock holder. Needs SQLite 3.35+ for RETURNING."""

import re
from collections.abc import Sequence
from typing import Any

from django_leases.sql import MIGRATE, Claim, completed_attempts, lease_length, literal
from django_leases.sql.insert import InsertDialect
from django_leases.sql.merge import merge_keys
from django_leases.sql.postgresql import LedgerNames
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


INSERT = InsertDialect(
    skip_suffix="ON CONFLICT DO NOTHING",
    now_plus="STRFTIME('%%Y-%%m-%%d %%H:%%M:%%f', 'NOW', %(delay)s)",
    delay=_modifier,
    parameters=999,
)
"""The enqueue's INSERT (`sql.insert.insert_jobs`): the upsert clause skips unique conflicts
only, unlike INSERT OR IGNORE; RETURNING needs SQLite 3.35+. At most 999 parameters (SQLite's
limit before 3.32, Django 5.2's), whatever the limit is now: SQLite finds a named parameter by a
search of those before it, so a statement of n of them takes ~n² steps (20,000 jobs in
statements of 40,000 parameters: 3,600 jobs/s; of 999: 32,000)."""


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
    picked = _picked(table, f"{predicate} AND attempts < max_attempts {guard_sql}", order, kinds)
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


def _picked(table: str, where: str, order: str, kinds: tuple[str, Params]) -> str:
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
        return f"""
            SELECT id FROM {table} WHERE {where} {kind_sql}
            ORDER BY {order} LIMIT %(limit)s"""  # noqa: S608 - names quoted by the caller
    keys, by_key = merge_keys(order.split(", "))
    arms = " UNION ALL ".join(
        f"SELECT * FROM (SELECT {keys} FROM {table} WHERE {where} AND kind = %({name})s"  # noqa: S608
        f" ORDER BY {order} LIMIT %(limit)s)"
        for name in named
    )
    return f"SELECT key_id FROM ({arms}) ORDER BY {by_key} LIMIT %(limit)s"  # noqa: S608


LOCKED = re.compile(r"database (table )?is locked")
"""SQLite's error once its busy timeout passed while another connection held the write lock."""

# What a missing table or database file says (`dialects.SQLite.misconfiguration`).
MISCONFIGURED_MESSAGES = (
    (re.compile(r"no such (table|column)"), MIGRATE),
    (re.compile(r"unable to open database file"), "NAME"),
)
