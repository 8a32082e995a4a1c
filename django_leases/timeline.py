"""A payment's timeline: for one payment id, every job, its attempts (the ledger), their last
heartbeats and checkpoints, its recorded steps and its operator events, on one time axis.

Read-only. A heartbeat renews the lease in place and leaves no row behind, so an attempt shows
its last heartbeat (the ledger's, or the job's own while its attempt runs), not each one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.apps import apps
from django.db.models.functions import Now
from django.utils.translation import gettext

from django_leases.status import LEASED_STATUSES, AttemptOutcome, EventAction, JobStatus
from django_leases.tables import ledger_model

# A payment has a handful of jobs, each a handful of attempts: the bound keeps an id shared by
# many jobs from loading a table.
MAX_JOBS = 200
SECOND = timedelta(seconds=1)


@dataclass(frozen=True)
class Entry:
    """One moment of the timeline: when, which job (and attempt), what happened, in detail."""

    at: datetime
    job: int
    kind: str
    what: str
    detail: str = ""
    attempt: int | None = None
    # Among entries of one second: a job's enqueue first, its end last.
    order: int = 0


@dataclass(frozen=True)
class Timeline:
    """The entries in time order, the jobs they cover (at most MAX_JOBS, the newest) and the
    database clock's now when they were read."""

    payment_id: str
    entries: list[Entry]
    jobs: list[Any]
    now: datetime | None
    truncated: bool


def payment_timeline(jobs: Any, payment_id: str) -> Timeline:
    """Return the timeline of `payment_id` among `jobs` (a job table's queryset with a
    `payment_id` field, on the database to read)."""
    found = list(
        jobs.filter(payment_id=payment_id)
        .annotate(read_at=Now())
        .defer("payload", "result")
        .order_by("-pk")[: MAX_JOBS + 1]
    )
    truncated = len(found) > MAX_JOBS
    found = sorted(found[:MAX_JOBS], key=lambda job: job.pk)
    entries: list[Entry] = []
    for job in found:
        entries += job_entries(job)
    if found:
        model, using = type(found[0]), jobs.db
        pks = [job.pk for job in found]
        kinds = {job.pk: job.kind for job in found}
        entries += attempt_entries(model, using, pks, kinds)
        entries += step_entries(model, using, pks, kinds)
        entries += event_entries(model, using, pks, kinds)
    entries.sort(key=lambda e: (e.at, e.order, e.job, e.attempt or 0))
    now = found[0].read_at if found else None
    return Timeline(payment_id, entries, found, now, truncated)


def job_entries(job: Any) -> list[Entry]:
    """The job's enqueue, its due time if later, its live lease's last heartbeat, its end."""
    entries = [Entry(job.created_at, job.pk, job.kind, gettext("enqueued"), job.lock, order=0)]
    if job.run_at > job.created_at:
        entries.append(Entry(job.run_at, job.pk, job.kind, gettext("due"), order=1))
    if job.status in LEASED_STATUSES and job.heartbeat_at is not None:
        detail = job.checkpoint and gettext("checkpoint %(c)s") % {"c": job.checkpoint}
        entries.append(
            Entry(
                job.heartbeat_at,
                job.pk,
                job.kind,
                gettext("last heartbeat (running)"),
                detail,
                attempt=job.attempts,
                order=4,
            )
        )
    if job.completed_at is not None:
        status = JobStatus(job.status).label
        entries.append(
            Entry(job.completed_at, job.pk, job.kind, str(status), job.last_error, order=9)
        )
    return entries


def attempt_entries(
    model: type[Any], using: str, pks: list[int], kinds: dict[int, str]
) -> list[Entry]:
    """Each attempt's claim, last heartbeat, end, fencing out and review verdict."""
    ledger = ledger_model(model)
    if ledger is None:
        return []
    entries: list[Entry] = []
    for row in ledger.objects.using(using).filter(job_ref__in=pks).order_by("job_ref", "token"):
        job, kind, n = row.job_ref, kinds[row.job_ref], row.attempt
        claimed = gettext("attempt %(n)d claimed by %(owner)s (token %(token)d)") % {
            "n": n,
            "owner": row.owner,
            "token": row.token,
        }
        entries.append(Entry(row.claimed_at, job, kind, claimed, attempt=n, order=2))
        # The claim sets the first heartbeat; a later one is a heartbeat of its own.
        if row.last_heartbeat_at is not None and row.last_heartbeat_at - row.claimed_at >= SECOND:
            detail = row.checkpoint and gettext("checkpoint %(c)s") % {"c": row.checkpoint}
            what = gettext("attempt %(n)d: last heartbeat") % {"n": n}
            entries.append(Entry(row.last_heartbeat_at, job, kind, what, detail, n, order=4))
        if row.ended_at is not None:
            what = gettext("attempt %(n)d ended: %(outcome)s") % {
                "n": n,
                "outcome": AttemptOutcome(row.outcome).label,
            }
            error = ": ".join(filter(None, [row.error_class, row.error_message]))
            detail = "; ".join(filter(None, [row.ended_by, row.checkpoint, error]))
            entries.append(Entry(row.ended_at, job, kind, what, detail, n, order=6))
        if row.fenced_at is not None:
            what = gettext("attempt %(n)d: its holder came back and was fenced out") % {"n": n}
            entries.append(Entry(row.fenced_at, job, kind, what, attempt=n, order=7))
        if row.resolved_at is not None:
            what = gettext("attempt %(n)d: review resolved %(verdict)s") % {
                "n": n,
                "verdict": row.resolution,
            }
            entries.append(Entry(row.resolved_at, job, kind, what, row.resolved_by, n, order=7))
    return entries


def records(label: str | None, using: str, pks: list[int]) -> list[Any]:
    """The rows of the jobs `pks` in the record `label` names (steps, events), in the order
    they were written; none for a job table without that record."""
    if not label:
        return []
    rows = apps.get_model(label)._default_manager.using(using)
    return list(rows.filter(job_ref__in=pks).order_by("id"))


def step_entries(
    model: type[Any], using: str, pks: list[int], kinds: dict[int, str]
) -> list[Entry]:
    """Each step a handler recorded (`lease.step()`)."""
    return [
        Entry(
            step.recorded_at,
            step.job_ref,
            kinds[step.job_ref],
            gettext("step %(name)s recorded") % {"name": step.name},
            attempt=step.attempt,
            order=5,
        )
        for step in records(model.step_model, using, pks)
    ]


def event_entries(
    model: type[Any], using: str, pks: list[int], kinds: dict[int, str]
) -> list[Entry]:
    """Each operator action on the jobs: who, why, what it changed."""
    entries = []
    for event in records(model.event_model, using, pks):
        what = gettext("%(action)s by %(by)s") % {
            "action": EventAction(event.action).label,
            "by": event.by,
        }
        changes = "; ".join(
            f"{name}: {old!r} → {new!r}" for name, (old, new) in (event.changes or {}).items()
        )
        detail = "; ".join(filter(None, [event.reason, changes]))
        entries.append(Entry(event.at, event.job_ref, kinds[event.job_ref], what, detail, order=8))
    return entries
