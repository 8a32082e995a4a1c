"""MariaDB/MySQL statements: the claim's passes and the batched completion, with the ledger's
writes, the enqueue's share lock on a lock holder, the database's row estimates. Tested on
MariaDB 10.11.

MariaDB has no `UPDATE ... RETURNING` (it has INSERT/DELETE ... RETURNING) and both refuse a
LIMIT in an IN subquery on the table being updated, so a claim pass is the ORM path's four
statements written out once (`querysets.claims.claim_pass_locking()`, the specification): lock
candidates with `FOR UPDATE SKIP LOCKED` (MariaDB 10.6+, MySQL 8+), the conditional UPDATE
restating the whole predicate, the rows read back (ours: the row locks hold to commit), then the
ledger's rows. A statement's text depends only on its shape (the kinds' and guard's fragments,
how many ids), so it is built once per shape and cached: compiling the ORM's statements per
call was most of a MariaDB worker's CPU.
"""

import math
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

from django_leases.dialects.insert import InsertDialect
from django_leases.dialects.statements import (
    LEDGER_INSERT,
    MIGRATE,
    Claim,
    LedgerNames,
    completed_attempts,
    lease_length,
    literal,
    paused_arm,
)
from django_leases.status import COMPLETED, PENDING, PROCESSING, AttemptOutcome

Params = dict[str, Any]

DEADLOCK_ERRORS = (1205, 1213)
"""1205: lock wait timeout; 1213: deadlock found. InnoDB rolls the transaction back for both."""

READ_ONLY_ERRORS = (1290, 1792, 1836)
"""1290: the server runs with --read-only; 1792: a read-only transaction; 1836: read-only mode.
The server takes no writes now, which a failover or an operator ends."""

FENCING_CLOCK = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"
"""The database clock in microseconds since the epoch, whatever the session's time zone: the
floor of every new fencing token."""

NOW = "CURRENT_TIMESTAMP(6)"
"""The database clock, as Django's `Now()` writes it here (fixed for the whole statement)."""

DUE = f"status = {literal(PENDING)} AND run_at <= {NOW} AND attempts < max_attempts"
"""The claim's predicate of a due job."""

EXPIRED = f"status = {literal(PROCESSING)} AND lease_until < {NOW} AND attempts < max_attempts"
"""The claim's predicate of an expired lease it may take over (before the takeover guard)."""

TAKEOVER_ORDER = "lease_until"
DUE_ORDER = "priority DESC, run_at, id"
"""The claim orders of expired leases (oldest first) and of due jobs, as the ORM path's."""


def pass_where(claim: Claim, takeover: bool) -> tuple[str, Params]:
    """Return the WHERE of a claim pass and its parameters: expired leases the takeover guard
    leaves to claims, or due jobs; of the claim's kinds."""
    kind_sql, kind_params = claim.kinds
    if not takeover:
        return f"{DUE} {kind_sql}", kind_params
    guard_sql, guard_params = claim.guard
    return f"{EXPIRED} {guard_sql} {kind_sql}", {**guard_params, **kind_params}


def merged_kinds(claim: Claim) -> list[str]:
    """Return the kinds of a claim of several kinds (each once, in name order), or [] for a
    claim of one kind, every kind, or every kind but some: those are one range of an index."""
    named = {value for name, value in claim.kinds[1].items() if name.startswith("kind_")}
    return sorted(named) if len(named) > 1 else []


def keyed(name: str, values: Iterable[Any]) -> Params:
    """Return the parameters `name_0`, `name_1`, ... of `values`."""
    return {f"{name}_{i}": value for i, value in enumerate(values)}


@lru_cache(maxsize=64)
def _ids(column: str, count: int) -> str:
    return f"{column} IN ({', '.join(f'%(id_{i})s' for i in range(count))})"


def lock_candidates(table: str, claim: Claim, limit: int, takeover: bool) -> tuple[str, Params]:
    """Return a pass's row locks: up to `limit` ids in claim order, rows another transaction
    holds skipped, never waited for. Every kind, or one: one ordered range of an index."""
    where, params = pass_where(claim, takeover)
    sql = _lock_candidates(table, where, TAKEOVER_ORDER if takeover else DUE_ORDER)
    return sql, {**params, "limit": limit}


