"""Claims: taking jobs for a worker, the one transition that creates a lease.

`LeaseQuerySet.claim()` and `complete_and_claim()` (`claim_job()`: `claim_by_id.py`): functions
taking the queryset first, bound there as methods. Every claim is one conditional UPDATE
(PostgreSQL: one statement with the ledger's rows; SQLite: UPDATE ... RETURNING passes;
MariaDB/MySQL: rows locked with SKIP LOCKED (for several kinds, chosen first by an unlocked read
of each kind's range: `lock_merged()`), then the UPDATE, in `dialects.mysql`'s statements; the
connection's dialect runs its own, `Dialect.claim()`) that gives each row a new fencing token,
`attempts + 1` and a lease from the database clock, and opens its ledger row in the same
transaction.

A worker's claim is a `Claimer`, put together when the worker starts (its route, throttled
kinds and the dialect's request); each claim is then `Claimer.claim()` (retried on deadlock),
`Claimer.by_dialect()`, the dialect's `claim()` (PostgreSQL: the statement of
`postgresql_statements.claim()`, run as a prepared statement of the session), `base.raw_rows()`
(rows to models) and `in_claim_order()`. `LeaseQuerySet.claim()` builds a `Claimer` per call.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace
from datetime import timedelta
from functools import cache, partial
from typing import TYPE_CHECKING, Any, Generic, NamedTuple

from django.db import DatabaseError, connections
from django.db.models import F
from django.db.models.functions import Now

from django_leases.conf import to_seconds
from django_leases.dialects import Dialect, Jobs, dialect_of, merge
from django_leases.dialects import statements as sql
from django_leases.dialects.statements import LedgerNames
from django_leases.exceptions import GateBusy, InvalidArgument
from django_leases.handlers import Lengths, lease_lengths_of, throttles
from django_leases.limits import CLAIM_LIMIT, check_int, check_kind, check_owner
from django_leases.querysets.acks import complete_many
from django_leases.querysets.base import (
    LeaseKey,
    lease_keys,
    lease_until,
    next_token,
    quoted_table,
    raw_rows,
    retry_deadlocks,
)
from django_leases.querysets.endings import complete_many_by_dialect
from django_leases.querysets.ledger import J, ledger_names, open_attempts, record_fenced_many
from django_leases.querysets.pauses import paused_clause, paused_rows
from django_leases.querysets.reads import LeaseReads, takeover_guard
from django_leases.querysets.throttles import claim_throttled, kind_gates, throttles_of
from django_leases.status import PROCESSING

if TYPE_CHECKING:
    from django_leases.models import AbstractLeasedJob


class AllBut(tuple[str, ...]):
    """Every kind but these: the kinds of a claim of every kind that the throttled ones leave."""

    __slots__ = ()


Wanted = list[str] | AllBut | None
"""The kinds a claim takes: these, every kind but some, or every kind (None)."""


def kinds_filter(kinds: Wanted, paused: str) -> tuple[str, sql.Params]:
    """Return the claim's fragment of `kinds` (`sql.kinds_filter()`), paused kinds left out."""
    if isinstance(kinds, AllBut):
        return sql.kinds_filter(None, excluded=kinds, paused=paused)
    return sql.kinds_filter(kinds, paused=paused)


def lengths_of(seconds: float, kinds: Wanted) -> Lengths:
    """Return the kinds of `kinds` with a lease length of their own (`lease_lengths_of()`)."""
    if isinstance(kinds, AllBut):
        return lease_lengths_of(seconds, None, kinds)
    return lease_lengths_of(seconds, None if kinds is None else tuple(kinds))


def claim(
    qs: LeaseReads[J],
    owner: str,
    *,
    ttl: float | timedelta,
    limit: int = 1,
    kinds: Collection[str] | None = None,
    takeover: bool = True,
) -> list[J]:
    """Claim up to `limit` claimable jobs for `owner`, oldest expired lease first, then by
    priority (highest first), `run_at` and id; not `takeover`, due jobs only (a worker looks
    for expired leases at most every `TAKEOVER_EVERY`: `worker.outcomes.Outcomes.takes_over()`).

    Each claimed row gets `attempts + 1`, a new fencing token and a lease of `ttl` seconds
    (or its kind's `ttl=`, `@job_handler`) from the database clock, in the statement that
    decides ownership, and an open row in the
    attempt ledger in the same transaction. Kinds with a `limit=` or `rate=` are claimed
    first, each in a transaction of its own within its throttle (`throttles.claim_throttled()`),
    then the others; every job committed is returned even if a later part fails (`Claimed`).
    A claim takes from the whole queue: on a filtered queryset it raises `InvalidArgument`
    (choose with `kinds=`, or one job with `claim_job(pk)`).
    """
    check_int(limit, "limit", CLAIM_LIMIT)
    return Claimer(qs, owner, ttl=ttl, kinds=kinds).claim(limit, takeover=takeover)


