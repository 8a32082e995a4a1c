"""PostgreSQL statements: the one-statement claim and completion (of one job or a batch), the
enqueue's share lock on a lock holder, and NOTIFY. Tested on 15."""

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from django_leases.sql.insert import InsertDialect
from django_leases.sql.merge import merge_keys

Params = dict[str, Any]

DEADLOCK_SQLSTATES = ("40001", "40P01")
"""serialization_failure, deadlock_detected: the transaction was rolled back."""

FENCING_CLOCK = "(EXTRACT(EPOCH FROM STATEMENT_TIMESTAMP()) * 1000000)::bigint"
"""The database clock in microseconds since the epoch: the floor of every new fencing token."""


@dataclass(frozen=True, eq=False)
class LedgerNames:
    """Quoted names of the attempt ledger's table and columns, for statements that write it.

    Built once per job model and database (`querysets.ledger.ledger_names`), so compared, and
    hashed as a cache key, by identity."""

    table: str
    columns: dict[str, str]

    def __getattr__(self, name: str) -> str:
        try:
            return self.columns[name]
        except KeyError:
            raise AttributeError(name) from None


LEDGER_INSERT = ("job", "job_ref", "attempt", "token", "owner", "claimed_at", "last_heartbeat_at",
                 "lease_until", "checkpoint", "outcome", "ended_by", "error_class",
                 "error_message", "resolution", "resolved_by")  # fmt: skip
"""The ledger columns an opening row sets; every other column keeps its default."""


STATUS_PARAMETERS = ("pending", "processing", "completed", "running", "lease_lost")
"""The parameters that carry status words: `constants()` writes them into the text."""


def constants(statement: tuple[str, Params]) -> tuple[str, Params]:
    """Write the status words of `statement` into its text as literals.

    A prepared statement is planned once for any parameters (a generic plan), and a status
    given as a parameter cannot prove the partial indexes' predicates (`status = 'pending'`): the
    plan would read the whole table. The words are our own (`status.py`), checked here.
    """
    sql, params = statement
    params = dict(params)
    for name in STATUS_PARAMETERS:
        if name in params:
            word = params.pop(name)
            if not re.fullmatch(r"[a-z_]+", word):
                raise ValueError(f"not a status word: {word!r}")
            sql = sql.replace(f"%({name})s", f"'{word}'")
    return sql, params


DUE = "status = %(pending)s AND run_at <= STATEMENT_TIMESTAMP() AND attempts < max_attempts"
"""The claim's predicate of a due job."""

EXPIRED = (
    "status = %(processing)s AND lease_until < STATEMENT_TIMESTAMP() AND attempts < max_attempts"
)
"""The claim's predicate of an expired lease it may take over (before the takeover guard)."""

CANDIDATE_SLACK = 32
"""How many due jobs of each kind beyond `limit` a claim of several kinds reads, for rows that
concurrent claims hold locked and this one skips."""