@lru_cache(maxsize=64)
def _lock_candidates(table: str, where: str, order: str) -> str:
    return f"""SELECT id FROM {table} WHERE {where}
        ORDER BY {order} LIMIT %(limit)s FOR UPDATE SKIP LOCKED"""  # noqa: S608


def merge_candidates(
    table: str, claim: Claim, kinds: Sequence[str], count: int, takeover: bool
) -> tuple[str, Params]:
    """Return the unlocked read of each of `kinds`' first `count` claimable jobs in claim order,
    from its own range of the index led by `kind`, in one UNION ALL of ordered, limited arms:
    (id, lease_until) rows, or (id, priority, run_at), merged by the caller
    (`merge.in_claim_order()`)."""
    where, params = pass_where(claim, takeover)
    params = {**params, **keyed("merge_kind", kinds), "count": count}
    return _merge_candidates(table, where, len(kinds), takeover, claim.paused), params


@lru_cache(maxsize=64)
def _merge_candidates(table: str, where: str, kinds: int, takeover: bool, paused: str) -> str:
    columns, order = (
        ("id, lease_until", TAKEOVER_ORDER) if takeover else ("id, priority, run_at", DUE_ORDER)
    )
    return " UNION ALL ".join(
        f"(SELECT {columns} FROM {table} WHERE {where} AND kind = %(merge_kind_{i})s"  # noqa: S608
        f" {paused_arm(f'%(merge_kind_{i})s', paused)} ORDER BY {order} LIMIT %(count)s)"
        for i in range(kinds)
    )


def lock_chosen(table: str, claim: Claim, ids: Sequence[int], takeover: bool) -> tuple[str, Params]:
    """Return the row locks of the candidates `ids` that still match the pass, each row another
    transaction holds skipped (a claim of several kinds, `merge_candidates()`)."""
    where, params = pass_where(claim, takeover)
    sql = f"SELECT id FROM {table} WHERE {where} AND {_ids('id', len(ids))} FOR UPDATE SKIP LOCKED"  # noqa: S608
    return sql, {**params, **keyed("id", ids)}


def claim_update(
    table: str, claim: Claim, ids: Sequence[int], takeover: bool
) -> tuple[str, Params]:
    """Return the conditional UPDATE that leases the locked `ids` to the claim's owner: the
    pass's whole predicate restated, `attempts + 1`, a new fencing token and the lease's end
    (the kind's own length, `Claim.lengths`) from the database clock."""
    where, params = pass_where(claim, takeover)
    length_sql, length_params = lease_length(claim.lengths, "kind", "%(lease)s", _micros)
    sql = _claim_update(table, where, length_sql, len(ids))
    return sql, {
        **params,
        **length_params,
        **keyed("id", ids),
        "owner": claim.owner,
        "lease": _micros(claim.seconds),
    }


@lru_cache(maxsize=64)
def _claim_update(table: str, where: str, length_sql: str, count: int) -> str:
    # MariaDB assigns left to right, later terms seeing earlier ones: none reads a column set
    # before it (`lease_token` reads its own old value).
    return f"""UPDATE {table}
        SET status = {literal(PROCESSING)},
            lease_owner = %(owner)s,
            lease_until = {NOW} + INTERVAL ({length_sql}) MICROSECOND,
            heartbeat_at = {NOW},
            lease_token = GREATEST(lease_token + 1, {FENCING_CLOCK}),
            attempts = attempts + 1
        WHERE {where} AND {_ids("id", count)}"""  # noqa: S608


def _micros(seconds: float) -> int:
    """Return `seconds` in whole microseconds, as Django writes a duration here."""
    return round(seconds * 1e6)


def claimed(table: str, owner: str, ids: Sequence[int], takeover: bool) -> tuple[str, Params]:
    """Return the read of the rows of `ids` the claim's UPDATE leased to `owner`, every column,
    in claim order: its own row locks make the read exact until commit."""
    sql = _claimed(table, len(ids), TAKEOVER_ORDER if takeover else DUE_ORDER)
    return sql, {**keyed("id", ids), "owner": owner}


