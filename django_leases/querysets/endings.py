"""Where an execution ends: the one seam every end of a job's execution goes through, and the
one place what the execution held is given back.

An execution ends when its job leaves processing or stopping: completed (`complete()`,
`complete_many()`, the completions of `complete_and_claim()`), failed or retried (`fail()`),
released (`release()`), stopped (`time_out()`, an operator's `cancel()` of a running job), rescued
by the watcher (`rescue()`), ended by an operator (`requeue()`, `release_stuck()`, `mark_failed()`,
`cancel()`, `resolve_review()`), or, once stopped, acknowledged by its holder
(`acknowledge_stops()`) or by the watcher once its lease expired (`end_expired_stops()`).

Each of them describes its end as an `Ending`: the job's new columns, which rows give their lock
back, what the attempt's ledger row records. `end_one()` applies it to one row (one conditional
UPDATE), `end_executions()` to a batch (the rows locked, then one UPDATE restating the
precondition). Both write the UPDATE (with the lock's release: `lock_holder` is cleared here
only), then `give_back()` what the ended executions held, then close their ledger rows, in one
transaction. The database's one-statement completions (`Dialect.complete()`,
`Dialect.complete_many()`, the claim with completions ahead of it) are asked for here, for the
jobs that hold nothing to give back; the others take the general path.

A stopped job (status stopping, the status it will end as in `ends_as`, its ledger row given its
outcome but left open) keeps its lock and counts against its kind's `limit=` (its lease is live)
while its holder may still run the handler; nobody renews or claims it, so its lease runs out
within one TTL. Its execution ends when its holder acknowledges the stop or once its lease has
expired: the job takes `ends_as`, a final one releases its lock, and the ledger row is closed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from django.db import IntegrityError, connections, transaction
from django.db.models import Case, Exists, F, OuterRef, PositiveBigIntegerField, Q, Value, When
from django.db.models.functions import Now

from django_leases.dialects import Dialect, Jobs, dialect_of
from django_leases.exceptions import LeaseError
from django_leases.limits import check_owner
from django_leases.querysets.base import (
    LeaseKey,
    bound_cursor,
    key_groups,
    keys_filter,
    lease_keys,
    quoted_table,
    retry_deadlocks,
)
from django_leases.querysets.groups import GroupMember, note_ends
from django_leases.querysets.ledger import J, job_column, ledger_names, ledger_update
from django_leases.querysets.locks import in_lock_rounds, table_jobs
from django_leases.querysets.reads import LeaseReads
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    PROCESSING,
    STOPPING,
    WAITING,
    AttemptOutcome,
)

ENDINGS_PER_BATCH = 500
"""Stopped executions one ending transaction ends at most (one locking read, one UPDATE)."""

RELEASING = (CANCELLED, FAILED)
"""The `ends_as` statuses that release the job's lock: the final ones a stop leads to."""


@dataclass(frozen=True)
class Ending:
    """How executions end: what their jobs become and what their attempts' ledger rows record."""

    values: Mapping[str, Any]
    """The job's new columns: its status (a word, or an expression of the row as it was) and
    what goes with it, never `lock_holder` (written from `releases`). MariaDB/MySQL evaluate SET
    left to right, each assignment seeing the columns set before it: the columns that the
    expressions read go last."""
    releases: Q | bool = True
    """The rows that give their lock back: all, none, or those matching (as they were)."""
    outcome: str | Mapping[str, str] | None = None
    """What the attempt's ledger row records: an outcome, one per status the job ended in
    (`fail()`: failed or retried), or None: the outcome its stop gave it."""
    closes: bool = True
    """Whether the attempt's ledger row is closed (a verdict on a job under review leaves the
    row closed when the job went under review as it is)."""
    by: str = ""
    error: tuple[str, str] | None = None
    stops: bool = False
    """Whether some jobs may be stopping after it (a time-out, an operator's cancel of a
    running job): their ledger rows get the outcome but stay open until the execution ends."""
    contested: bool = False
    """Whether a lock may have been taken meanwhile: an operator action on jobs that did not
    all hold their lock (see `pass_lock()`)."""


