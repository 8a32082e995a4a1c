"""PostgreSQL statements: the one-statement claim and completion (of one job or a batch), the
enqueue's share lock on a lock holder, and NOTIFY. Tested on 15."""

import json
import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

from django_leases.dialects.insert import InsertDialect
from django_leases.dialects.merge import CANDIDATE_SLACK, merge_keys
from django_leases.dialects.statements import (
    LEDGER_INSERT,
    MIGRATE,
    Claim,
    LedgerNames,
    lease_length,
    literal,
    paused_arm,
)
from django_leases.status import COMPLETED, PENDING, PROCESSING, AttemptOutcome

Params = dict[str, Any]

DEADLOCK_SQLSTATES = ("40001", "40P01")
"""serialization_failure, deadlock_detected: the transaction was rolled back."""

READ_ONLY_SQLSTATES = ("25006",)
"""read_only_sql_transaction: the server takes no writes now (a hot standby, or
`default_transaction_read_only`), which a failover or an operator ends."""

FENCING_CLOCK = "(EXTRACT(EPOCH FROM STATEMENT_TIMESTAMP()) * 1000000)::bigint"
"""The database clock in microseconds since the epoch: the floor of every new fencing token."""


DUE = f"status = {literal(PENDING)} AND run_at <= STATEMENT_TIMESTAMP() AND attempts < max_attempts"
"""The claim's predicate of a due job."""

EXPIRED = (
    f"status = {literal(PROCESSING)} AND lease_until < STATEMENT_TIMESTAMP()"
    " AND attempts < max_attempts"
)
"""The claim's predicate of an expired lease it may take over (before the takeover guard)."""


def claim(table: str, claim: Claim, *, ledger: LedgerNames | None) -> tuple[str, Params]:
    """Return the statement that claims up to `limit` jobs for `owner`, with their ledger rows.

    One statement decides ownership. Each candidate set is a MATERIALIZED CTE with FOR UPDATE
    SKIP LOCKED: it is evaluated once, so it cannot re-run per row and lock more than LIMIT rows
    (the trap of `UPDATE ... WHERE id IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)`, which
    PostgreSQL may re-execute and then over-claim). Rows locked by a concurrent claim are
    skipped, not waited for; a row changed by a commit before we lock it is rechecked against
    the CTE's WHERE (READ COMMITTED EvalPlanQual). Expired leases are taken first; `due` is only
    read as far as the outer LIMIT needs. Each CTE walks its own partial index, so the cost does
    not grow with finished rows; the jobs of given `kinds` are read from the indexes led by
    `kind`, so neither does it grow with other kinds' backlog.

    With `ledger`, the ledger writes ride in the same statement as data-modifying CTEs: the open
    row of each new attempt, and the closing of the rows of holders whose expired lease this
    claim took over. All parts run on one snapshot, so the UPDATE cannot see (and close) the
    rows the INSERT adds. Without it the caller writes the ledger in the same transaction.
    The rows come back with a `taken_over` column, in no particular order.

    With `claim.completing` (pks, tokens) and `ledger`, the statement first
    completes those jobs as `complete_many()` does, so that a holder's finished job and its next
    claim share one commit; a job it completes is never taken over by it (the others may be, as
    after `complete_many()` then `claim()`). It then returns the claimed rows, or one row of
    NULLs if none, each with `completed_ids` and `completed_tokens`: the (pk, token) pairs
    whose completion won, side by side.
    """
    kind_sql, kind_params = claim.kinds
    guard_sql, guard_params = claim.guard
    completing = claim.completing
    completes = completing is not None and ledger is not None
    length_sql, length_params = lease_length(claim.lengths, "job.kind", "%(seconds)s", float)
    text = _claim_text(
        table,
        kind_sql,
        tuple(kind_params),
        guard_sql if claim.takeover else None,
        ledger,
        completes,
        length_sql,
        claim.paused,
    )
    params = {
        **kind_params,
        **guard_params,
        **length_params,
        "owner": claim.owner,
        "seconds": claim.seconds,
        "limit": claim.limit,
        "window": claim.limit,
        "candidates": claim.limit + CANDIDATE_SLACK,
    }
    if completing is not None and completes:
        params.update(pks=completing[0], tokens=completing[1])
    return text, params


