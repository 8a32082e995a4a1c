"""`StuckWatcher`: finds expired leases and resolves each by the kind's policy.

A lease that expired does not rescue itself. The watcher makes expiry visible (one log line per
job), counted (the attempt ledger) and policy-driven, even for kinds no worker is polling.
Each rescue is one conditional UPDATE in `LeaseQuerySet.rescue()`, so several watchers at once
are safe. It parses no arguments and prints nothing; `watch_stuck_jobs` drives it.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, close_old_connections, connections
from django.db.models import F
from django.db.models.functions import Now

from django_leases.checks.databases import database_clock_problems
from django_leases.conf import leases_settings
from django_leases.db import harden
from django_leases.exceptions import DatabaseMisconfigured
from django_leases.handlers import RECONCILE_VERDICTS, get_handler, registered_kinds
from django_leases.outages import check_tables, outage_or_raise
from django_leases.querysets import LeaseQuerySet
from django_leases.redaction import error_text
from django_leases.schedules import enqueue_due
from django_leases.status import StuckPolicy, Verdict
from django_leases.tables import leased_jobs, queue_models, registered_workers

logger = logging.getLogger("django_leases.watcher")


@dataclass(frozen=True)
class Action:
    """What the watcher did with one job."""

    pk: int
    kind: str
    previous_owner: str
    token: int
    attempts: int
    expired_for: float | None
    action: str
    reason: str

    def describe(self) -> str:
        past = f"{self.expired_for:.1f}s" if self.expired_for is not None else "-"
        return (
            f"job_id={self.pk} kind={self.kind} previous_owner={self.previous_owner} "
            f"attempts={self.attempts} token={self.token} expired_for={past} action={self.action}"
            + (f" reason={self.reason!r}" if self.reason else "")
        )


class StuckWatcher:
    """One pass at a time: rescue expired and orphaned leases, reconcile jobs under review."""

    def __init__(
        self,
        *,
        model: type[Any] | None = None,
        using: str | None = None,
        watcher_id: str = "watcher",
        batch_size: int = 500,
    ) -> None:
        jobs = leased_jobs(model, using)
        self.model = jobs.model
        self.watcher_id = watcher_id
        self.batch_size = batch_size
        self.using = jobs.db

    def _jobs(self) -> LeaseQuerySet[Any]:
        return leased_jobs(self.model, self.using)

    def run(
        self,
        *,
        interval: float | None = None,
        once: bool = False,
        stop: threading.Event | None = None,
        on_pass: Callable[[list[Action]], object] | None = None,
        on_outage: Callable[[str], object] | None = None,
    ) -> int:
        """Run passes every `interval` seconds (jittered) until `stop` is set, or one with
        `once`; return how many jobs were acted on in all.

        `on_pass` gets the actions of each pass that ran, `on_outage` the reason a pass failed
        on a database connection error instead (the next pass tries again: a watcher never
        exits for an outage). Raises `DatabaseMisconfigured` once the database refuses the
        connection settings or lacks the tables, or, before the first pass, where its session
        clock would make every expiry wrong (see `checks.databases.database_clock_problems`).
        """
        every = interval if interval is not None else leases_settings.WATCH_INTERVAL
        stop = stop or threading.Event()
        total = 0
        checked = False
        while True:
            close_old_connections()
            try:
                if not checked:
                    self._check_database()
                    checked = True
                actions = self.run_once()
            except DatabaseError as exc:
                outage_or_raise(exc, self.using)
                if on_outage is not None:
                    on_outage(error_text(exc))
            else:
                total += len(actions)
                if on_pass is not None:
                    on_pass(actions)
            # Jitter keeps several watchers from scanning in lockstep.
            if once or stop.wait(every * random.uniform(0.8, 1.2)):  # noqa: S311
                return total

    def _check_database(self) -> None:
        check_tables(self.using, queue_models(self.model))
        problems = database_clock_problems(self.using)
        if problems:
            raise DatabaseMisconfigured(problems[0])

    def run_once(self) -> list[Action]:
        """Run one pass and return what it did, job by job."""
        harden(connections[self.using])
        enqueue_due(self.using, model=self.model)
        actions = self._rescue(orphaned=False)
        actions += self._rescue(orphaned=True)
        actions += self._end_expired_stops()
        actions += self._reconcile_reviews()
        return actions

    @staticmethod
    def summary(actions: list[Action]) -> str:
        counts = Counter(action.action for action in actions)
        detail = ", ".join(f"{name}={count}" for name, count in sorted(counts.items()))
        return f"{len(actions)} job(s) acted on" + (f": {detail}" if detail else "")

    # ---- expired and orphaned leases ---------------------------------------------------------

    def _rescue(self, *, orphaned: bool) -> list[Action]:
        jobs = self._jobs()
        if orphaned:
            # A subquery of the registry, not a list of ids: gone workers pile up.
            candidates = jobs.orphaned(registered_workers(self.using).gone().values("worker_id"))
        else:
            candidates = jobs.expired()
        candidates = candidates.annotate(past=Now() - F("lease_until")).order_by("lease_until")
        actions = []
        for job in candidates[: self.batch_size]:
            action, reason = self._decide(job, orphaned)
            # A rescued job is due again at once: its attempt did not fail, and the TTL already
            # spaced it. Retry backoff is for handler failures.
            if not jobs.rescue(job, action, by=self.watcher_id, reason=reason, orphaned=orphaned):
                logger.info("skipped job_id=%s: completed, renewed or rescued meanwhile", job.pk)
                continue
            past = job.past.total_seconds() if job.past is not None and not orphaned else None
            done = Action(
                job.pk,
                job.kind,
                job.lease_owner,
                job.lease_token,
                job.attempts,
                past,
                action,
                reason,
            )
            logger.info("rescued %s", done.describe())
            actions.append(done)
        return actions

    def _end_expired_stops(self) -> list[Action]:
        """End the executions that were stopped (a cancel, a time-out) and whose lease then
        expired: their holder died or ignored the stop, so their lock and slot are released."""
        jobs = self._jobs()
        ended = {pk: (token, ends_as) for (pk, token), ends_as in jobs.end_expired_stops().items()}
        rows = jobs.filter(pk__in=list(ended)).order_by("pk")
        actions = []
        for pk, kind, owner, attempts in rows.values_list("pk", "kind", "lease_owner", "attempts"):
            token, ends_as = ended[pk]
            done = Action(pk, kind, owner, token, attempts, None, f"stopped-{ends_as}", "")
            logger.info("ended %s: its lease expired while stopping", done.describe())
            actions.append(done)
        return actions

    def _decide(self, job: Any, orphaned: bool) -> tuple[str, str]:
        why = "its worker is gone" if orphaned else "its lease expired"
        if job.checkpoint and leases_settings.stuck_policy(job.kind) == StuckPolicy.REVIEW:
            return StuckPolicy.REVIEW, (
                f"{why} after checkpoint {job.checkpoint!r}: the external step may have happened"
            )
        if job.attempts >= job.max_attempts:
            return Verdict.FAILED, (
                f"{why} on attempt {job.attempts} of {job.max_attempts}; no attempts left "
                f"(last owner {job.lease_owner})"
            )
        return Verdict.RETRY, ""

    # ---- reconcile hooks -------------------------------------------------------------------

    def _reconcile_reviews(self) -> list[Action]:
        hooked = [kind for kind in registered_kinds() if get_handler(kind).reconcile is not None]
        if not hooked:
            return []
        jobs = self._jobs()
        actions = []
        for job in jobs.under_review().filter(kind__in=hooked).order_by("pk")[: self.batch_size]:
            verdict = self._ask(job)
            if verdict is None:
                continue
            if not jobs.filter(pk=job.pk).resolve_review(verdict, by=self.watcher_id):
                continue
            done = Action(
                job.pk,
                job.kind,
                job.lease_owner,
                job.lease_token,
                job.attempts,
                None,
                f"reconciled-{verdict}",
                "reconcile hook",
            )
            logger.info("reconciled %s", done.describe())
            actions.append(done)
        return actions

    def _ask(self, job: Any) -> str | None:
        hook = get_handler(job.kind).reconcile
        if hook is None:
            return None
        try:
            verdict = hook(job)
        except Exception:
            logger.exception(
                "reconcile hook failed job_id=%s kind=%s; it stays under review", job.pk, job.kind
            )
            return None
        if verdict not in RECONCILE_VERDICTS:
            logger.error(
                "reconcile hook of kind %s returned %r for job_id=%s; expected one of %s",
                job.kind,
                verdict,
                job.pk,
                ", ".join(RECONCILE_VERDICTS),
            )
            return None
        return str(verdict)