@lru_cache(maxsize=64)
def _claimed(table: str, count: int, order: str) -> str:
    return f"""SELECT * FROM {table}
        WHERE {_ids("id", count)} AND status = {literal(PROCESSING)} AND lease_owner = %(owner)s
        ORDER BY {order}"""  # noqa: S608


def close_taken_over(ledger: LedgerNames, owner: str, ids: Sequence[int]) -> tuple[str, Params]:
    """Return the closing of the open ledger rows of the jobs `ids` a claim took over: their
    holders lost those leases to `owner`. Run before `open_attempts()`, which opens new ones."""
    return _close_taken_over(ledger, len(ids)), {**keyed("id", ids), "owner": owner}


@lru_cache(maxsize=64)
def _close_taken_over(ledger: LedgerNames, count: int) -> str:
    return f"""UPDATE {ledger.table}
        SET {ledger.outcome} = {literal(AttemptOutcome.LEASE_LOST)},
            {ledger.ended_at} = {NOW},
            {ledger.ended_by} = %(owner)s
        WHERE {_ids(ledger.job_ref, count)} AND {ledger.ended_at} IS NULL"""  # noqa: S608


def open_attempts(
    table: str, ledger: LedgerNames, owner: str, ids: Sequence[int], takeover: bool
) -> tuple[str, Params]:
    """Return the INSERT of one open ledger row per job of `ids` that `owner` just claimed, in
    claim order, each from its job's row as the claim left it (attempt, token, lease)."""
    sql = _open_attempts(table, ledger, len(ids), TAKEOVER_ORDER if takeover else DUE_ORDER)
    return sql, {**keyed("id", ids), "owner": owner}


@lru_cache(maxsize=64)
def _open_attempts(table: str, ledger: LedgerNames, count: int, order: str) -> str:
    columns = ", ".join(ledger.columns[name] for name in LEDGER_INSERT)
    return f"""INSERT INTO {ledger.table} ({columns})
        SELECT id, id, attempts, lease_token, %(owner)s, {NOW}, heartbeat_at, lease_until,
               checkpoint, {literal(AttemptOutcome.RUNNING)}, '', '', '', '', ''
        FROM {table}
        WHERE {_ids("id", count)} AND status = {literal(PROCESSING)} AND lease_owner = %(owner)s
        ORDER BY {order}"""  # noqa: S608


def held_keys(count: int) -> str:
    """Return the filter of `count` (job id, token) pairs, `id IN (...) AND lease_token = CASE
    id WHEN ... END` (parameters `id_*`, `token_*`), as the ORM writes `keys_filter()`: every
    row found by its key, never a chain of ORs."""
    return _held_keys("id", "lease_token", count)


@lru_cache(maxsize=64)
def _held_keys(job: str, token: str, count: int) -> str:
    arms = " ".join(f"WHEN %(id_{i})s THEN %(token_{i})s" for i in range(count))
    return f"{_ids(job, count)} AND {token} = CASE {job} {arms} END"


def key_params(group: dict[int, int]) -> Params:
    """Return the parameters of `held_keys()` for `group` ({job id: token})."""
    return {**keyed("id", group), **keyed("token", group.values())}


def lock_held(table: str, *, owner: str, group: dict[int, int]) -> tuple[str, Params]:
    """Return the row locks of the jobs without a lock or dependents of `group` ({job id:
    token}) that `owner` still holds under those tokens: their (id, lease_token) pairs, locked
    until commit, so the completion's UPDATE (`complete_held()`) wins on exactly those."""
    return _lock_held(table, len(group)), {**key_params(group), "owner": owner}


@lru_cache(maxsize=64)
def _lock_held(table: str, count: int) -> str:
    return f"""SELECT id, lease_token FROM {table}
        WHERE {held_keys(count)} AND status = {literal(PROCESSING)} AND lease_owner = %(owner)s
          AND `lock` = '' AND dependents IS NULL
        FOR UPDATE"""  # noqa: S608