@lru_cache(maxsize=64)
def _claim_text(
    table: str,
    kind_sql: str,
    kind_names: tuple[str, ...],
    guard_sql: str | None,
    ledger: LedgerNames | None,
    completes: bool,
    length_sql: str,
    paused: str,
) -> str:
    """Return the text of `claim()` (`completes`: with the completions first; `length_sql`: the
    lease's length in seconds; `guard_sql` None: no expired lease taken over, due jobs only):
    the same for every call of a worker, so it is built once (rebuilding it per claim was
    several per cent of a busy worker's Python time)."""
    kinds: tuple[str, Params] = (kind_sql, dict.fromkeys(kind_names))
    update = f"""
        UPDATE {table} AS job
        SET status = {literal(PROCESSING)},
            lease_owner = %(owner)s,
            lease_until = STATEMENT_TIMESTAMP() + make_interval(secs => {length_sql}),
            heartbeat_at = STATEMENT_TIMESTAMP(),
            lease_token = GREATEST(job.lease_token + 1, {FENCING_CLOCK}),
            attempts = job.attempts + 1
        FROM picked
        WHERE job.id = picked.id
        RETURNING job.*, picked.taken_over
    """  # noqa: S608 - names quoted by the caller, values are parameters
    takeover = f"{EXPIRED} {guard_sql}" if guard_sql is not None else ""
    before, result = "", "SELECT * FROM claimed"
    if completes and ledger is not None:
        before = f"{_done(table)}, closed AS ({_close_done(ledger)}), kept AS ({_kept(table)}),"
        # A row cannot be updated twice by one statement (which update wins is undefined):
        # the rows this statement completes are not taken over by it, nor the held jobs of a
        # lock, which the caller completes next; the others may be, as after `complete_many()`
        # then `claim()`.
        if takeover:
            takeover += " AND id NOT IN (SELECT id FROM done) AND id NOT IN (SELECT id FROM kept)"
        # One row of NULLs when nothing is claimed: the completions still come back.
        result = (
            "SELECT claimed.*, finished.completed_ids, finished.completed_tokens FROM "
            "(SELECT coalesce(array_agg(id), '{}') AS completed_ids, "
            "coalesce(array_agg(lease_token), '{}') AS completed_tokens FROM done) AS finished "
            "LEFT JOIN claimed ON TRUE"
        )
    if ledger is None:
        main = update
    else:
        columns = ", ".join(ledger.columns[name] for name in LEDGER_INSERT)
        # The ledger rows of the holders whose expired leases this claim took over.
        lost = f"""), lost AS (
            UPDATE {ledger.table} AS a
            SET {ledger.outcome} = {literal(AttemptOutcome.LEASE_LOST)},
                {ledger.ended_at} = STATEMENT_TIMESTAMP(),
                {ledger.ended_by} = %(owner)s
            FROM claimed
            WHERE claimed.taken_over AND a.{ledger.job_ref} = claimed.id
              AND a.{ledger.ended_at} IS NULL
        """  # noqa: S608 - names quoted by the caller, values are parameters
        main = f"""
        , claimed AS ({update}
        {lost if takeover else ""}), opened AS (
            INSERT INTO {ledger.table} ({columns})
            SELECT claimed.id, claimed.id, claimed.attempts, claimed.lease_token, %(owner)s,
                   STATEMENT_TIMESTAMP(), claimed.heartbeat_at, claimed.lease_until,
                   claimed.checkpoint, {literal(AttemptOutcome.RUNNING)}, '', '', '', '', ''
            FROM claimed
        )
        {result}
        """  # noqa: S608 - names quoted by the caller, values are parameters
    due = _locked(table, DUE, ["priority DESC", "run_at", "id"], kinds, paused)
    expired = expired_first = ""  # due jobs only: no expired lease's range walked
    if takeover:
        expired = _locked(table, takeover, ["lease_until"], kinds, paused)
        expired = f"expired AS MATERIALIZED ({expired}),"
        expired_first = "SELECT id, TRUE AS taken_over FROM expired UNION ALL"
    return f"""
        WITH {before} {expired} due AS MATERIALIZED ({due}
        ), picked AS MATERIALIZED (
            {expired_first} SELECT id, FALSE AS taken_over FROM due LIMIT %(limit)s
        ){main}
    """  # noqa: S608 - names quoted by the caller, values are parameters