HOLDS_NOTHING = Q(lock="", dependents__isnull=True)
"""The jobs whose execution holds nothing to give back: no lock, and no job waits on them."""


class Ended(NamedTuple):
    """A row `end_executions()` ended, as it was before."""

    pk: int
    token: int
    attempts: int
    lock: str
    ends_as: str
    dependents: Any

    @property
    def holds(self) -> bool:
        """Whether its execution held something to give back (a lock, jobs waiting on it)."""
        return bool(self.lock) or self.dependents is not None


def completion(owner: str, **values: Any) -> Ending:
    """The holder's completion of its job (`values`: its result)."""
    columns = {"status": COMPLETED, "completed_at": Now(), "last_error": "", **values}
    return Ending(columns, outcome=AttemptOutcome.COMPLETED, by=owner)


def end_one(qs: LeaseReads[J], row: LeaseReads[J], key: LeaseKey, ending: Ending) -> str | None:
    """End the execution of the job `row` selects (the job of `key`, (job id, token), with its
    whole precondition): one conditional UPDATE, what it held given back, its ledger row closed,
    in one transaction (the caller's, if any). Return the status it ended in; None if `row`
    matched nothing (its lease was lost).

    A job that holds nothing to give back is updated in one statement; a job of a lock, or
    one others wait on, fails that statement's `lock = '' AND dependents IS NULL`, takes the
    second, which releases its lock, and gives back what it held.
    """
    with transaction.atomic(using=qs.db, savepoint=False):
        if ending.releases is False:
            won = bool(row.update(**ending.values))
        elif row.filter(HOLDS_NOTHING).update(**ending.values):
            won = True
        elif row.exclude(HOLDS_NOTHING).update(**released(ending), **ending.values):
            give_back(qs, [key[0]], contested=ending.contested)
            won = True
        else:
            won = False
        if not won:
            return None
        status = ending.values.get("status")
        if not isinstance(status, str):
            # The row is ours until commit; read back which status the UPDATE chose.
            status = str(qs.filter(pk=key[0]).values_list("status", flat=True).get())
        close(qs, [key], ending, status)
    return status


def end_executions(
    qs: LeaseReads[J], where: Q, ending: Ending, *, limit: int | None = ENDINGS_PER_BATCH
) -> list[Ended]:
    """End the executions of the jobs of `qs` that match `where`, `limit` at most, in id order,
    in one transaction (the caller's, if any); return the rows ended, as they were.

    The rows are locked, then ONE UPDATE restating `where` changes exactly the rows locked
    (PostgreSQL and MariaDB/MySQL lock them; SQLite holds its write lock); then what they held
    is given back and their ledger rows are closed.
    """
    with transaction.atomic(using=qs.db, savepoint=False):
        locking = qs.filter(where).order_by("pk").select_for_update()
        columns = locking.values_list(
            "pk", "lease_token", "attempts", "lock", "ends_as", "dependents"
        )
        rows = [Ended(*row) for row in (columns if limit is None else columns[:limit])]
        if not rows:
            return []
        won = qs.filter(where, pk__in=[row.pk for row in rows]).update(
            **released(ending), **ending.values
        )
        if won != len(rows):
            raise LeaseError(f"{won} of {len(rows)} locked jobs ended; rolled back")
        give_back(qs, [row.pk for row in rows if row.holds], contested=ending.contested)
        close(qs, [(row.pk, row.token) for row in rows], ending, None)
    return rows


def released(ending: Ending) -> dict[str, Any]:
    """The UPDATE's release of the locks of the rows `ending.releases` selects: the one write
    of `lock_holder` that gives a lock back. It goes first: its condition reads the row as it
    was (MariaDB/MySQL)."""
    if ending.releases is False:
        return {}
    if ending.releases is True:
        return {"lock_holder": None}
    return {"lock_holder": Case(When(ending.releases, then=None), default=F("lock_holder"))}