def complete_held(table: str, *, owner: str, group: dict[int, int]) -> tuple[str, Params]:
    """Return the completion of the jobs of `group` ({job id: token}) that `lock_held()`
    locked, each row still conditional on its own id, status, owner, token, no lock and no
    dependents."""
    return _complete_held(table, len(group)), {**key_params(group), "owner": owner}


@lru_cache(maxsize=64)
def _complete_held(table: str, count: int) -> str:
    return f"""UPDATE {table}
        SET status = {literal(COMPLETED)}, completed_at = {NOW}, last_error = ''
        WHERE {held_keys(count)} AND status = {literal(PROCESSING)} AND lease_owner = %(owner)s
          AND `lock` = '' AND dependents IS NULL"""  # noqa: S608


def close_completed(
    table: str, ledger: LedgerNames, *, owner: str, group: dict[int, int]
) -> tuple[str, Params]:
    """Return the closing of the open ledger rows of `group` ({job id: token}) as completed by
    `owner`, each keeping its job's checkpoint."""
    return _close_completed(table, ledger, len(group)), {**key_params(group), "owner": owner}


@lru_cache(maxsize=64)
def _close_completed(table: str, ledger: LedgerNames, count: int) -> str:
    keys = _held_keys(ledger.job_ref, ledger.token, count)
    return f"""UPDATE {ledger.table} {completed_attempts(table, ledger, NOW)}
        WHERE {keys} AND {ledger.ended_at} IS NULL"""  # noqa: S608


def share_lock_holder(table: str, *, lock: str) -> tuple[str, Params]:
    """Return the enqueue's read of the job holding `lock`, share-locking its row until commit.

    A shared lock, not FOR UPDATE: an enqueue that lost the race to take a free lock already
    holds InnoDB's shared lock on the winner's index record (from the duplicate-key check), and
    two of them upgrading to exclusive locks would deadlock. Tested on MariaDB 10.11.
    """
    sql = f"SELECT id FROM {table} WHERE lock_holder = %(lock)s LOCK IN SHARE MODE"  # noqa: S608
    return sql, {"lock": lock}


INSERT = InsertDialect(
    now_plus="CURRENT_TIMESTAMP(6) + INTERVAL %(delay)s MICROSECOND",
    delay=lambda seconds: round(seconds * 1e6),
)
"""The enqueue's INSERT (`insert.insert_jobs`): INSERT IGNORE leaves out the rows a unique
index refuses, and RETURNING (MariaDB 10.5+, not MySQL) returns only the rows inserted (tested
on MariaDB 10.11). IGNORE would also turn a bad value into a warning: the enqueue has checked
every value before."""


LOCK_WAIT_TIMEOUT = 1205
"""innodb_lock_wait_timeout passed: a gate's lock was waited for too long."""


def gate_bounds(*, wait: float, idle: float, mariadb: bool) -> tuple[str, Params]:
    """Return the statement that bounds, on this session until `gate_bounds_restored()`, how long
    it waits for a row lock (`wait` seconds) and (MariaDB: MySQL has no such bound) how long it
    may sit idle in a transaction (`idle` seconds) before the server closes it and so releases a
    gate; the session's own values are kept in user variables for the restore."""
    params = {"wait": max(1, math.ceil(wait)), "idle": max(1, math.ceil(idle))}
    if not mariadb:
        sql = (
            "SET @leases_lock_wait = @@SESSION.innodb_lock_wait_timeout,"
            " SESSION innodb_lock_wait_timeout = %(wait)s"
        )
        return sql, {"wait": params["wait"]}
    sql = (
        "SET @leases_lock_wait = @@SESSION.innodb_lock_wait_timeout,"
        " @leases_idle = @@SESSION.idle_transaction_timeout,"
        " SESSION innodb_lock_wait_timeout = %(wait)s,"
        " SESSION idle_transaction_timeout = %(idle)s"
    )
    return sql, params