class Claimer(Generic[J]):
    """One owner's claim, put together once: its checked arguments, the dialect's route, its
    throttled kinds, and the request the dialect runs (the kinds' and the takeover guard's
    fragments, the paused kinds' subquery, each kind's lease length); each claim then asks only
    how many jobs, and whether to look for expired leases too.

    A worker builds its own when it starts (`LeaseWorker`: its settings, registry and route as
    they are then); `claim()` and `complete_and_claim()` build one per call. Any thread may use
    it: each claim runs on its own thread's connection."""

    def __init__(
        self,
        qs: LeaseReads[J],
        owner: str,
        *,
        ttl: float | timedelta,
        kinds: Collection[str] | None = None,
    ) -> None:
        self.seconds, self.kinds = claim_args(qs, owner, ttl, kinds)
        self.qs, self.db, self.owner = qs, qs.db, owner
        self.throttled = throttles_of(self.kinds) if throttles() and self.kinds != [] else {}
        self.route = claim_route(qs.model, qs.db)
        fuses = self.route.dialect.fuses_completion_and_claim(self.route.ledger)
        self.fuses = fuses and not self.throttled and self.kinds != []
        self.jobs, self.request = handed_to_dialect(qs, owner, self.seconds, 1, self.kinds)

    def claim(self, limit: int, *, takeover: bool = True) -> list[J]:
        """Claim up to `limit` jobs (`claims.claim()`): the throttled kinds first, each in a
        transaction of its own within its throttle, then the others."""
        if self.kinds == []:
            return []
        if not self.throttled:
            return self.by_dialect(limit, takeover)
        qs, owner, seconds = self.qs, self.owner, self.seconds
        claimed: Claimed[J] = Claimed()
        for kind, throttle in self.throttled.items():
            take = partial(
                claim_by_dialect, qs, owner, seconds, kinds=[kind], atomic=False, takeover=takeover
            )
            claimed.part(qs, kind, limit, partial(claim_throttled, qs, kind, throttle, take=take))
        kinds, throttled = self.kinds, self.throttled
        rest: Wanted = (
            AllBut(throttled) if kinds is None else [k for k in kinds if k not in throttled]
        )
        if rest != []:
            take_rest = partial(claim_by_dialect, qs, owner, seconds, kinds=rest, takeover=takeover)
            claimed.part(qs, None, limit, take_rest)
        return claimed.handed_out()

    @retry_deadlocks
    def by_dialect(self, limit: int, takeover: bool) -> list[J]:
        """The claim of unthrottled kinds: the dialect's, on this thread's connection."""
        # A connection is never shared between threads: this thread's.
        jobs = replace(self.jobs, connection=connections[self.db])
        request = replace(self.request, limit=limit, takeover=takeover)
        return in_claim_order(self.route.dialect.claim(jobs, request))

    def complete_and_claim(
        self, leases: Iterable[LeaseKey] | Mapping[int, int], limit: int, *, takeover: bool = True
    ) -> tuple[set[LeaseKey], list[J]]:
        """`claims.complete_and_claim()`."""
        if not self.fuses:
            return complete_many(self.qs, self.owner, leases), self.claim(limit, takeover=takeover)
        keys = lease_keys(leases)
        fused: list[tuple[set[LeaseKey], list[J]]] = []

        def at_once(keys: list[LeaseKey]) -> set[LeaseKey]:
            fused.append(complete_and_claim_at_once(self, keys, limit, takeover))
            return fused[0][0]

        # The completions end where every execution ends; the fused statement completes the
        # jobs without a lock, the seam the others (`endings.complete_many_by_dialect()`).
        done = complete_many_by_dialect(self.qs, self.owner, keys, at_once=at_once)
        won, jobs = fused[0]
        if done - won and len(jobs) < limit:
            jobs += self.claim(limit - len(jobs), takeover=takeover)
        lost = [key for key in keys if key not in done]
        if lost:
            record_fenced_many(self.qs, lost)
        return done, jobs