def give_back(qs: LeaseReads[J], pks: Iterable[int], *, contested: bool = False) -> None:
    """Give back what the ended executions of the jobs `pks` (each of a lock, or waited on)
    held, in the transaction of the UPDATE that ended them, after it: the one place where it
    is done.

    - Its lock: a job whose UPDATE released it passes it to the first job waiting for it
      (`pass_lock()`), in id order, the order the rows were locked.
    - Its `limit=` slot: given back by the UPDATE's status itself (a kind's limit counts its
      processing and stopping jobs); nothing to do here.
    - The jobs waiting on it (`enqueue(after=...)`, a group's callback): a completed job
      counts for each of them, any end for a callback (`groups`), and those whose last
      prerequisite it was are released (`release_dependents()`), after the locks passed on, in
      the same transaction: exactly once, whoever ends last.
    """
    ended = sorted(pks)
    for pk in ended:
        pass_lock(qs, pk, contested=contested)
    if ended:
        release_dependents(qs, ended)


def close(qs: LeaseReads[J], keys: list[LeaseKey], ending: Ending, status: str | None) -> None:
    """Close the open ledger rows of `keys` ((job id, token) pairs) as `ending` says, `status`
    the job's new one (None: a batch); a closed attempt is never rewritten."""
    if not ending.closes:
        return
    values: dict[str, Any] = {"ended_at": Now(), "checkpoint": job_column(qs, "checkpoint")}
    if ending.stops:
        stopping = qs.model._base_manager.filter(pk=OuterRef("job_ref"), status=STOPPING)
        values["ended_at"] = Case(When(Exists(stopping), then=None), default=Now())
    outcome = ending.outcome
    if isinstance(outcome, Mapping):
        if status is None:
            raise LeaseError("an outcome per status needs the status of one job")
        outcome = outcome[status]
    if outcome is not None:
        error_class, message = ending.error or ("", "")
        values |= {"outcome": outcome, "ended_by": ending.by}
        values |= {"error_class": error_class, "error_message": message}
    ledger_update(qs, keys, Q(ended_at__isnull=True), **values)


def pass_lock(qs: LeaseReads[J], pk: int, *, contested: bool = False) -> None:
    """If job `pk` no longer holds its lock, make the lock's first waiting job pending.

    Called in the transaction of the UPDATE that released the lock, after it: that UPDATE
    holds the row lock every enqueue of the lock takes first, so no job of the lock is
    left waiting unseen. `contested`: the lock may have been taken meanwhile (an operator
    requeued a finished job of a busy lock), so a unique conflict only means it is held.
    """
    jobs = table_jobs(qs)
    lock = (
        jobs.filter(pk=pk, lock_holder__isnull=True)
        .exclude(lock="")
        .values_list("lock", flat=True)
        .first()
    )
    if lock is None or (contested and jobs.filter(lock_holder=lock).exists()):
        return
    # FOR UPDATE: a waiting job cancelled meanwhile is re-checked and skipped, never
    # promoted from a stale read. Lowest id first: enqueue order.
    first = list(
        jobs.select_for_update()
        .filter(status=WAITING, lock=lock, unmet=0)
        .order_by("pk")
        .values_list("pk", flat=True)[:1]
    )
    if not first:
        return
    promote = jobs.filter(pk=first[0], status=WAITING)
    if not contested:
        promote.update(status=PENDING, lock_holder=F("lock"))
        return
    try:
        with transaction.atomic(using=qs.db):
            promote.update(status=PENDING, lock_holder=F("lock"))
    except IntegrityError:
        return  # an enqueue took the free lock first: our job waits behind it


