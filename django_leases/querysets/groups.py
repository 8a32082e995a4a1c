"""Groups: jobs enqueued together with a callback job that runs once every one of them has
ended (completed, failed or cancelled; a job under review has not ended), and reads how each
ended.

The callback is a dependent of each member (`dependencies`) that counts every end, not only
completions: it is inserted waiting, `waits_for` its members, `unmet` the members not ended,
and `group_results` (`{}` for a callback only) how each ended member ended, by id. Each member
lists it in `dependents`, so every end of a member goes through `endings.give_back()`, whose
`release_dependents()` locks the callback's row and writes the member's end in
(`note_ends()`), in the transaction that ended it: of two members ending at once, the second
waits for the first's commit and alone sees the count reach zero. A member an operator
requeues before the callback is released is taken out again (it has not ended); once
released, the callback's results no longer change.

The results are written on the callback's row, not read from the members when it runs: they
are what the release saw, they survive the members' pruning and the callback's retries, and
the claim hands them to the handler with no further statement (`Lease.group()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, cast

from asgiref.sync import sync_to_async
from django.db import transaction

from django_leases.exceptions import InvalidArgument, LeaseError
from django_leases.limits import shown
from django_leases.querysets.base import retry_deadlocks, writing_to
from django_leases.querysets.dependencies import add_dependents
from django_leases.querysets.enqueue import Enqueues, check_idempotency_field, job_row, job_values
from django_leases.querysets.keys import check_bound
from django_leases.querysets.ledger import J
from django_leases.querysets.locks import table_jobs
from django_leases.querysets.reads import LeaseReads
from django_leases.querysets.savepoints import enqueue_with_savepoints
from django_leases.status import FINAL_STATUSES, PENDING, WAITING

MAX_GROUP_MEMBERS = 500
"""Members one group may have: each end rewrites the callback's results (a JSON object)."""


class GroupMember(NamedTuple):
    """How a member of a group ended: its id, kind, final status and last error."""

    pk: int
    kind: str
    status: str
    last_error: str


@dataclass(frozen=True)
class Group(Generic[J]):
    """What `enqueue_group()` enqueued: the members, in the order given, and the callback."""

    members: list[J]
    callback: J


class EnqueuesGroups(Enqueues[J], Protocol[J]):
    """A queryset with `enqueue_group()` too: the awaitable form calls its own."""

    def enqueue_group(
        self, members: Iterable[Mapping[str, Any]], then: str, payload: Any = None, **options: Any
    ) -> Group[J]: ...


class _Existing(Exception):  # noqa: N818 - not an error: unwinds the transaction
    """The callback's idempotency key names a group enqueued before: roll back what this
    enqueue added and return that group."""

    def __init__(self, callback: Any) -> None:
        super().__init__(callback.pk)
        self.callback = callback


def enqueue_group(
    qs: LeaseReads[J],
    members: Iterable[Mapping[str, Any]],
    then: str,
    payload: Any = None,
    *,
    using: str | None = None,
    **options: Any,
) -> Group[J]:
    """Enqueue the `members` (each a dict of `enqueue()`'s arguments, `kind` included) and a
    callback job of kind `then` with `payload` and `options` (`enqueue()`'s, but `after`),
    which runs once every member has ended; all or nothing, in one transaction; return them.

    Members may use locks, limits and `after=`; they go to the group's database (`using`,
    else this queryset's, else the routers'). The callback's handler reads how each ended
    with `lease.group()`. The callback's `idempotency_key`, if it exists, returns the group
    enqueued with it and enqueues nothing. Raises `InvalidArgument` (naming `members[i]` or
    `callback`) and writes nothing for an empty group, a member of another database, or
    anything `enqueue()` refuses.
    """
    jobs = writing_to(qs, using)
    specs = member_specs(jobs, members)
    if "after" in options:
        raise InvalidArgument(
            "callback: a group's callback waits for its members; give after= to the members"
        )
    return _enqueue_group(jobs, specs, then, payload, options)


@retry_deadlocks
def _enqueue_group(
    qs: LeaseReads[J],
    specs: list[dict[str, Any]],
    then: str,
    payload: Any,
    options: dict[str, Any],
) -> Group[J]:
    # One transaction: a member or a callback refused rolls back every job before it.
    enqueues = cast("Enqueues[J]", qs)
    try:
        with transaction.atomic(using=qs.db):
            enqueued = []
            for position, spec in enumerate(specs):
                try:
                    enqueued.append(enqueues.enqueue(**spec))
                except InvalidArgument as exc:
                    raise type(exc)(f"members[{position}]: {exc}") from None
            pks = list(dict.fromkeys(job.pk for job in enqueued))
            try:
                callback, created = enqueue_callback(qs, then, payload, dict(options), pks)
            except InvalidArgument as exc:
                raise type(exc)(f"callback: {exc}") from None
            if not created:
                raise _Existing(callback)
    except _Existing as existing:
        return group_of(qs, existing.callback)
    return Group(enqueued, callback)


async def aenqueue_group(
    qs: EnqueuesGroups[J],
    members: Iterable[Mapping[str, Any]],
    then: str,
    payload: Any = None,
    **options: Any,
) -> Group[J]:
    """`enqueue_group()`, awaitable: the same arguments, rules and errors."""
    return await sync_to_async(qs.enqueue_group)(members, then, payload, **options)