def claim(
    table: str,
    *,
    owner: str,
    seconds: float,
    limit: int,
    kinds: tuple[str, Params],
    guard: tuple[str, Params],
    ledger: LedgerNames | None,
    pending: str,
    processing: str,
    running: str,
    lease_lost: str,
    completing: tuple[list[int], list[int], str] | None = None,
) -> tuple[str, Params]:
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

    With `completing` (pks, tokens, the completed status) and `ledger`, the statement first
    completes those jobs as `complete_many()` does, so that a holder's finished job and its next
    claim share one commit; a job it completes is never taken over by it (the others may be, as
    after `complete_many()` then `claim()`). It then returns the claimed rows, or one row of
    NULLs if none, each with `completed_ids` and `completed_tokens`: the (pk, token) pairs
    whose completion won, side by side.
    """
    kind_sql, kind_params = kinds
    guard_sql, guard_params = guard
    completed = completing[2] if completing is not None and ledger is not None else None
    text = _claim_text(
        table,
        kind_sql,
        tuple(kind_params),
        guard_sql,
        ledger,
        (pending, processing, running, lease_lost, completed),
    )
    params = {
        **kind_params,
        **guard_params,
        "owner": owner,
        "seconds": seconds,
        "limit": limit,
        "window": limit,
        "candidates": limit + CANDIDATE_SLACK,
    }
    if completing is not None and completed is not None:
        params.update(pks=completing[0], tokens=completing[1])
    return text, params


@lru_cache(maxsize=64)
def _claim_text(
    table: str,
    kind_sql: str,
    kind_names: tuple[str, ...],
    guard_sql: str,
    ledger: LedgerNames | None,
    words: tuple[str, str, str, str, str | None],
) -> str:
    """Return the text of `claim()`, status words written in: the same for every call of a
    worker, so it is built once (rebuilding it per claim was several per cent of a busy
    worker's Python time).

    `words`: the pending, processing, running, lease-lost and (when completing) completed words.
    """
    pending, processing, running, lease_lost, completed = words
    kinds: tuple[str, Params] = (kind_sql, dict.fromkeys(kind_names))
    update = f"""
        UPDATE {table} AS job
        SET status = %(processing)s,
            lease_owner = %(owner)s,
            lease_until = STATEMENT_TIMESTAMP() + make_interval(secs => %(seconds)s),
            heartbeat_at = STATEMENT_TIMESTAMP(),
            lease_token = GREATEST(job.lease_token + 1, {FENCING_CLOCK}),
            attempts = job.attempts + 1
        FROM picked
        WHERE job.id = picked.id
        RETURNING job.*, picked.taken_over
    """  # noqa: S608 - names quoted by the caller, values are parameters
    if ledger is None:
        main = update
    else:
        columns = ", ".join(ledger.columns[name] for name in LEDGER_INSERT)
        main = f"""
        , claimed AS ({update}
        ), lost AS (
            UPDATE {ledger.table} AS a
            SET {ledger.outcome} = %(lease_lost)s,
                {ledger.ended_at} = STATEMENT_TIMESTAMP(),
                {ledger.ended_by} = %(owner)s
            FROM claimed
            WHERE claimed.taken_over AND a.{ledger.job_ref} = claimed.id
              AND a.{ledger.ended_at} IS NULL
        ), opened AS (
            INSERT INTO {ledger.table} ({columns})
            SELECT claimed.id, claimed.id, claimed.attempts, claimed.lease_token, %(owner)s,
                   STATEMENT_TIMESTAMP(), claimed.heartbeat_at, claimed.lease_until,
                   claimed.checkpoint, %(running)s, '', '', '', '', ''
            FROM claimed
        )
        SELECT * FROM claimed
        """  # noqa: S608 - names quoted by the caller, values are parameters
    takeover = f"{EXPIRED} {guard_sql}"
    before, completing_params = "", {}
    if completed is not None and ledger is not None:
        before = f"{_done(table)}, closed AS ({_close_done(ledger)}),"
        # A row cannot be updated twice by one statement (which update wins is undefined):
        # the rows this statement completes are not taken over by it, the others may be, as
        # after `complete_many()` then `claim()`.
        takeover += " AND id NOT IN (SELECT id FROM done)"
        main = main.replace(
            "SELECT * FROM claimed",
            "SELECT claimed.*, finished.completed_ids, finished.completed_tokens FROM "
            "(SELECT coalesce(array_agg(id), '{}') AS completed_ids, "
            "coalesce(array_agg(lease_token), '{}') AS completed_tokens FROM done) AS finished "
            "LEFT JOIN claimed ON TRUE",
        )
        completing_params = {"completed": completed}
    expired = _locked(table, takeover, ["lease_until"], kinds)
    due = _locked(table, DUE, ["priority DESC", "run_at", "id"], kinds)
    sql = f"""
        WITH {before} expired AS MATERIALIZED ({expired}
        ), due AS MATERIALIZED ({due}
        ), picked AS MATERIALIZED (
            SELECT id, TRUE AS taken_over FROM expired
            UNION ALL
            SELECT id, FALSE AS taken_over FROM due
            LIMIT %(limit)s
        ){main}
    """  # noqa: S608 - names quoted by the caller, values are parameters
    words_used = {
        "pending": pending,
        "processing": processing,
        "running": running,
        "lease_lost": lease_lost,
        **completing_params,
    }
    return constants((sql, words_used))[0]


def prepared_claim(statement: tuple[str, Params]) -> tuple["Prepared", Params]:
    """Return a `claim()` statement as a prepared statement (`prepared()`), its read window
    written in, rounded up to a power of two: PostgreSQL then plans it once per window (at most
    15 of them) and keeps that generic plan, where a LIMIT given as a parameter would have it
    plan every execution anew (its generic plan's estimate assumes 10% of the rows)."""
    window = 1 << (statement[1]["limit"] - 1).bit_length()
    return prepared(
        statement, written_in={"window": window, "candidates": window + CANDIDATE_SLACK}
    )


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


def _done(table: str) -> str:
    """Return the `acked` and `done` CTEs: the completion of every (pk, token) pair of the
    `%(pks)s` and `%(tokens)s` arrays whose job `%(owner)s` still holds under that token, unnested
    side by side: two parameters whatever the batch size, so the text (and plan) does not vary."""
    return f"""acked AS (
            SELECT * FROM unnest(%(pks)s::bigint[], %(tokens)s::bigint[]) AS acked (id, token)
        ), done AS (
            UPDATE {table} AS job
            SET status = %(completed)s, completed_at = STATEMENT_TIMESTAMP(), last_error = ''
            FROM acked
            WHERE job.id = acked.id AND job.lease_token = acked.token
              AND job.status = %(processing)s AND job.lease_owner = %(owner)s AND job."lock" = ''
            RETURNING job.id, job.lease_token, job.checkpoint
        )"""  # noqa: S608 - names quoted by the caller, values are parameters


def _close_done(ledger: LedgerNames) -> str:
    """Return the UPDATE that closes, as completed by `%(owner)s`, the open ledger row of each
    job the `done` CTE (id, lease_token, checkpoint) completed."""
    return f"""
            UPDATE {ledger.table} AS a
            SET {ledger.outcome} = %(completed)s,
                {ledger.ended_at} = STATEMENT_TIMESTAMP(),
                {ledger.ended_by} = %(owner)s,
                {ledger.checkpoint} = done.checkpoint,
                {ledger.error_class} = '',
                {ledger.error_message} = ''
            FROM done
            WHERE a.{ledger.job_ref} = done.id AND a.{ledger.token} = done.lease_token
              AND a.{ledger.ended_at} IS NULL
        """  # noqa: S608 - names quoted by the caller, values are parameters


def _locked(table: str, where: str, order: list[str], kinds: tuple[str, Params]) -> str:
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
    processing: str,
    completed: str,
) -> tuple[str, Params]:
    """Return the holder's completion of a job without a lock: the job's conditional UPDATE and
    the closing of its ledger row in one statement (a data-modifying CTE), so one round trip and
    no transaction block. The ledger row is closed only if the job's UPDATE won; the statement
    returns how many did. A job of a lock is left alone (0): passing its lock on needs a later
    statement of the same transaction, whose snapshot sees the jobs enqueued behind it."""
    sql = f"""
        WITH done AS (
            UPDATE {table}
            SET status = %(completed)s, completed_at = STATEMENT_TIMESTAMP(), last_error = ''
            WHERE id = %(pk)s AND status = %(processing)s AND lease_owner = %(owner)s
              AND lease_token = %(token)s AND "lock" = ''
            RETURNING id, lease_token, checkpoint
        ), closed AS ({_close_done(ledger)})
        SELECT count(*) FROM done
    """  # noqa: S608 - names quoted by the caller, values are parameters
    params = {
        "pk": pk,
        "owner": owner,
        "token": token,
        "processing": processing,
        "completed": completed,
    }
    return constants((sql, params))


def complete_many(
    table: str,
    ledger: LedgerNames,
    *,
    owner: str,
    pks: list[int],
    tokens: list[int],
    processing: str,
    completed: str,
) -> tuple[str, Params]:
    """Return the completion of a batch of jobs without a lock in one statement: `complete()`
    for every (pk, token) pair at once, each row still conditional on its own id, status,
    owner and token. Only the ledger rows of the jobs whose UPDATE won are closed; the
    statement returns their ids and tokens."""
    sql = f"""
        WITH {_done(table)}, closed AS ({_close_done(ledger)})
        SELECT id, lease_token FROM done
    """  # noqa: S608 - names quoted by the caller, values are parameters
    params = {
        "pks": pks,
        "tokens": tokens,
        "owner": owner,
        "processing": processing,
        "completed": completed,
    }
    return constants((sql, params))


def share_lock_holder(table: str, *, lock: str) -> tuple[str, Params]:
    """Return the enqueue's read of the job holding `lock`, share-locking its row until commit.

    FOR SHARE, not FOR UPDATE: enqueues of one lock do not wait for each other, while the
    holder's finishing UPDATE waits for every one of them (tested on 15).
    """
    sql = f"SELECT id FROM {table} WHERE lock_holder = %(lock)s FOR SHARE"  # noqa: S608
    return sql, {"lock": lock}


INSERT = InsertDialect(
    skip_suffix="ON CONFLICT DO NOTHING",
    now_plus="STATEMENT_TIMESTAMP() + make_interval(secs => %(delay)s)",
    delay=float,
)
"""The enqueue's INSERT (`sql.insert.insert_jobs`): a row that a unique index refuses is left
out (after waiting for the transaction of a conflicting row not yet committed)."""


def notify(channel: str, message: str) -> tuple[str, Params]:
    """Return the NOTIFY of an enqueue. NOTIFY is transactional: listeners hear it at commit."""
    return "SELECT pg_notify(%(channel)s, %(message)s)", {"channel": channel, "message": message}


def statement_timeout(milliseconds: int) -> str:
    """Return the text to put in front of a transaction's first statement (sent with it, as one
    simple query) to bound each statement of the transaction by `milliseconds` on the server."""
    return f"SET LOCAL statement_timeout = {int(milliseconds)}; "


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