def release_dependents(qs: LeaseReads[J], ended_pks: Collection[int]) -> list[int]:
    """Count the ends of the jobs `ended_pks` for each job waiting on them, and release those
    whose last prerequisite (or group member) it was; return their ids.

    Call it in the transaction that ended them, after their UPDATE (which holds their rows)
    and after their locks were passed on. A dependent counts a completion; a group's callback
    counts any final status, and takes back a member requeued (`groups.note_ends()`). A
    released job without a lock becomes pending (due at its `run_at`); one with a lock takes it
    if free, else waits in its lock's line.
    """
    jobs = table_jobs(qs)
    listed = jobs.filter(pk__in=list(ended_pks), dependents__isnull=False)
    # How many of its prerequisites complete here, per dependent: two may complete in one batch;
    # and how each job listing it is now, per dependent (a callback reads every end).
    met: Counter[int] = Counter()
    ends: dict[int, list[GroupMember]] = {}
    for pk, kind, status, error, dependents in listed.values_list(
        "pk", "kind", "status", "last_error", "dependents"
    ):
        for dependent in dependents:
            met[dependent] += status == COMPLETED
            ends.setdefault(dependent, []).append(GroupMember(pk, kind, status, error))
    if not ends:
        return []
    # Lock the dependents (FOR UPDATE reads the latest committed count under READ COMMITTED
    # and REPEATABLE READ alike), then UPDATE exactly those rows. A prerequisite completing
    # at the same moment in another transaction waits here for our commit. A dependent
    # cancelled while it waited is counted too: requeued, it waits for what is left. Those
    # that nothing here completed for are locked only if they are callbacks.
    counted = Q(pk__in=[pk for pk in ends if met[pk]])
    rows = list(
        jobs.select_for_update()
        .filter(counted | Q(pk__in=sorted(ends), group_results__isnull=False), unmet__gt=0)
        .order_by("pk")
        .values_list("pk", "unmet", "lock", "status", "group_results")
    )
    by_count: dict[int, list[int]] = {}
    for pk, _, _, _, results in rows:
        if results is None and met[pk]:
            by_count.setdefault(met[pk], []).append(pk)
    for count, pks in by_count.items():
        jobs.filter(pk__in=pks, unmet__gte=count).update(
            # MariaDB/MySQL evaluate SET left to right, each assignment seeing the columns set
            # before it: status, which reads the count, goes first.
            status=Case(
                When(unmet=count, lock="", status=WAITING, then=Value(PENDING)),
                default=F("status"),
            ),
            unmet=F("unmet") - count,
        )
    released = [
        (pk, lock)
        for pk, unmet, lock, status, results in rows
        if results is None and unmet == met[pk] and status == WAITING
    ]
    callbacks = [row for row in rows if row[4] is not None]
    released += note_ends(qs, callbacks, ends) if callbacks else []
    # In id order, dependents and callbacks alike: the order of a lock's line.
    for pk, lock in sorted(released):
        if lock:
            join_lock(qs, pk, lock)
    return [pk for pk, _ in released]


def join_lock(qs: LeaseReads[J], pk: int, lock: str) -> None:
    """Let the released job `pk` take its free `lock`, or leave it waiting in the lock's line
    (by id), where the holder's end passes the lock on to it: the rounds of a new job's
    enqueue (`locks.in_lock_rounds()`)."""
    jobs = table_jobs(qs)

    def take() -> bool | None:
        try:
            with transaction.atomic(using=qs.db):
                jobs.filter(pk=pk, status=WAITING, unmet=0).update(
                    status=PENDING, lock_holder=F("lock")
                )
                return True
        except IntegrityError:
            return None  # taken meanwhile: the next round finds its holder

    in_lock_rounds(qs, lock, lambda: False, take)


# ---- completions: the database's one-statement paths for jobs that hold nothing to give back --

AtOnce = Callable[[list[LeaseKey]], set[LeaseKey]]
"""A completion of the held jobs without a lock among some keys in one statement, outside a
transaction block; it returns the (job id, token) pairs it completed."""


@retry_deadlocks
def complete_at_once(qs: LeaseReads[J], owner: str, key: LeaseKey) -> bool:
    """Complete the job of `key` without a lock in one statement where the database has one
    (`Dialect.complete()`); False leaves the job (lost, or of a lock) to `end_one()`."""
    ledger = ledger_names(qs.model, qs.db)
    dialect = dialect_of(connections[qs.db])
    if ledger is None or not dialect.completes_at_once:
        return False
    with bound_cursor(qs.db) as cursor:
        return dialect.complete(cursor, quoted_table(qs.model, qs.db), ledger, owner, key)


