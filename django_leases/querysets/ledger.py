"""The attempt ledger: one row per lease acquisition, opened by the claim, closed once.

Its writes are made by `LeaseQuerySet`'s transitions, in the transaction of the job's own
UPDATE, through the functions below (each taking the job queryset first); nothing else
writes the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import TYPE_CHECKING, Any

from django.db import connections, models
from django.db.models import F, OuterRef, Q, Subquery
from django.db.models.functions import Now

from django_leases.dialects.postgresql_statements import LedgerNames
from django_leases.limits import MAX_ERROR_LENGTH
from django_leases.querysets.base import LEDGER_KEY, LeaseKey, key_groups, keys_filter
from django_leases.querysets.reads import J, LeaseReads, attempt_ledger
from django_leases.redaction import error_text
from django_leases.status import HOLDER_OUTCOMES, AttemptOutcome

if TYPE_CHECKING:
    from django_leases.models import AbstractJobAttempt, AbstractLeasedJob


MAX_ERROR_CLASS_LENGTH = 255

# The ledger columns the PostgreSQL fast paths write: a ledger model with other fields (a
# project's own AbstractJobAttempt subclass that adds some) takes the ORM path instead.
LEDGER_FIELDS = {
    "id", "job", "job_ref", "attempt", "token", "owner", "claimed_at", "last_heartbeat_at",
    "lease_until", "checkpoint", "ended_at", "outcome", "ended_by", "fenced_at", "error_class",
    "error_message", "resolution", "resolved_by", "resolved_at",
}  # fmt: skip


def describe_error(error: BaseException | str) -> tuple[str, str]:
    """Return (error class, message) for the ledger: never the payload, never a traceback.

    An exception's message goes through the `REDACT_ERRORS` hook (see `redaction`); a string
    (an operator's reason) is kept as given.
    """
    if isinstance(error, BaseException):
        cls = type(error)
        name = (
            cls.__qualname__
            if cls.__module__ == "builtins"
            else f"{cls.__module__}.{cls.__qualname__}"
        )
        # Cut to the ledger's column: an error that cannot be stored must still end the attempt.
        if len(name) > MAX_ERROR_CLASS_LENGTH:
            name = name[: MAX_ERROR_CLASS_LENGTH - 1] + "…"
        return storable(name), storable(error_text(error))[:MAX_ERROR_LENGTH]
    # Cut before escaping, too: a reason of any length costs no more than one of the column's.
    return "", storable(str(error)[:MAX_ERROR_LENGTH])[:MAX_ERROR_LENGTH]


def storable(text: str) -> str:
    """Return `text` with what no database column stores escaped: NUL characters (PostgreSQL
    refuses them) and lone surrogates (not UTF-8), as backslash escapes."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@cache
def ledger_names(model: type[AbstractLeasedJob], alias: str) -> LedgerNames | None:
    """Build the quoted ledger names of `model` once per process (claim and complete are hot).

    None where the raw-SQL paths do not apply: no ledger, or a ledger with fields of its own.
    """
    ledger = attempt_ledger(model)
    if ledger is None:
        return None
    fields = {field.name: field for field in ledger._meta.concrete_fields}
    if set(fields) != LEDGER_FIELDS:
        return None
    quote = connections[alias].ops.quote_name
    return LedgerNames(
        table=quote(ledger._meta.db_table),
        columns={name: quote(str(field.column)) for name, field in fields.items()},
    )


class AttemptQuerySet(models.QuerySet[Any]):
    """Reads of the attempt ledger (its writes are the functions of this module)."""

    def open(self) -> AttemptQuerySet:
        return self.filter(ended_at__isnull=True)


def attempt_rows(qs: LeaseReads[J], pk: int) -> list[AbstractJobAttempt]:
    """Return the ledger rows of job `pk`, oldest acquisition first; [] without a ledger."""
    ledger = qs._ledger()
    if ledger is None:
        return []
    return list(ledger.objects.using(qs.db).filter(job_ref=pk).order_by("token"))


def job_column(qs: LeaseReads[J], name: str) -> Subquery:
    return Subquery(qs.model._base_manager.filter(pk=OuterRef("job_ref")).values(name)[:1])


def open_attempts(qs: LeaseReads[J], jobs: Iterable[J], owner: str) -> None:
    ledger = qs._ledger()
    jobs = list(jobs)
    if ledger is None or not jobs:
        return
    taken = [job.pk for job in jobs if getattr(job, "taken_over", False)]
    if taken:
        # The previous holders of expired leases lost them to this claim.
        ledger.objects.using(qs.db).filter(job_ref__in=taken, ended_at__isnull=True).update(
            outcome=AttemptOutcome.LEASE_LOST, ended_at=Now(), ended_by=owner
        )
    ledger.objects.using(qs.db).bulk_create(
        ledger(
            # `job` is the concrete ledger's foreign key (see AbstractJobAttempt).
            **{"job_id": job.pk},
            job_ref=job.pk,
            attempt=job.attempts,
            token=job.lease_token,
            owner=owner,
            last_heartbeat_at=job.heartbeat_at,
            lease_until=job.lease_until,
            checkpoint=job.checkpoint,
        )
        for job in jobs
    )


def finished_by(qs: LeaseReads[J], pk: int, owner: str, token: int) -> bool:
    """Whether `owner`'s own write under `token` ended that attempt (completed, failed,
    retried, released or timed out).

    A holder whose connection died after sending its completion asks this before it calls
    itself fenced out: its write may have committed with only the acknowledgement lost. The
    attempt's ledger row answers, not the job row: a watcher's rescue also moves the job out
    of processing under the same token, but closes the row as someone else. A job table
    without a ledger cannot tell the two apart, so the answer there is always False.
    """
    ledger = qs._ledger()
    if ledger is None:
        return False
    return (
        ledger.objects.using(qs.db)
        .filter(
            job_ref=pk,
            token=token,
            ended_by=owner,
            outcome__in=HOLDER_OUTCOMES,
            ended_at__isnull=False,  # a time-out's row stays open while its handler runs
        )
        .exists()
    )


def ledger_update(
    qs: LeaseReads[J], leases: Iterable[LeaseKey], where: Q | None = None, **values: Any
) -> int:
    """Update the ledger rows of `leases` ((job id, token) pairs) that match `where`."""
    ledger = qs._ledger()
    if ledger is None:
        return 0
    rows = ledger.objects.using(qs.db)
    return sum(
        rows.filter(keys_filter(group, LEDGER_KEY), where or Q()).update(**values)
        for group in key_groups(leases)
    )


def record_fenced(qs: LeaseReads[J], pk: int, token: int) -> None:
    """Note in the ledger that the holder of `token` came back and was refused.

    Never on a row the holder closed itself (a repeated completion is refused too, but
    nobody fenced that holder out).
    """
    record_fenced_many(qs, [(pk, token)])


def record_fenced_many(qs: LeaseReads[J], leases: Iterable[LeaseKey]) -> None:
    """`record_fenced()` for every (job id, token) pair of `leases`, in one UPDATE."""
    closed_by_holder = Q(outcome__in=HOLDER_OUTCOMES, ended_by=F("owner"))
    ledger_update(qs, leases, ~closed_by_holder & Q(fenced_at__isnull=True), fenced_at=Now())
