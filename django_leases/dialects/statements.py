"""What the statements of every database share: the claim's request, the ledger's names, the
claim's fragments, and the status words written in as literals.

Raw SQL lives only in the dialects' modules. Each builder takes quoted names (tables, columns)
and plain values and returns `(sql, params)` with named parameters (`%(owner)s`). The statement
modules import nothing from the app but `status.py`, whose words they write in (`literal()`), so
a statement can be read, and tested, without models: the querysets decide what to run.
"""

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from django_leases.status import AttemptOutcome

Params = dict[str, Any]

MIGRATE = "migrate"
"""What a database's error says when its tables (or columns) are missing: run migrate."""


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


@dataclass(frozen=True)
class Claim:
    """What one claim asks for: up to `limit` jobs of `kinds` for `owner`, leased for
    `seconds`, or a kind's own length of `lengths` ((kind, seconds) pairs); `kinds` and `guard`
    are the fragments `kinds_filter()` and `takeover_guard()` return. `completing`: the (pks,
    tokens) of jobs to complete first, in the same statement (PostgreSQL's
    `complete_and_claim()`). `paused`: the subquery of the paused kinds (`paused_kinds()`, its
    parameter among `kinds`'), which each kind's own range of a claim of several kinds checks
    (`paused_arm()`). Not `takeover`: due jobs only, no expired lease looked for."""

    owner: str
    seconds: float
    limit: int
    kinds: tuple[str, Params]
    guard: tuple[str, Params]
    completing: tuple[list[int], list[int]] | None = None
    lengths: tuple[tuple[str, float], ...] = ()
    paused: str = ""
    takeover: bool = True


@lru_cache(maxsize=64)
def lease_length(
    lengths: tuple[tuple[str, float], ...], column: str, default: str, value: Callable[[float], Any]
) -> tuple[str, Params]:
    """Return a claim's lease length in seconds for a row whose kind is `column`: the
    placeholder `default`, or a CASE giving each kind of `lengths` (`Claim.lengths`) its own
    (`value` writes a length as the database's parameter; parameters `length_kind_0`,
    `length_0`, ...). Cached: the same for every claim of a worker. Do not change the result."""
    if not lengths:
        return default, {}
    params: Params = {}
    arms = []
    for i, (kind, seconds) in enumerate(lengths):
        params[f"length_kind_{i}"], params[f"length_{i}"] = kind, value(seconds)
        arms.append(f"WHEN %(length_kind_{i})s THEN %(length_{i})s")
    return f"CASE {column} {' '.join(arms)} ELSE {default} END", params


def literal(word: str) -> str:
    """Return a status word of `status.py` as an SQL string literal.

    The lease layer's statements carry their status words as literals, never as parameters: a
    prepared statement is planned once for any parameters (a generic plan), and a status given
    as a parameter cannot prove the partial indexes' predicates (`status = 'pending'`). The
    words are our own, checked here all the same.
    """
    if not re.fullmatch(r"[a-z_]+", word):
        raise ValueError(f"not a status word: {word!r}")
    return f"'{word}'"


def sqlstate(exc: BaseException) -> str | None:
    """Return the SQLSTATE of the PostgreSQL driver's error under Django's `exc` (psycopg 3's
    `sqlstate`, psycopg2's `pgcode`), or None."""
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)


def in_list(column: str, name: str, values: Sequence[Any]) -> tuple[str, Params]:
    """Return `column IN (...)` with one named parameter per value (`name_0`, `name_1`, ...)."""
    params = {f"{name}_{i}": value for i, value in enumerate(values)}
    return f"{column} IN ({', '.join(f'%({key})s' for key in params)})", params


def paused_kinds(table: str) -> str:
    """Return the subquery of the kinds paused on the job table `%(paused_model)s` (its label),
    `table` being the quoted name of `PausedKind`'s: a few rows, read through its unique index."""
    return f"SELECT kind FROM {table} WHERE job_model = %(paused_model)s"  # noqa: S608


def paused_arm(kind: str, paused: str) -> str:
    """Return the condition of one kind's range (`kind` its placeholder) that its kind is not
    paused: it names no column, so PostgreSQL decides it once per statement (a one-time
    filter) and walks none of a paused kind's backlog; "" without `paused`."""
    return f"AND {kind} NOT IN ({paused})" if paused else ""


def kinds_filter(
    kinds: Sequence[str] | None, excluded: Sequence[str] | None = None, *, paused: str = ""
) -> tuple[str, Params]:
    """Return the claim's `AND kind IN (...)` fragment, or nothing for every kind, or for every
    kind but `excluded` its `AND kind NOT IN (...)` (parameters `other_kind_0`, ...); with the
    `paused` subquery (`paused_kinds()`), the paused kinds left out too (one kind: decided once,
    `paused_arm()`)."""
    if not kinds:
        skip = f"AND kind NOT IN ({paused})" if paused else ""
        if not excluded:
            return skip, {}
        sql, params = in_list("kind", "other_kind", excluded)
        return f"AND NOT {sql} {skip}", params
    sql, params = in_list("kind", "kind", kinds)
    if len(kinds) == 1:
        return f"AND {sql} {paused_arm('%(kind_0)s', paused)}", params
    skip = f"AND kind NOT IN ({paused})" if paused else ""
    return f"AND {sql} {skip}", params


def takeover_guard(*, review_by_default: bool, exceptions: Sequence[str]) -> tuple[str, Params]:
    """Return the fragment that keeps a claim off expired leases the watcher must review.

    Under the review policy a job that reached a checkpoint is not taken over. The policy is
    review for every kind when `review_by_default`, except the kinds in `exceptions` (and the
    other way round).
    """
    if not review_by_default:
        if not exceptions:
            return "", {}
        kinds, params = in_list("kind", "review_kind", exceptions)
        return f"AND NOT ({kinds} AND checkpoint <> '')", params
    if not exceptions:
        return "AND checkpoint = ''", {}
    kinds, params = in_list("kind", "retry_kind", exceptions)
    return f"AND ({kinds} OR checkpoint = '')", params


def completed_attempts(table: str, ledger: LedgerNames, now: str) -> str:
    """Return the SET clause closing ledger rows as completed at `now` (the database clock's
    SQL) by %(owner)s, each keeping its job's checkpoint (SQLite's and MariaDB's batched
    completion)."""
    return f"""SET {ledger.outcome} = {literal(AttemptOutcome.COMPLETED)},
            {ledger.ended_at} = {now},
            {ledger.ended_by} = %(owner)s,
            {ledger.checkpoint} = (
                SELECT checkpoint FROM {table} WHERE id = {ledger.table}.{ledger.job_ref}
            ),
            {ledger.error_class} = '',
            {ledger.error_message} = ''"""  # noqa: S608 - names quoted by the caller