class PartFailed(NamedTuple):
    """A part of a claim that failed while another part answered (`Claimed`)."""

    kind: str | None
    """The throttled kind it claimed; None: the unthrottled kinds."""
    error: DatabaseError
    holders: str | None
    """For a gate held too long (`GateBusy`): who holds it, as the database tells."""


class Claimed(list[J]):
    """The jobs a claim of throttled kinds committed, part by part (each throttled kind in a
    transaction of its own, then the other kinds), and the parts that failed.

    A claim hands out every job it committed, whatever fails after: a part that raises is
    kept in `failures` for the caller to report, and the next part is still claimed. A kind
    whose gate is held too long (`GateBusy`) is skipped this way even if nothing else answered.
    """

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[PartFailed] = []
        self.answered = 0

    def part(
        self, qs: LeaseReads[J], kind: str | None, limit: int, take: Callable[[int], list[J]]
    ) -> None:
        """Claim the room left of `limit` with `take(room)`, the part of `kind`."""
        room = limit - len(self)
        if room <= 0:
            return
        try:
            jobs = take(room)
        except DatabaseError as exc:
            holders = None
            if isinstance(exc, GateBusy) and kind is not None:
                holders = kind_gates(qs.db).holders(qs.model, kind)
            self.failures.append(PartFailed(kind, exc, holders))
            return
        self.answered += 1
        self += jobs

    def handed_out(self) -> Claimed[J]:
        """Return the jobs; raise the first error other than a busy gate if no part answered
        (nothing was committed: the claim failed as a whole)."""
        if not self.answered:
            errors = [f.error for f in self.failures if not isinstance(f.error, GateBusy)]
            if errors:
                raise errors[0]
        return self


def failures_of(jobs: list[Any]) -> list[PartFailed]:
    """The failed parts of a claim that returned `jobs` (`Claimed`)."""
    return jobs.failures if isinstance(jobs, Claimed) else []


def complete_and_claim(
    qs: LeaseReads[J],
    owner: str,
    leases: Iterable[LeaseKey] | Mapping[int, int],
    *,
    ttl: float | timedelta,
    limit: int = 1,
    kinds: Collection[str] | None = None,
    takeover: bool = True,
) -> tuple[set[LeaseKey], list[J]]:
    """`complete_many(owner, leases)`, then `claim(owner, ...)`: return the (job id, token)
    pairs completed and the jobs claimed.

    On PostgreSQL with the stock ledger this is one statement, so a holder's finished job
    and its next one cost one commit, not two; every row is still conditional as in the two
    methods. Its held jobs of a lock are completed after it (passing a lock on needs a later
    statement), and the jobs next in line of those locks are claimed then if it came back
    short. Elsewhere it is those two transactions, the completions committed first.
    """
    check_int(limit, "limit", CLAIM_LIMIT)
    claimer = Claimer(qs, owner, ttl=ttl, kinds=kinds)
    return claimer.complete_and_claim(leases, limit, takeover=takeover)


@retry_deadlocks
def complete_and_claim_at_once(
    claimer: Claimer[J], keys: list[LeaseKey], limit: int, takeover: bool
) -> tuple[set[LeaseKey], list[J]]:
    completing = ([pk for pk, _ in keys], [token for _, token in keys])
    jobs = replace(claimer.jobs, connection=connections[claimer.db])
    request = replace(claimer.request, limit=limit, takeover=takeover, completing=completing)
    rows = claimer.route.dialect.claim(jobs, request)
    first: Any = rows[0]
    won = set(zip(first.completed_ids, first.completed_tokens, strict=True))
    return won, in_claim_order([job for job in rows if job.pk is not None])


def in_claim_order(jobs: list[J]) -> list[J]:
    """RETURNING gives no order: hand jobs out in claim order."""
    jobs.sort(key=lambda job: (not job.taken_over, -job.priority, job.run_at, job.pk))  # type: ignore[attr-defined]
    return jobs