def _done(table: str) -> str:
    """Return the `acked` and `done` CTEs: the completion of every (pk, token) pair of the
    `%(pks)s` and `%(tokens)s` arrays whose job `%(owner)s` still holds under that token, unnested
    side by side: two parameters whatever the batch size, so the text (and plan) does not vary."""
    return f"""acked AS (
            SELECT * FROM unnest(%(pks)s::bigint[], %(tokens)s::bigint[]) AS acked (id, token)
        ), done AS (
            UPDATE {table} AS job
            SET status = {literal(COMPLETED)}, completed_at = STATEMENT_TIMESTAMP(),
                last_error = ''
            FROM acked
            WHERE job.id = acked.id AND job.lease_token = acked.token
              AND job.status = {literal(PROCESSING)} AND job.lease_owner = %(owner)s
              AND job."lock" = '' AND job.dependents IS NULL
            RETURNING job.id, job.lease_token, job.checkpoint
        )"""  # noqa: S608 - names quoted by the caller, values are parameters


def _kept(table: str) -> str:
    """Return the SELECT of the jobs of a lock (or with dependents) among the `acked` pairs that
    `%(owner)s` still holds: left to a later statement, whose snapshot sees the jobs enqueued
    behind them."""
    return f"""
            SELECT job.id FROM {table} AS job
            JOIN acked ON job.id = acked.id AND job.lease_token = acked.token
            WHERE job.status = {literal(PROCESSING)} AND job.lease_owner = %(owner)s
              AND (job."lock" <> '' OR job.dependents IS NOT NULL)
        """  # noqa: S608 - names quoted by the caller, values are parameters


def _close_done(ledger: LedgerNames) -> str:
    """Return the UPDATE that closes, as completed by `%(owner)s`, the open ledger row of each
    job the `done` CTE (id, lease_token, checkpoint) completed."""
    return f"""
            UPDATE {ledger.table} AS a
            SET {ledger.outcome} = {literal(AttemptOutcome.COMPLETED)},
                {ledger.ended_at} = STATEMENT_TIMESTAMP(),
                {ledger.ended_by} = %(owner)s,
                {ledger.checkpoint} = done.checkpoint,
                {ledger.error_class} = '',
                {ledger.error_message} = ''
            FROM done
            WHERE a.{ledger.job_ref} = done.id AND a.{ledger.token} = done.lease_token
              AND a.{ledger.ended_at} IS NULL
        """  # noqa: S608 - names quoted by the caller, values are parameters