def member_specs(qs: LeaseReads[J], members: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return each member's `enqueue()` arguments, on the group's database; raise
    `InvalidArgument` for what is not a list of such dicts, an empty or too large group, or a
    member of another database."""
    if isinstance(members, (str, bytes, Mapping)) or not isinstance(members, Iterable):
        raise InvalidArgument(
            f"members must be a list of dicts of enqueue() arguments, got {shown(members)}"
        )
    specs = []
    for position, member in enumerate(members):
        if not isinstance(member, Mapping) or "kind" not in member:
            raise InvalidArgument(
                f"members[{position}]: expected a dict of enqueue() arguments with a kind, "
                f"got {shown(member)}"
            )
        spec = dict(member)
        alias = spec.pop("using", qs.db)
        if alias != qs.db:
            raise InvalidArgument(
                f"members[{position}]: using={shown(alias)}, the group goes to {qs.db!r}: "
                "a group's jobs share one database"
            )
        specs.append(spec)
    if not specs:
        raise InvalidArgument(
            "members is empty: a group needs a member to wait for (enqueue the callback alone "
            "with enqueue())"
        )
    if len(specs) > MAX_GROUP_MEMBERS:
        raise InvalidArgument(f"members has {len(specs)} jobs; at most {MAX_GROUP_MEMBERS}")
    return specs


def enqueue_callback(
    qs: LeaseReads[J], then: str, payload: Any, options: dict[str, Any], pks: list[int]
) -> tuple[J, bool]:
    """Enqueue the callback of the members `pks` (enqueued in this transaction, or found by
    their keys) and list it on those not ended; return it, or the job of its idempotency key,
    and whether it is new.

    The members' rows are locked (FOR UPDATE, in id order) until commit: a member found ended
    is written into the results at once; one ending after our commit finds the callback in its
    `dependents`. Tested on PostgreSQL, MariaDB, SQLite."""
    key = options.pop("idempotency_key", None)
    values, delay = job_values(qs, then, **qs._enqueue_options(options))
    if key is not None:
        check_idempotency_field(qs.model)
    row = job_row(payload, key)
    rows = (
        table_jobs(qs)
        .select_for_update()
        .filter(pk__in=pks)
        .order_by("pk")
        .values_list("pk", "kind", "status", "last_error", "dependents")
    )
    ended, waiting = {}, {}
    for pk, kind, status, error, dependents in rows:
        if status in FINAL_STATUSES:
            ended[str(pk)] = GroupMember(pk, kind, status, error)._asdict()
        else:
            waiting[pk] = dependents or []
    values = {**values, "waits_for": pks, "unmet": len(waiting), "group_results": ended}
    if waiting:
        values["status"] = WAITING
    job, created = enqueue_with_savepoints(qs, values, row, delay)
    if created:
        add_dependents(qs, waiting, [job.pk])
    else:
        check_bound(job, then, row)
    return job, created


def group_of(qs: LeaseReads[J], callback: J) -> Group[J]:
    """Return the group whose callback is `callback`, its members in their order."""
    pks = callback.waits_for if getattr(callback, "group_results", None) is not None else None
    if not pks:
        raise InvalidArgument(
            f"callback: idempotency_key {getattr(callback, 'idempotency_key', None)!r} names "
            f"job {callback.pk}, which is not a group's callback"
        )
    found = {job.pk: job for job in table_jobs(qs).filter(pk__in=pks)}
    return Group([found[pk] for pk in pks if pk in found], callback)


def ended_members(job: Any) -> list[GroupMember]:
    """Return how each member of the group whose callback is `job` ended, in the group's
    order; raise `LeaseError` if it is no group's callback. Before its release, the members
    not ended yet are left out."""
    results = job.group_results
    if results is None:
        raise LeaseError(f"job {job.pk} of kind {job.kind!r} is no group's callback")
    return [GroupMember(**results[str(pk)]) for pk in job.waits_for if str(pk) in results]


def note_ends(
    qs: LeaseReads[J],
    callbacks: list[tuple[int, int, str, str, dict[str, Any]]],
    ends: Mapping[int, list[GroupMember]],
) -> list[tuple[int, str]]:
    """Write the ends of the members in `ends` (per callback, as the members are now) into the
    callbacks' rows `callbacks` ((id, unmet, lock, status, results), locked by the caller and
    not released yet); return the (id, lock) of those whose last member it was and that wait.

    A member in a final status is recorded (counted once however often it ends); one that is
    not (an operator requeued it) is taken out and waited for again. Called by
    `endings.release_dependents()` only, in the transaction that ended the members."""
    jobs = table_jobs(qs)
    released = []
    for pk, unmet, lock, status, results in callbacks:
        now = dict(results)
        for member in ends[pk]:
            if member.status in FINAL_STATUSES:
                now[str(member.pk)] = member._asdict()
            else:
                now.pop(str(member.pk), None)
        left = unmet - (len(now) - len(results))
        values: dict[str, Any] = {"group_results": now, "unmet": left}
        opens = left == 0 and status == WAITING
        if opens and not lock:
            values["status"] = PENDING
        # Restates what was read under the row lock: the count and the status.
        jobs.filter(pk=pk, unmet=unmet, status=status).update(**values)
        if opens:
            released.append((pk, lock))
    return released