def claim_args(
    qs: LeaseReads[J], owner: str, ttl: float | timedelta, kinds: Collection[str] | None
) -> tuple[float, list[str] | None]:
    """Check a claim's arguments; return the TTL in seconds and the kinds as a list.

    Raises InvalidArgument for a filtered queryset: a claim takes from the whole queue, so
    it would ignore the filters, and take jobs they leave out."""
    if qs.query.has_filters():
        raise InvalidArgument(
            "claim() takes from the whole queue and cannot honour a queryset's filters: "
            "choose kinds with kinds=, or one job with claim_job(pk)"
        )
    seconds = to_seconds(ttl, "ttl")
    check_owner(owner)
    if kinds is None:
        return seconds, None
    return seconds, [check_kind(kind, "kinds") for kind in kinds]


class Route(NamedTuple):
    """Where the claims of a job model on a database go: the database's dialect, the quoted
    job table and the stock ledger's names (None: no ledger, or its own)."""

    dialect: Dialect
    table: str
    ledger: LedgerNames | None


@cache
def claim_route(model: type[AbstractLeasedJob], alias: str) -> Route:
    """Return the `Route` of `model`'s claims on `alias`, looked up once per process: the
    dialect (`dialect_of()`; a database alias keeps its backend), the table
    (`quoted_table()`) and the ledger names (`ledger_names()`), which are cached the same way."""
    ledger = ledger_names(model, alias)
    return Route(dialect_of(connections[alias]), quoted_table(model, alias), ledger)


@retry_deadlocks
def claim_by_dialect(
    qs: LeaseReads[J],
    owner: str,
    seconds: float,
    limit: int,
    kinds: Wanted,
    *,
    atomic: bool = True,
    dialect: Dialect | None = None,
    stock_ledger: bool = True,
    takeover: bool = True,
) -> list[J]:
    """Claim with the database's dialect (`Dialect.claim()`: its own statements, or the ORM's),
    with the ledger's rows, in a transaction of its own or (not `atomic`) in the caller's.

    `dialect`: another one (tests hold each database's statements to the base `Dialect()`, the
    ORM's specification); not `stock_ledger`: the ORM writes the stock ledger's rows."""
    route = claim_route(qs.model, qs.db)
    jobs, request = handed_to_dialect(
        qs, owner, seconds, limit, kinds, stock_ledger=stock_ledger, takeover=takeover
    )
    return in_claim_order((dialect or route.dialect).claim(jobs, request, atomic=atomic))


def handed_to_dialect(
    qs: LeaseReads[J],
    owner: str,
    seconds: float,
    limit: int,
    kinds: Wanted,
    *,
    stock_ledger: bool = True,
    takeover: bool = True,
) -> tuple[Jobs[J], sql.Claim]:
    """What a claim hands its dialect: the job table (`dialects.Jobs`: where it is, how its
    rows become models, the ORM's own claim pass and ledger rows) and the request
    (`statements.Claim`: the kinds' and the takeover guard's fragments, each kind's own lease
    length)."""
    route = claim_route(qs.model, qs.db)
    jobs = Jobs(
        connections[qs.db],  # this thread's: a connection is never shared between threads
        route.table,
        route.ledger if stock_ledger else None,
        rows=partial(raw_rows, qs),
        claim_pass=partial(claim_pass_locking, qs, owner, seconds, kinds=kinds),
        open_attempts=partial(open_attempts, qs, owner=owner),
    )
    # The takeover guard's fragment and `kinds`' fragment; every kind has none.
    guard = takeover_guard()[1]
    # The paused kinds' subquery (`pauses.paused_clause()`, built once per table).
    paused, paused_params = paused_clause(qs.model, qs.db)
    wanted: tuple[str, sql.Params]
    if kinds is None:  # every kind: only the paused left out, and every kind's own lease length
        wanted, lengths = (f"AND kind NOT IN ({paused})", {}), lease_lengths_of(seconds, None)
    else:
        wanted, lengths = kinds_filter(kinds, paused), lengths_of(seconds, kinds)
    wanted = (wanted[0], {**wanted[1], **paused_params})
    request = sql.Claim(owner, seconds, limit, wanted, guard, None, lengths, paused, takeover)
    return jobs, request


TAKEOVER_ORDER: tuple[str, ...] = ("lease_until",)
"""The claim order of expired leases: the oldest first."""
DUE_ORDER: tuple[str, ...] = ("-priority", "run_at", "id")
"""The claim order of due jobs."""