def _locked(
    table: str, where: str, order: list[str], kinds: tuple[str, Params], paused: str
) -> str:
    """Return a claim CTE: at most `window` rows matching `where` and `kinds`, in `order`, locked.

    `window` is the claim's `limit`, or more in a prepared statement (`prepared()`): PostgreSQL
    reads a WITH query only as far as its reader fetches, and `picked` stops at `limit`, so no
    more than `limit` rows are locked either way.

    Every kind, or one (`kind IN (%(kind_0)s)` is `kind = ...`): one ordered range of a partial
    index, walked with SKIP LOCKED until LIMIT rows are locked. PostgreSQL (15) cannot merge the
    ordered ranges of several kinds in one index scan; it would sort every row of those kinds,
    or walk the index led by `status` filtering on kind. So for several kinds each kind's first
    `window + CANDIDATE_SLACK` rows are one ordered range each (`key_*` columns), a Merge Append
    interleaves them in `order`, and the outer SELECT locks them one by one under the LIMIT:
    never more than `limit` rows locked. It comes back short only if more than CANDIDATE_SLACK
    of a kind's first rows are locked by concurrent claims. Tested on 15.
    """
    kind_sql, kind_params = kinds
    # Every kind but some (`other_kind_*`, `kind NOT IN (...)`) is one range too.
    named = [name for name in kind_params if name.startswith("kind_")]
    if len(named) < 2:
        return f"""
            SELECT id FROM {table} WHERE {where} {kind_sql}
            ORDER BY {", ".join(order)} LIMIT %(window)s
            FOR UPDATE SKIP LOCKED"""  # noqa: S608 - names quoted by the caller
    keys, by_key = merge_keys(order)
    arms = " UNION ALL ".join(
        f"(SELECT {keys} FROM {table} WHERE {where} AND kind = %({name})s"  # noqa: S608
        f" {paused_arm(f'%({name})s', paused)}"
        f" ORDER BY {', '.join(order)} LIMIT %(candidates)s)"
        for name in named
    )
    return f"""
            SELECT job.id FROM ({arms}) AS candidate
            JOIN {table} AS job ON job.id = candidate.key_id
            WHERE {where}
            ORDER BY {by_key} LIMIT %(window)s
            FOR UPDATE OF job SKIP LOCKED"""  # noqa: S608 - names quoted by the caller


def complete(
    table: str,
    ledger: LedgerNames,
    *,
    pk: int,
    owner: str,
    token: int,
) -> tuple[str, Params]:
    """Return the holder's completion of a job without a lock: the job's conditional UPDATE and
    the closing of its ledger row in one statement (a data-modifying CTE), so one round trip and
    no transaction block. The ledger row is closed only if the job's UPDATE won; the statement
    returns how many did. A job of a lock, or with dependents, is left alone (0): passing its lock
    on or releasing them needs a later statement of the same transaction, whose snapshot sees
    the jobs enqueued behind it."""
    sql = f"""
        WITH done AS (
            UPDATE {table}
            SET status = {literal(COMPLETED)}, completed_at = STATEMENT_TIMESTAMP(),
                last_error = ''
            WHERE id = %(pk)s AND status = {literal(PROCESSING)} AND lease_owner = %(owner)s
              AND lease_token = %(token)s AND "lock" = '' AND dependents IS NULL
            RETURNING id, lease_token, checkpoint
        ), closed AS ({_close_done(ledger)})
        SELECT count(*) FROM done
    """  # noqa: S608 - names quoted by the caller, values are parameters
    return sql, {"pk": pk, "owner": owner, "token": token}


def complete_many(
    table: str,
    ledger: LedgerNames,
    *,
    owner: str,
    pks: list[int],
    tokens: list[int],
) -> tuple[str, Params]:
    """Return the completion of a batch of jobs without a lock in one statement: `complete()`
    for every (pk, token) pair at once, each row still conditional on its own id, status,
    owner and token. Only the ledger rows of the jobs whose UPDATE won are closed; the
    statement returns their ids and tokens."""
    sql = f"""
        WITH {_done(table)}, closed AS ({_close_done(ledger)})
        SELECT id, lease_token FROM done
    """  # noqa: S608 - names quoted by the caller, values are parameters
    return sql, {"pks": pks, "tokens": tokens, "owner": owner}


