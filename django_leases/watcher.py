"""`StuckWatcher`: finds expired leases and resolves each by the kind's policy.

A lease that expired does not rescue itself. The watcher makes expiry visible (one log line per
job), counted (the attempt ledger) and policy-driven, even for kinds no worker is polling.
Each rescue is one conditional UPDATE in `LeaseQuerySet.rescue()`, so several watchers at once
are safe. It parses no arguments and prints nothing; `watch_stuck_jobs` drives it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, close_old_connections, connections
from django.db.models import F, Max, Min
from django.db.models.functions import Now

from django_leases.checks.databases import database_clock_problems
from django_leases.conf import leases_settings
from django_leases.exceptions import DatabaseMisconfigured
from django_leases.handlers import RECONCILE_VERDICTS, get_handler, registered_kinds
from django_leases.horizon import HorizonLog
from django_leases.network import harden
from django_leases.outages import check_tables, outage_or_raise
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.workers import Role
from django_leases.redaction import error_text
from django_leases.schedules import enqueue_due
from django_leases.status import StuckPolicy, Verdict
from django_leases.tables import leased_jobs, queue_history, queue_models, registered_workers

logger = logging.getLogger("django_leases.watcher")

# Reconcile hooks past their deadline whose threads may still run, at most: beyond it a pass
# asks no hook (rescues go on), so a hook that hangs for good costs a bounded number of threads
# and connections.
MAX_ABANDONED_HOOKS = 4


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


@dataclass
class HookTally:
    """What the reconcile hooks of one pass did besides resolving jobs."""

    failed: int = 0
    timed_out: int = 0
    skipped: bool = False


@dataclass
class Hook:
    """One reconcile hook call on a thread of its own; the watcher waits for `done` until a
    deadline, and a call past it is left to finish unheard."""

    hook: Callable[[Any], object]
    job: Any
    verdict: object = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name=f"reconcile-{self.job.pk}", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            self.verdict = self.hook(self.job)
        except Exception as exc:  # noqa: BLE001 - reported by the watcher's thread
            self.error = exc
        finally:
            # The hook's queries ran on this thread's own connections.
            connections.close_all()
            self.done.set()


class StuckWatcher:
    """One pass at a time: rescue expired and orphaned leases, reconcile jobs under review.

    Reconcile hooks run after the rescues, each on a thread of its own with a deadline of
    RECONCILE_TIMEOUT seconds, in turn through the jobs under review (a cursor by id that wraps),
    and for at most `reconcile_budget` seconds a pass: a slow, failing or hanging hook delays
    neither the rescues nor the other jobs' hooks for long.
    """

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
        self.reconcile_budget = leases_settings.WATCH_INTERVAL
        self.hooks = HookTally()
        # The id of the last job under review a hook was asked about: the next pass goes on
        # after it. None until the first pass, which starts at a random job, so that watchers
        # run from cron (one pass each) do not all ask about the same lowest ids.
        self._cursor: int | None = None
        self._abandoned: list[threading.Thread] = []
        self._instance = secrets.token_hex(8)
        self._horizon = HorizonLog()

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
        exits for an outage). The watcher keeps a row of the worker registry (role "watcher")
        with its last pass and what it did, so the admin and the metrics show whether a watcher
        runs. Raises `DatabaseMisconfigured` once the database refuses the
        connection settings or lacks the tables, or, before the first pass, where its session
        clock would make every expiry wrong (see `checks.databases.database_clock_problems`).
        """
        every = interval if interval is not None else leases_settings.WATCH_INTERVAL
        self.reconcile_budget = every
        stop = stop or threading.Event()
        total = 0
        checked = False
        registered = False
        try:
            while True:
                close_old_connections()
                try:
                    if not checked:
                        self._check_database()
                        checked = True
                    if not registered:
                        registered = self._register(None if once else every)
                    actions = self.run_once()
                except DatabaseError as exc:
                    outage_or_raise(exc, self.using)
                    reason = error_text(exc)
                    if registered:
                        self._report({"error": reason})
                    if on_outage is not None:
                        on_outage(reason)
                else:
                    total += len(actions)
                    if registered:
                        self._report(self._outcome(actions))
                    if on_pass is not None:
                        on_pass(actions)
                # Jitter keeps several watchers from scanning in lockstep.
                if once or stop.wait(every * random.uniform(0.8, 1.2)):  # noqa: S311
                    return total
        finally:
            if registered:
                with contextlib.suppress(DatabaseError):
                    registered_workers(self.using).stopped(self.watcher_id, self._instance)

    def _register(self, every: float | None) -> bool:
        """Take this watcher's registry row; False (logged) if a live process holds its id."""
        taken = registered_workers(self.using).register(
            self.watcher_id,
            instance=self._instance,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            kinds=[],
            concurrency=0,
            heartbeat=every,
            role=Role.WATCHER,
        )
        if not taken:
            logger.warning(
                "watcher id %r is in use by a live process; this watcher's passes are not "
                "recorded in the registry",
                self.watcher_id,
            )
        return taken

    def _report(self, outcome: dict[str, Any]) -> None:
        """Record a pass in the registry; a failure to is only logged (the next pass retries)."""
        try:
            registered_workers(self.using).passed(self.watcher_id, self._instance, outcome)
        except DatabaseError as exc:
            logger.warning("could not record the pass in the registry: %s", error_text(exc))

    def _outcome(self, actions: list[Action]) -> dict[str, Any]:
        """What a pass did, for the registry: jobs per action, and the hooks that failed or ran
        past their deadline."""
        outcome: dict[str, Any] = dict(Counter(action.action for action in actions))
        if self.hooks.failed:
            outcome["hooks_failed"] = self.hooks.failed
        if self.hooks.timed_out:
            outcome["hooks_timed_out"] = self.hooks.timed_out
        if self.hooks.skipped:
            outcome["hooks_skipped"] = True
        return outcome

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
        # What keeps vacuum from removing the rows this queue leaves behind, told early.
        self._horizon.look(self.using)
        # The minutes closed since the last pass of any watcher, each written once.
        queue_history(self.using).record(self._jobs())
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
        self.hooks = HookTally()
        hooked = [kind for kind in registered_kinds() if get_handler(kind).reconcile is not None]
        if not hooked:
            return []
        self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
        if len(self._abandoned) >= MAX_ABANDONED_HOOKS:
            logger.warning(
                "asking no reconcile hook this pass: %s hook(s) past their deadline still run",
                len(self._abandoned),
            )
            self.hooks.skipped = True
            return []
        jobs = self._jobs()
        actions = []
        turn = self._review_turn(jobs.under_review().filter(kind__in=hooked))
        deadline = time.monotonic() + self.reconcile_budget
        for i, job in enumerate(turn):
            # One job at least a pass, however short the budget: the cursor always moves on.
            if i and time.monotonic() >= deadline:
                break
            if len(self._abandoned) >= MAX_ABANDONED_HOOKS:
                break
            self._cursor = job.pk
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

    def _review_turn(self, review: LeaseQuerySet[Any]) -> list[Any]:
        """Up to `batch_size` jobs of `review`, in id order from the one after the cursor, then
        from the lowest id on: each job gets its turn, whatever the hooks of the others do."""
        if self._cursor is None:
            bounds = review.aggregate(low=Min("pk"), high=Max("pk"))
            if bounds["low"] is None:
                return []
            self._cursor = random.randint(bounds["low"], bounds["high"]) - 1  # noqa: S311
        turn = list(review.filter(pk__gt=self._cursor).order_by("pk")[: self.batch_size])
        if len(turn) < self.batch_size:
            turn += review.filter(pk__lte=self._cursor).order_by("pk")[
                : self.batch_size - len(turn)
            ]
        return turn

    def _ask(self, job: Any) -> str | None:
        hook = get_handler(job.kind).reconcile
        if hook is None:
            return None
        call = Hook(hook, job)
        thread = call.start()
        if not call.done.wait(leases_settings.RECONCILE_TIMEOUT):
            # A thread cannot be stopped: it is left to finish (its verdict is dropped) and
            # counted against MAX_ABANDONED_HOOKS. The job stays under review for a later pass.
            self._abandoned.append(thread)
            self.hooks.timed_out += 1
            logger.error(
                "reconcile hook of kind %s ran past its deadline (%ss) for job_id=%s; "
                "it stays under review",
                job.kind,
                leases_settings.RECONCILE_TIMEOUT,
                job.pk,
            )
            return None
        if call.error is not None:
            self.hooks.failed += 1
            logger.error(
                "reconcile hook failed job_id=%s kind=%s; it stays under review",
                job.pk,
                job.kind,
                exc_info=call.error,
            )
            return None
        verdict = call.verdict
        if verdict not in RECONCILE_VERDICTS:
            self.hooks.failed += 1
            logger.error(
                "reconcile hook of kind %s returned %r for job_id=%s; expected one of %s",
                job.kind,
                verdict,
                job.pk,
                ", ".join(RECONCILE_VERDICTS),
            )
            return None
        return str(verdict)