def complete_many_by_dialect(
    qs: LeaseReads[J],
    owner: str,
    keys: list[LeaseKey],
    *,
    at_once: AtOnce | None = None,
    dialect: Dialect | None = None,
) -> set[LeaseKey]:
    """Complete the jobs of `keys` that `owner` holds; return the pairs completed.

    The jobs without a lock by `at_once` (the claim's fused statement) or by the database's
    batched completion (`Dialect.complete_many()`, in its `completion_block()`: one statement on
    PostgreSQL, a transaction elsewhere); the jobs left (of a lock, or every job where the
    dialect writes none itself) by `complete_held()`, which gives back what they held.
    `dialect`: another one (tests hold each database's statements to the base `Dialect()`).
    """
    if at_once is not None:
        done = at_once(keys)
        left = [key for key in keys if key not in done]
        return done | (complete_held(qs, owner, left) if left else set())
    connection = connections[qs.db]
    jobs: Jobs[Any] = Jobs(
        connection,
        quoted_table(qs.model, qs.db),
        ledger_names(qs.model, qs.db),
        complete_unlocked=lambda groups: complete_held(
            qs, owner, [key for group in groups for key in group.items()]
        ),
    )
    dialect = dialect or dialect_of(connection)
    with dialect.completion_block(jobs):
        done = dialect.complete_many(jobs, owner, list(key_groups(keys)))
        left = [key for key in keys if key not in done]
        return done | (complete_held(qs, owner, left) if left else set())


@retry_deadlocks
def complete_held(qs: LeaseReads[J], owner: str, keys: list[LeaseKey]) -> set[LeaseKey]:
    """Complete the jobs of `keys` that `owner` still holds, jobs of a lock included, in one
    transaction (the caller's, if any): the general path, and the specification that the
    databases' batched statements write out for the jobs without a lock."""
    done: set[LeaseKey] = set()
    with transaction.atomic(using=qs.db, savepoint=False):
        for group in key_groups(keys):
            where = keys_filter(group) & Q(status=PROCESSING, lease_owner=owner)
            ended = end_executions(qs, where, completion(owner), limit=None)
            done.update((row.pk, row.token) for row in ended)
    return done


# ---- the end of a stopped execution ----------------------------------------------------------


def acknowledge_stops(
    qs: LeaseReads[J], owner: str, leases: Iterable[LeaseKey] | Mapping[int, int]
) -> dict[LeaseKey, str]:
    """End the stopped executions among `leases` ((job id, token) pairs) that `owner` held:
    their handlers are done. Return the status each one ended as; a lease not stopping under
    that token (completed, lost, taken over, ended already) is left alone."""
    check_owner(owner)
    ended: dict[LeaseKey, str] = {}
    for group in key_groups(lease_keys(leases)):
        ended.update(end_stops(qs, keys_filter(group) & Q(lease_owner=owner)))
    return ended


def end_expired_stops(qs: LeaseReads[J]) -> dict[LeaseKey, str]:
    """End the stopped executions whose lease expired (their holder died or ignores the stop),
    a batch at most; return the status each one ended as."""
    return end_stops(qs, Q(lease_until__lt=Now()))


@retry_deadlocks
def end_stops(qs: LeaseReads[J], where: Q) -> dict[LeaseKey, str]:
    """End the stopping jobs that match `where`, ENDINGS_PER_BATCH at most, in one transaction:
    each takes its `ends_as`, a final one giving its lock back; the ledger rows keep the
    outcome the stop gave them and close. Return the status each one ended as."""
    releases = Q(ends_as__in=RELEASING)
    ending = Ending(
        {
            # Every assignment that reads `ends_as` comes before it is cleared.
            "completed_at": Case(When(releases, then=Now()), default=None),
            # A cancelled job's token is one past its last lease, as an immediate cancel's.
            "lease_token": Case(
                When(ends_as=CANCELLED, then=F("lease_token") + 1),
                default=F("lease_token"),
                output_field=PositiveBigIntegerField(),
            ),
            "status": F("ends_as"),
            "ends_as": Value(""),
        },
        releases=releases,
    )
    rows = end_executions(qs, where & Q(status=STOPPING), ending)
    return {(row.pk, row.token): row.ends_as for row in rows}
