"""The overview's table per kind: its backlog, what runs it, its limits, whether it is paused,
and how long its jobs waited and ran (from the queue history) over the last hour.

Read-only, and bounded like `stats.py`: the backlog is one GROUP BY over the pending-only due
index, the running jobs one over the processing-only lease index (as many as the slots), the
last hour's failures a range of the (status, completed_at) index, the history a range of its
(job_model, minute) index (one row per kind and minute), the paused kinds and each
rate-limited kind's starts a few rows. Eight queries, and two per rate-limited kind, whatever
the number of jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db.models import Count, DurationField, ExpressionWrapper, Min
from django.db.models.functions import Now

from django_leases.handlers import registered_kinds, throttles
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.history import QueueMinuteQuerySet, quantile
from django_leases.querysets.throttles import kind_gates
from django_leases.stats import RECENT_MINUTES, Fleet, per_kind
from django_leases.status import FAILED, PROCESSING
from django_leases.throttles import Throttle


@dataclass(frozen=True)
class KindRow:
    """One kind's line of the overview's table; times in seconds."""

    kind: str
    due: int
    oldest_wait: timedelta | None
    running: int
    slots: int
    """The slots of the live workers (not late) that serve the kind."""
    workers: int
    throttle: Throttle | None
    started: int | None
    """Jobs started within its rate's window, for a kind with a `rate=`."""
    paused: bool
    completed: int
    failed: int
    retried: int
    wait_p50: float | None
    wait_p95: float | None
    run_p50: float | None
    run_p95: float | None


def kind_rows(
    jobs: LeaseQuerySet[Any], fleet: Fleet, history: QueueMinuteQuerySet
) -> list[KindRow]:
    """Read the table: one row per kind with due or running jobs, failures or history in the
    last RECENT_MINUTES, paused, or with a limit or a rate (`idle()` names the others)."""
    waits = ExpressionWrapper(Now() - Min("run_at"), output_field=DurationField())
    backlog = {
        kind: (n, wait)
        for kind, n, wait in jobs.due()
        .order_by()
        .values_list("kind")
        .annotate(n=Count("*"), wait=waits)
    }
    running = per_kind(jobs.filter(status=PROCESSING))
    failed = per_kind(jobs.finished_within(timedelta(minutes=RECENT_MINUTES)).filter(status=FAILED))
    recent = history.recent(jobs.model, RECENT_MINUTES)
    paused = jobs.paused_kinds()
    limits = throttles()
    kinds = sorted(set(backlog) | set(running) | set(failed) | set(recent) | paused | set(limits))
    rows = []
    for kind in kinds:
        serving = [w for w in fleet.workers if not w.late and kind in w.kinds]
        hour = recent.get(kind)
        throttle = limits.get(kind)
        due, wait = backlog.get(kind, (0, None))
        rows.append(
            KindRow(
                kind=kind,
                due=due,
                oldest_wait=wait,
                running=running.get(kind, 0),
                slots=sum(w.concurrency for w in serving),
                workers=len(serving),
                throttle=throttle,
                started=started(jobs, kind, throttle),
                paused=kind in paused,
                completed=hour.completed if hour else 0,
                failed=failed.get(kind, 0),
                retried=hour.retried if hour else 0,
                wait_p50=quantile(hour.wait, 0.5) if hour else None,
                wait_p95=quantile(hour.wait, 0.95) if hour else None,
                run_p50=quantile(hour.run, 0.5) if hour else None,
                run_p95=quantile(hour.run, 0.95) if hour else None,
            )
        )
    return rows


def started(jobs: LeaseQuerySet[Any], kind: str, throttle: Throttle | None) -> int | None:
    """The jobs of `kind` started within its rate's window (None without a `rate=`): its gate's
    start rows, two queries."""
    if throttle is None or throttle.rate is None:
        return None
    gates = kind_gates(jobs.db)
    gate = gates.of(jobs.model, kind).values_list("pk", flat=True).first()
    return 0 if gate is None else gates.started(int(gate), throttle.rate[1])[0]


def idle(rows: list[KindRow]) -> list[str]:
    """The registered kinds `kind_rows()` left out: nothing due, running or lately done."""
    return sorted(set(registered_kinds()) - {row.kind for row in rows})