class Literals:
    """Write the values of a session's EXECUTEs in as a client-binding driver does: an integer,
    and a list of integers (a `bigint[]` parameter), here; anything else (text, a float) as
    `quote` (the driver's quoting) writes it, texts and floats kept: the same ones come at every
    claim of a worker (owner, kinds, lease lengths). Only the session's thread uses it.

    psycopg writes each element of a list through its own dumper: for the two arrays of a
    batch's ids and tokens, most of the ~0.35 ms its binding of an EXECUTE took
    (bench/README.md, "Batched acks: CPU a job"). The integers are checked ids, tokens, limits.
    """

    KEPT = 64
    """Distinct texts and floats kept."""

    def __init__(self) -> None:
        self._kept: dict[tuple[type, Any], str] = {}

    def execute(self, execute: str, values: Mapping[str, Any], quote: Callable[[Any], str]) -> str:
        """Return `execute` (`prepared.Prepared.execute`) with `values` written in."""
        written = {}
        for name, value in values.items():
            if type(value) is int:
                written[name] = str(value)
            elif type(value) is list and all(type(item) is int for item in value):
                written[name] = "'{" + ",".join(map(str, value)) + "}'"
            elif type(value) not in (str, float):
                written[name] = quote(value)
            elif (text := self._kept.get((type(value), value))) is not None:
                written[name] = text
            else:
                written[name] = text = quote(value)
                if len(self._kept) < self.KEPT:
                    self._kept[type(value), value] = text
        return execute % written


def share_lock_holder(table: str, *, lock: str) -> tuple[str, Params]:
    """Return the enqueue's read of the job holding `lock`, share-locking its row until commit.

    FOR SHARE, not FOR UPDATE: enqueues of one lock do not wait for each other, while the
    holder's finishing UPDATE waits for every one of them (tested on 15).
    """
    sql = f"SELECT id FROM {table} WHERE lock_holder = %(lock)s FOR SHARE"  # noqa: S608
    return sql, {"lock": lock}


INSERT = InsertDialect(
    now_plus="STATEMENT_TIMESTAMP() + make_interval(secs => %(delay)s)",
    delay=float,
    arrays=True,
    notify="pg_notify(%(channel)s, %(message)s)",
)
"""The enqueue's INSERT (`insert.insert_jobs`): a row that a unique index refuses is left
out (after waiting for the transaction of a conflicting row not yet committed). Many rows come
as one array per column: a few parameters, however many rows (psycopg's client-side binding of
one parameter per value took half of a 2,000-row INSERT's time)."""


def notify(channel: str, message: str) -> tuple[str, Params]:
    """Return the NOTIFY of an enqueue. NOTIFY is transactional: listeners hear it at commit."""
    return "SELECT pg_notify(%(channel)s, %(message)s)", {"channel": channel, "message": message}


def statement_timeout(milliseconds: int) -> str:
    """Return the text to put in front of a transaction's first statement (sent with it, as one
    simple query) to bound each statement of the transaction by `milliseconds` on the server."""
    return f"SET LOCAL statement_timeout = {int(milliseconds)}; "


def gate_bounds(*, wait: float, idle: float) -> tuple[str, Params]:
    """Return the statement that bounds, for the rest of a kind's gated claim transaction, how
    long it waits for a lock (`wait` seconds) and how long its session may sit idle in it
    (`idle` seconds) before the server ends the session and so releases the gate."""
    sql = (
        "SELECT set_config('lock_timeout', %(wait)s, true),"
        " set_config('idle_in_transaction_session_timeout', %(idle)s, true)"
    )
    return sql, {"wait": str(round(wait * 1000)), "idle": str(round(idle * 1000))}


LOCK_NOT_AVAILABLE = ("55P03", "57014")
"""lock_not_available (`lock_timeout`), query_canceled (`statement_timeout`): a gate's lock
was waited for too long."""


def gate_holders(table: str, *, job_model: str, kind: str) -> tuple[str, Params]:
    """Return the read of the sessions holding the gate row of `kind` on `job_model`'s table.

    Asked once the wait has ended, when `pg_blocking_pids()` of the waiter is empty: a locked
    row's `xmax` is the locking transaction's id, whose lock on itself names its session."""
    sql = (
        "SELECT a.pid, a.application_name, host(a.client_addr) AS client_addr, a.state,"  # noqa: S608
        " a.xact_start, a.state_change"
        f" FROM {table} AS g"
        " JOIN pg_locks AS l ON l.locktype = 'transactionid' AND l.granted"
        " AND l.transactionid = g.xmax"
        " JOIN pg_stat_activity AS a ON a.pid = l.pid"
        " WHERE g.job_model = %(job_model)s AND g.kind = %(kind)s AND a.pid <> pg_backend_pid()"
        " ORDER BY a.xact_start"
    )
    return sql, {"job_model": job_model, "kind": kind}


