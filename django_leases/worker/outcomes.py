"""What comes of each lease a worker holds, written, counted and logged in one place.

`Outcomes` writes an attempt's outcome to the job and its ledger row (`answered()`: the one
retry while the database is away and a lease may still be live, for a single outcome and a
batch of acks alike), counts it in `WorkerStats` (and so in the metrics), and notes a refused
holder write in the ledger ("fenced") where the queryset did not already (the back-off while
the database is away is `outages.Outages`), and paces the claims' takeovers of expired leases
(`takes_over()`). Any thread may call it: its one field of its own, when the next takeover is
due, is a time any claiming thread may write; a lost update moves one takeover by at most an
interval, and the database decides every claim.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from django.db import (
    DatabaseError,
    close_old_connections,
)

from django_leases.backoff import retry_delay
from django_leases.exceptions import HandlerError, LeaseLost
from django_leases.handlers import get_handler, lease_length
from django_leases.lease import Lease, Presence
from django_leases.outages import Outages, is_outage
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.base import LeaseKey, writing_to
from django_leases.querysets.claims import Claimer, PartFailed, failures_of
from django_leases.redaction import error_text
from django_leases.status import FAILED, TIMED_OUT, AttemptOutcome
from django_leases.worker.counters import WorkerStats

logger = logging.getLogger("django_leases.worker")

# The outcome writes whose refusal the queryset notes in the ledger itself (`complete()` and
# `time_out()` call `record_fenced()` before raising `LeaseLost`); `fail()` does not.
NOTES_FENCED = frozenset({AttemptOutcome.COMPLETED, TIMED_OUT})

UNRECORDABLE = "failed-unrecordable"

TAKEOVER_EVERY = 1.0
"""Seconds between a worker's claims that also look for expired leases to take over (at most a
quarter of its TTL). Every claim looking cost nothing on a clean table, but while a session
pins the vacuum horizon every job claimed since leaves a dead `processing` row version that
the expired leases' index scan must visit: after ten minutes 91% of a claim's buffers went to
finding no expired lease (bench/README.md, "Under pressure"). The watcher rescues expired
leases anyway; a worker's takeover is the fast path, now up to this much later."""

R = TypeVar("R")