def claim_pass_locking(
    qs: LeaseReads[J], owner: str, seconds: float, limit: int, takeover: bool, *, kinds: Wanted
) -> list[J]:
    """One pass of the ORM's claim (`dialects.base.in_passes()` runs two): the specification,
    which MariaDB/MySQL's statements write out (`dialects.mysql.locking_passes()`)."""
    # MariaDB/MySQL have no UPDATE ... RETURNING and refuse a LIMIT in an IN subquery on
    # the table being updated. So: lock candidates with FOR UPDATE SKIP LOCKED (MariaDB
    # 10.6+, MySQL 8+), then the conditional UPDATE restating the predicate decides, then
    # read back the rows we now own. The row locks, held to commit, make the read exact.
    # Tested on MariaDB 10.11.
    if isinstance(kinds, AllBut):
        base = qs._claimable_pass(None, takeover).exclude(kind__in=kinds)
    else:
        base = qs._claimable_pass(kinds, takeover)
    base = base.exclude(kind__in=paused_rows(qs.db).of_table(qs.model).values("kind"))
    order = TAKEOVER_ORDER if takeover else DUE_ORDER
    if isinstance(kinds, list) and len(set(kinds)) > 1:
        ids = lock_merged(qs, base, sorted(set(kinds)), takeover, limit)
    else:
        # Every kind, or one: one ordered range of an index, locked row by row up to LIMIT.
        ids = list(
            base.select_for_update(skip_locked=True)
            .order_by(*order)
            .values_list("pk", flat=True)[:limit]
        )
    if not ids:
        return []
    won = base.filter(pk__in=ids).update(**claim_values(owner, seconds, lengths_of(seconds, kinds)))
    if won == 0:
        return []
    return list(qs.filter(pk__in=ids, status=PROCESSING, lease_owner=owner).order_by(*order))


def lock_merged(
    qs: LeaseReads[J], base: LeaseReads[J], kinds: list[str], takeover: bool, limit: int
) -> list[int]:
    """Lock up to `limit` jobs of `base` (claimable jobs of several `kinds`) in claim order,
    and no other row; return their ids.

    One locking SELECT of `kind IN (...)` in claim order walks the index led by `status` past
    every other kind's jobs (MariaDB), and a locking read of each kind's range would lock every
    row it reads before the merge sorts them (InnoDB). So the candidates are read without
    locks (`merged_candidates()`), then locked by primary key in their order, as many at a time
    as are still wanted, each lock restating `base`'s whole predicate with SKIP LOCKED: a row
    another transaction holds, or that changed since the read, is passed over, never waited
    for (`dialects.merge.lock_in_order()`, which MariaDB/MySQL's own statements share). Tested on
    MariaDB 10.11, PostgreSQL 15 and SQLite.
    """

    def lock(chunk: list[int]) -> list[int]:
        rows = base.filter(pk__in=chunk).select_for_update(skip_locked=True)
        return list(rows.values_list("pk", flat=True))

    return merge.lock_in_order(
        lambda count: merged_candidates(qs, kinds, takeover, count), lock, limit
    )


def merged_candidates(qs: LeaseReads[J], kinds: list[str], takeover: bool, count: int) -> list[int]:
    """Return the ids of the first `count` claimable jobs of `kinds` in claim order, read
    without locks: each kind's first `count` from its own range of the index led by `kind` (so
    no other kind's backlog is walked), in one UNION ALL where the database takes ordered,
    limited arms (SQLite: one read each), merged here."""
    order = TAKEOVER_ORDER if takeover else DUE_ORDER
    columns = ("pk", "lease_until") if takeover else ("pk", "priority", "run_at")
    candidates = qs._claimable_pass(None, takeover).order_by(*order).values_list(*columns)
    candidates = candidates.exclude(kind__in=paused_rows(qs.db).of_table(qs.model).values("kind"))
    arms = [candidates.filter(kind=kind)[:count] for kind in kinds]
    if connections[qs.db].features.supports_slicing_ordering_in_compound:
        rows = list(arms[0].union(*arms[1:], all=True))
    else:
        rows = [row for arm in arms for row in arm]
    return merge.in_claim_order(rows, takeover, count)


def claim_values(owner: str, seconds: float, lengths: Lengths) -> dict[str, Any]:
    return {
        "status": PROCESSING,
        "lease_owner": owner,
        "lease_until": lease_until(seconds, lengths),
        "heartbeat_at": Now(),
        "lease_token": next_token(),
        "attempts": F("attempts") + 1,
    }