OUTSIDE_TRANSACTIONS = re.compile(
    r"\s*(VACUUM|CLUSTER|REINDEX|CHECKPOINT|BEGIN|START|COMMIT|END|ROLLBACK|ABORT"
    r"|(CREATE|DROP|ALTER)\s+(DATABASE|TABLESPACE|SYSTEM|SUBSCRIPTION)"
    r"|(CREATE|DROP)\s+(UNIQUE\s+)?INDEX\s+CONCURRENTLY)\b",
    re.IGNORECASE,
)
"""Statements that run only outside a transaction block (or control one): nothing may be sent in
front of them, which would open a block (a simple query of several statements is one)."""


def listen(channel: str) -> Any:
    """Return the LISTEN statement of `channel`, composed by psycopg with the name quoted."""
    # Imported here: psycopg is an optional dependency, needed only by PostgreSQL users.
    from psycopg import sql

    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))


def row_estimate(table: str, *, status: str | None = None) -> tuple[str, Params]:
    """Return the planner's plan of reading `table` (only its rows in `status`, if given), whose
    row estimate comes from the statistics ANALYZE keeps: `pg_class.reltuples` scaled to the
    table's current size, and the most common values of `status`. Nothing is counted: it costs
    the same at any size (tested on 15). `planned_rows()` reads the estimate off its result."""
    if status is None:
        return f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {table}", {}  # noqa: S608
    sql = f"EXPLAIN (FORMAT JSON) SELECT 1 FROM {table} WHERE status = %(status)s"  # noqa: S608
    return sql, {"status": status}


def planned_rows(plan: Any) -> int:
    """Return the row estimate of the top node of a `row_estimate()` plan (its one value: JSON
    text, or the list psycopg decodes)."""
    if isinstance(plan, str | bytes):
        plan = json.loads(plan)
    return int(plan[0]["Plan"]["Plan Rows"])


AUTOVACUUM = "SELECT current_setting('autovacuum') = 'on'"
"""Whether the server runs autovacuum: what `checks.autovacuum_problems` reads, since only a
vacuum removes the dead entries each finished job leaves at the front of the claim's indexes."""


# PostgreSQL's SQLSTATEs of a statement that reached the server (42P01: undefined_table,
# 42703: undefined_column, 42501: insufficient_privilege, 28000: invalid_authorization_
# specification, 28P01: invalid_password, 3D000: invalid_catalog_name).
MISCONFIGURED_SQLSTATES = {
    "42P01": MIGRATE,
    "42703": MIGRATE,
    "42501": "USER",
    "28000": "USER",
    "28P01": "PASSWORD",
    "3D000": "NAME",
}
# The handshake's errors, which carry no SQLSTATE: PostgreSQL's FATAL messages, PgBouncer's
# and libpq's own.
MISCONFIGURED_MESSAGES = (
    (re.compile(r'database ".*" does not exist'), "NAME"),
    (re.compile(r"no such database"), "NAME"),  # PgBouncer
    (re.compile(r"database .* is not currently accepting connections"), "NAME"),
    (re.compile(r'role ".*" does not exist'), "USER"),
    (re.compile(r'role ".*" is not permitted to log in'), "USER"),
    (re.compile(r"permission denied for database"), "USER"),
    (re.compile(r"no pg_hba\.conf entry"), "USER"),
    (re.compile(r"password authentication failed"), "PASSWORD"),
    (re.compile(r"no password supplied"), "PASSWORD"),
    (re.compile(r"unsupported startup parameter"), "OPTIONS"),  # PgBouncer
    (re.compile(r"unrecognized configuration parameter"), "OPTIONS"),
    (re.compile(r"invalid value for parameter"), "OPTIONS"),
    (re.compile(r"invalid connection option"), "OPTIONS"),  # libpq
    (re.compile(r"invalid \w+ value: "), "OPTIONS"),  # libpq: sslmode, target_session_attrs...
)