def gate_bounds_restored(*, mariadb: bool) -> tuple[str, Params]:
    """Return the statement that gives the session back the values `gate_bounds()` kept."""
    if not mariadb:
        return "SET SESSION innodb_lock_wait_timeout = @leases_lock_wait", {}
    sql = (
        "SET SESSION innodb_lock_wait_timeout = @leases_lock_wait,"
        " SESSION idle_transaction_timeout = @leases_idle"
    )
    return sql, {}


GATE_HOLDERS = (
    "SELECT t.trx_mysql_thread_id AS thread_id, p.USER AS user, p.HOST AS host,"
    " p.COMMAND AS command, t.trx_state, t.trx_started, t.trx_rows_locked"
    " FROM information_schema.INNODB_TRX AS t"
    " LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = t.trx_mysql_thread_id"
    " WHERE t.trx_mysql_thread_id <> CONNECTION_ID() AND t.trx_rows_locked > 0"
    " ORDER BY t.trx_started LIMIT 5"
)
"""The transactions holding row locks, oldest first: InnoDB names the holder of one row only to
a transaction waiting for it (INNODB_LOCK_WAITS), and the claim's wait has ended when it asks.
Needs the PROCESS privilege."""


SESSION_CLOCK = (
    "SELECT @@session.time_zone, @@system_time_zone, TIMESTAMPDIFF(SECOND, UTC_TIMESTAMP(), NOW())"
)
"""The session's time zone, the server's, and how far the session's NOW() is from UTC: what
`checks.databases.database_clock_problems` reads, since lease times are compared with NOW()."""


def row_estimate(
    table: str, *, status: str | None = None, other_than: bool = False
) -> tuple[str, Params]:
    """Return the optimizer's plan of reading `table` (only its rows in `status`, or with
    `other_than` only the others): its `rows` column is InnoDB's estimate, from the table's
    statistics or, for `status`, from dives into the index that leads with it. Nothing is
    counted. Tested on MariaDB 10.11. `planned_rows()` reads the estimate off its result."""
    if status is None:
        return f"EXPLAIN SELECT 1 FROM {table}", {}  # noqa: S608
    operator = "<>" if other_than else "="
    sql = f"EXPLAIN SELECT 1 FROM {table} WHERE status {operator} %(status)s"  # noqa: S608
    return sql, {"status": status}


def planned_rows(columns: list[str], row: tuple[Any, ...]) -> int:
    """Return the row estimate of a `row_estimate()` plan row, whose `columns` are its names."""
    return round(float(dict(zip(columns, row, strict=True))["rows"] or 0))


def status_estimate(equal: int, other_than: int, table_rows: int) -> int:
    """Return the estimate of a status's rows from `row_estimate()`'s three plans.

    InnoDB caps an index range's estimate at half the table (rounded down): a status holding
    most of the table (completed, typically) reads as half of it. Then the table less the other
    statuses, a smaller range estimated without the cap, is the better estimate.
    """
    if equal >= table_rows // 2:
        return max(equal, table_rows - other_than)
    return equal


# MariaDB/MySQL's error numbers: 1045/1698 access denied (password), 1044 no access to the
# database, 1049 unknown database, 1146/1054 unknown table/column, 1142/1143 no privilege on a
# table/column, 1193/1231/1232/1298 an unknown variable or time zone, or a wrong value (an
# init_command), 1115/1273 an unknown character set or collation, 1251/2059 an authentication
# plugin the client lacks.
# 1064: a syntax error. While connecting, the one statement run is the project's init_command.
MISCONFIGURED_WHILE_CONNECTING = (1064,)
MISCONFIGURED_ERRORS = {
    1045: "PASSWORD",
    1698: "PASSWORD",
    1044: "USER",
    1049: "NAME",
    1146: MIGRATE,
    1054: MIGRATE,
    1142: "USER",
    1143: "USER",
    1193: "OPTIONS",
    1231: "OPTIONS",
    1232: "OPTIONS",
    1115: "OPTIONS",
    1273: "OPTIONS",
    1298: "OPTIONS",
    1251: "OPTIONS",
    2059: "OPTIONS",
}