class Outcomes:
    """Write, count and log what came of each lease: claimed, ended, lost, released."""

    def __init__(
        self,
        jobs: LeaseQuerySet[Any],
        *,
        kinds: list[str],
        worker_id: str,
        ttl: float,
        presence: Presence,
        stats: WorkerStats,
        outages: Outages,
        stopped: threading.Event,
    ) -> None:
        self.jobs = jobs
        self.claimer = Claimer(writing_to(jobs), worker_id, ttl=ttl, kinds=kinds)
        """The worker's claim, put together once: only how many jobs and whether it looks for
        expired leases change from one claim to the next."""
        self.worker_id = worker_id
        self.ttl = ttl
        self.presence = presence
        self.stats = stats
        self.outages = outages
        self.stopped = stopped
        self.using = jobs.db
        self._takeover_every = min(TAKEOVER_EVERY, ttl / 4)
        self._takeover_at = 0.0

    # ---- claims -------------------------------------------------------------------------------

    def leases(self, jobs: list[Any], started: float) -> list[Lease]:
        """Return the leases of `jobs`, claimed by a statement sent at `started` (monotonic)."""
        return [
            Lease(
                job,
                ttl=lease_length(job.kind, self.ttl),
                renewed_at=started,
                presence=self.presence,
            )
            for job in jobs
        ]

    def takes_over(self) -> bool:
        """Whether the next claim also looks for expired leases to take over: every
        `TAKEOVER_EVERY`, and at once after a claim that took one over."""
        return time.monotonic() >= self._takeover_at

    def note_claimed(self, jobs: list[Any], *, looked: bool) -> None:
        """Count and log the jobs a claim took (`looked`: for expired leases too): counted once
        per kind, logged one by one only at DEBUG (on the acknowledgement writer, the batched
        worker's critical path); and the parts of the claim that failed (`claims.Claimed`),
        each an outage of that part."""
        if looked and not any(job.taken_over for job in jobs):
            self._takeover_at = time.monotonic() + self._takeover_every
        for kind, count in Counter(job.kind for job in jobs).items():
            self.stats.add("claimed", count, kind=kind)
        for failure in failures_of(jobs):
            self.part_failed(failure, len(jobs))
        debug = logger.isEnabledFor(logging.DEBUG)
        for job in jobs:
            self.stats.claimed_after_wait(job)
            if debug:
                logger.debug(
                    "claimed job_id=%s kind=%s attempt=%s token=%s owner=%s",
                    job.pk,
                    job.kind,
                    job.attempts,
                    job.lease_token,
                    self.worker_id,
                )

    def part_failed(self, failure: PartFailed, claimed: int) -> None:
        """Count and log a part of a claim that failed beside the others (the jobs they
        committed, `claimed`, are run)."""
        self.stats.add("outages")
        if failure.holders is not None:
            logger.warning(
                "claim skipped job kind %s for now: %s, by %s; the other kinds were claimed "
                "(%s job(s))",
                failure.kind,
                error_text(failure.error),
                failure.holders,
                claimed,
            )
            return
        what = "the unthrottled kinds" if failure.kind is None else f"job kind {failure.kind}"
        logger.warning(
            "claim of %s failed: %s; the %s job(s) the rest of the claim committed are run",
            what,
            error_text(failure.error),
            claimed,
        )

    # ---- an attempt's end ---------------------------------------------------------------------

    def ran(self, lease: Lease, seconds: float) -> None:
        if self.stats.recorder is not None:
            self.stats.recorder.ran(lease.job.kind, seconds)

    def by_handler(self, lease: Lease, started: float) -> None:
        """Count an outcome the handler wrote itself, e.g. with `lease.atomic()`."""
        outcome = lease.outcome or AttemptOutcome.COMPLETED
        self.stats.add(outcome, kind=lease.job.kind)
        logger.debug(
            "%s job_id=%s attempt=%s by the handler in=%.3fs",
            outcome,
            lease.pk,
            lease.attempt,
            time.monotonic() - started,
        )

    def completed(self, lease: Lease) -> None:
        """Count a completion that another statement (a group write) made."""
        lease.mark_completed()
        self.count(lease, AttemptOutcome.COMPLETED, AttemptOutcome.COMPLETED, None)

    def complete(self, lease: Lease, *, maybe_written: bool = False) -> None:
        """Write `lease`'s completion on its own (`record()`)."""
        self.record(lease, AttemptOutcome.COMPLETED, lease.complete, maybe_written=maybe_written)

    def record(
        self,
        lease: Lease,
        outcome: str,
        write: Callable[[], object],
        error: BaseException | None = None,
        *,
        maybe_written: bool = False,
    ) -> None:
        """Write a job's outcome (`answered()`), count and log it.

        `maybe_written`: an earlier write of it failed, and may have committed.
        """

        def attempt() -> object:
            try:
                return write()
            except LeaseLost as exc:
                return exc

        try:
            answer = self.answered({lease.key: lease}, f"{outcome} of job {lease.pk}", attempt)
        except Exception as exc:  # noqa: BLE001 - refused, or a value the database cannot store
            self._unrecordable(lease, outcome, exc)
            return
        if answer is None:
            return
        result, had_outage = answer
        if isinstance(result, LeaseLost):
            if not (
                (had_outage or maybe_written)
                and self.jobs.finished_by(lease.pk, lease.owner, lease.token)
            ):
                self.fenced_out(lease, str(result), recorded=outcome in NOTES_FENCED)
                return
            result = "unknown"  # our earlier attempt committed; only its acknowledgement was lost
        self.count(lease, outcome, result, error)

    def answered(
        self,
        leases: dict[LeaseKey, Lease],
        what: str,
        write: Callable[[], R],
        *,
        wait: threading.Event | None = None,
    ) -> tuple[R, bool] | None:
        """Make `write`, the outcome of `leases`, until the database answers it: retry while it
        is away (backing off until `wait`, default the stop request, is set) and a lease may
        still be live; a lease taken as lost meanwhile leaves `leases`, fenced out.

        Return its result and whether the database was away before it answered; None once no
        lease is left or the worker stopped. A statement the database refused is raised.
        """
        had_outage = False
        while True:
            try:
                result = write()
            except DatabaseError as exc:
                if not self.outages.away(exc):
                    raise
                had_outage = True
                for lease in [lease for lease in leases.values() if lease.lost]:
                    del leases[lease.key]
                    self.fenced_out(lease, "database unreachable for longer than the TTL")
                if not leases:
                    return None
                self.outages.pause(what, exc, wait=wait)
                if self.stopped.is_set():
                    return None
                continue
            self.outages.over()
            return result, had_outage

    def count(
        self, lease: Lease, outcome: str, result: object, error: BaseException | None
    ) -> None:
        error_name = type(error).__name__ if error else ""
        kind = lease.job.kind
        if outcome == AttemptOutcome.COMPLETED:
            self.stats.add(AttemptOutcome.COMPLETED, kind=kind)
            logger.debug(
                "completed job_id=%s attempt=%s owner=%s", lease.pk, lease.attempt, lease.owner
            )
        elif outcome == TIMED_OUT:
            self.stats.add(TIMED_OUT, kind=kind)
            logger.warning(
                "timed out job_id=%s attempt=%s: cancelled at its timeout; now %s",
                lease.pk,
                lease.attempt,
                result,
            )
        elif result == FAILED or outcome == AttemptOutcome.FAILED:
            self.stats.add(AttemptOutcome.FAILED, kind=kind)
            logger.warning(
                "failed job_id=%s attempt=%s error_class=%s (no retry left or permanent)",
                lease.pk,
                lease.attempt,
                error_name,
            )
        else:
            self.stats.add(AttemptOutcome.RETRIED, kind=kind)
            logger.debug(
                "retry job_id=%s attempt=%s error_class=%s", lease.pk, lease.attempt, error_name
            )

    def _unrecordable(self, lease: Lease, outcome: str, exc: Exception) -> None:
        """The database refused the outcome write itself: fail the attempt without its details,
        or, if even that is refused, stop renewing so that the lease expires for the watcher."""
        logger.error(
            "could not record the outcome %s of job_id=%s: %s",
            outcome,
            lease.pk,
            type(exc).__name__,
        )
        if outcome != UNRECORDABLE:
            reason = (
                f"the worker could not record the outcome '{outcome}': the database refused it "
                f"({type(exc).__name__})"
            )
            delay = retry_delay(lease.attempt)
            write = partial(lease.fail, HandlerError(reason), retry_in=delay)
            self.record(lease, UNRECORDABLE, write, exc)
            return
        self.abandon(lease, "the database refused every outcome write")

    def acknowledged(
        self,
        pending: dict[LeaseKey, Lease],
        won: set[LeaseKey],
        started: float,
        *,
        had_outage: bool,
    ) -> None:
        """Count the completions of a batch written: those in `won`, or (after an outage) found
        committed by an earlier write of ours; the others were fenced out (the batch's statement
        noted them in the ledger)."""
        done = [lease for key, lease in pending.items() if key in won]
        refused = []
        for key, lease in pending.items():
            if key in won:
                continue
            if had_outage and self.jobs.finished_by(lease.pk, lease.owner, lease.token):
                done.append(lease)  # our earlier write committed; only its answer was lost
            else:
                refused.append(lease)
        self.ended(refused, "lease lost before its batched completion", recorded=True)
        for lease in done:
            lease.mark_completed()
        for kind, count in Counter(lease.job.kind for lease in done).items():
            self.stats.add(AttemptOutcome.COMPLETED, count, kind=kind)
        logger.debug(
            "acknowledged completed=%s lost=%s in=%.3fs",
            len(done),
            len(pending) - len(done),
            time.monotonic() - started,
        )

    # ---- leases lost, given up or given back --------------------------------------------------

    def fenced_out(self, lease: Lease, reason: str, *, recorded: bool = False) -> None:
        """`ended()` for one lease."""
        self.ended([lease], reason, recorded=recorded)

    def ended(self, leases: list[Lease], reason: str, *, recorded: bool = False) -> None:
        """The executions of `leases` are over, their holder's writes refused: end those an
        operator's cancel or a time-out stopped (one statement), so that their locks and
        `limit=` slots are released now, not when their leases expire; count and log each.
        Note a refusal in the ledger unless `recorded` (the statement that was refused noted it
        already, or nothing was written).

        A lease an operator cancelled is counted as cancelled: its attempt is closed already.
        """
        if not leases:
            return
        stopped = self.acknowledge_stops(leases)
        for lease in leases:
            ends_as = stopped.get(lease.key)
            timed_out = lease.outcome == TIMED_OUT
            cancelled = ends_as is not None and not timed_out
            lease.mark_lost(
                f"cancelled; ended {ends_as}" if cancelled else reason, cancelled=cancelled
            )
            if timed_out:
                # Counted by the loop when it timed the attempt out; its handler ended only now.
                logger.info(
                    "timed-out job_id=%s token=%s: its handler returned; %s",
                    lease.pk,
                    lease.token,
                    f"now {ends_as}" if ends_as else lease.lost_reason,
                )
            elif lease.cancelled:
                self.stats.add(AttemptOutcome.CANCELLED, kind=lease.job.kind)
                logger.info(
                    "cancelled job_id=%s token=%s: %s; nothing written%s",
                    lease.pk,
                    lease.token,
                    lease.lost_reason,
                    f"; its execution ended, now {ends_as}" if ends_as else "",
                )
            else:
                self._lost_lease(lease, reason, recorded=recorded)

    def acknowledge_stops(self, leases: list[Lease]) -> dict[LeaseKey, str]:
        """End the stopped executions of `leases` (`LeaseQuerySet.acknowledge_stops()`); {} if the
        database cannot answer: their leases then expire and the watcher ends them."""
        try:
            return self.jobs.acknowledge_stops(self.worker_id, [lease.key for lease in leases])
        except DatabaseError as exc:
            logger.warning(
                "could not end the stopped execution of job_id(s) %s: %s; left to the watcher",
                ",".join(str(lease.pk) for lease in leases),
                type(exc).__name__,
            )
            close_old_connections()
            return {}

    def _lost_lease(self, lease: Lease, reason: str, *, recorded: bool) -> None:
        self.stats.add("lost", kind=lease.job.kind)
        logger.warning(
            "fenced out job_id=%s token=%s owner=%s: %s; nothing written",
            lease.pk,
            lease.token,
            lease.owner,
            reason,
        )
        if recorded:
            return
        try:
            self.jobs.record_fenced(lease.pk, lease.token)
        except DatabaseError:
            close_old_connections()

    def lost_unstarted(self, leases: list[Lease]) -> None:
        """Count leases that ran out while they waited for a slot: nothing was written, their
        ledger rows stay open for the worker that takes them over."""
        self.ended(leases, "lost before a slot started it", recorded=True)

    def abandon(self, lease: Lease, why: str) -> None:
        """Stop renewing `lease`: it expires and the watcher applies the kind's policy.

        A lease already lost (or cancelled) has nothing left to expire: it is counted and
        logged as such, since its handler never ends the attempt that would have counted it."""
        if lease.lost:
            reason = f"{why}, its lease lost before: {lease.lost_reason}"
            self.fenced_out(lease, reason, recorded=True)  # nothing written, nobody refused
            return
        lease.mark_lost(f"abandoned: {why}")
        self.stats.add("abandoned", kind=lease.job.kind)
        logger.warning(
            "abandoned job_id=%s token=%s: %s; its lease expires in at most %ss",
            lease.pk,
            lease.token,
            why,
            lease.ttl,
        )

    def time_out(self, lease: Lease) -> tuple[str, str]:
        """On the loop: end `lease`'s attempt at its kind's time limit; return why, and what
        became of the job (or why nothing could be written)."""
        reason = f"ran past its timeout of {get_handler(lease.job.kind).timeout:g}s"
        try:
            ends_as = lease.time_out(reason, retry_in=retry_delay(lease.attempt), running=True)
            status = f"stopping until its handler returns, then {ends_as}"
        except LeaseLost:
            status = "lost before its timeout"
        except DatabaseError as exc:
            # Without the database we cannot end the attempt: stop renewing, so that the lease
            # expires and the watcher applies the same policy.
            logger.warning("could not time out job_id=%s: %s", lease.pk, type(exc).__name__)
            status = "left to expire"
        return reason, status

    def timed_out(self, lease: Lease, reason: str, status: str) -> None:
        """Count an attempt the loop ended at its time limit, its thread abandoned."""
        self.stats.add(TIMED_OUT, kind=lease.job.kind)
        logger.warning(
            "timed out job_id=%s attempt=%s token=%s: %s; %s; its thread is abandoned",
            lease.pk,
            lease.attempt,
            lease.token,
            reason,
            status,
        )

    def release_unstarted(self, lease: Lease) -> None:
        """Give back a job no slot started."""
        try:
            lease.release()
        except (LeaseLost, DatabaseError) as exc:
            if isinstance(exc, DatabaseError) and not is_outage(exc, self.using):
                raise
            logger.warning("could not release job_id=%s: %s", lease.pk, error_text(exc))
            if isinstance(exc, LeaseLost):
                self.acknowledge_stops([lease])  # cancelled while it waited: it never ran
            return
        self.stats.add(AttemptOutcome.RELEASED, kind=lease.job.kind)
        logger.info("released unstarted job_id=%s token=%s", lease.pk, lease.token)
