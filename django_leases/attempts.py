"""One attempt of a job on a slot thread: run the handler, then record what came of it.

`LeaseWorker` runs attempts through these methods. Whatever the handler raises ends the attempt
here, with its error recorded; the outcome write is retried while the database is down and the
lease may still be live, and an outcome the database refuses still ends the attempt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import datetime
from functools import partial
from typing import Any, Protocol

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connections,
)

from django_leases.ack_buffer import AckBuffer
from django_leases.backoff import retry_delay
from django_leases.db import harden, keep_usable
from django_leases.exceptions import HandlerError, HandlerTimeout, LeaseLost, PermanentError
from django_leases.group_commit import GroupCommit
from django_leases.handlers import ACK_BATCH, Handler, get_handler
from django_leases.lease import Lease, Presence
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.base import LeaseKey
from django_leases.status import FAILED, TIMED_OUT, AttemptOutcome

logger = logging.getLogger("django_leases.worker")

# Errors that mean "the database is unreachable right now", worth a retry after a pause.
TRANSIENT = (OperationalError, InterfaceError)


class Recorder(Protocol):
    """Where a worker reports each event with its job's kind, e.g. to Prometheus
    (`django_leases.metrics.WorkerMetrics`)."""

    def count(self, event: str, kind: str, n: int) -> None:
        """Count `n` events named like a `WorkerStats` field, or `AttemptOutcome.LEASE_LOST`
        for a lease the heartbeat found lost."""

    def ran(self, kind: str, seconds: float) -> None:
        """Note how long a handler ran."""

    def waited(self, kind: str, seconds: float) -> None:
        """Note how long a job waited from its due time to its claim (database clock)."""


@dataclass
class WorkerStats:
    claimed: int = 0
    completed: int = 0
    retried: int = 0
    failed: int = 0
    lost: int = 0
    released: int = 0
    abandoned: int = 0
    timed_out: int = 0
    cancelled: int = 0
    outages: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    recorder: Recorder | None = field(default=None, repr=False)

    def add(self, name: str, count: int = 1, *, kind: str | None = None) -> None:
        """Count `count` events `name`, and report them with their job's `kind` if given."""
        with self.lock:
            setattr(self, name, getattr(self, name) + count)
        if kind is not None and self.recorder is not None:
            self.recorder.count(name, kind, count)

    def claimed_after_wait(self, job: Any) -> None:
        """Report how long `job` waited from its due time to its claim, both by the database
        clock (the claim sets `heartbeat_at` to its own time); a takeover did not wait."""
        if self.recorder is None or getattr(job, "taken_over", False):
            return
        if isinstance(job.heartbeat_at, datetime) and isinstance(job.run_at, datetime):
            waited = (job.heartbeat_at - job.run_at).total_seconds()
            self.recorder.waited(job.kind, max(waited, 0.0))

    def summary(self) -> str:
        names = [f.name for f in fields(self) if f.name not in ("outages", "lock", "recorder")]
        return " ".join(f"{name}={getattr(self, name)}" for name in names)


@dataclass(frozen=True)
class GroupCompletion:
    """What `_complete_group()` did for one lease."""

    written: bool
    """False: nothing was written; the slot writes the completion on its own."""
    won: bool = False
    """The completion won (else the lease was lost before it)."""
    following: Lease | None = None
    """The slot's next job, claimed in the same statement."""
    failed: bool = False
    """The statement was sent and failed: part of it may have committed."""


class RunsAttempts:
    """The attempt half of `LeaseWorker` (its base class): what happens on a slot thread."""

    stats: WorkerStats
    presence: Presence
    using: str
    ttl: float
    worker_id: str
    kinds: list[str]
    max_jobs: int | None
    _stopping: threading.Event
    _completions: GroupCommit[Lease | None, GroupCompletion]
    _acks: AckBuffer
    _ack_writer: threading.Thread | None
    _stopped: threading.Event
    _ahead: bool
    _slot_free: threading.Event

    def _jobs(self) -> LeaseQuerySet[Any]:
        raise NotImplementedError

    def _next_ready(self) -> Lease | None:
        raise NotImplementedError

    def _wanted(self) -> int:
        raise NotImplementedError

    def _hand_out(self, leases: list[Lease]) -> None:
        raise NotImplementedError

    def _outage(self, what: str, exc: Exception, *, wait: threading.Event | None = None) -> None:
        raise NotImplementedError

    def _abandon(self, lease: Lease, why: str) -> None:
        raise NotImplementedError

    def _execute(self, lease: Lease) -> Lease | None:
        """Run `lease`'s attempt, record its outcome and return the slot's next lease, claimed
        with the outcome or right after it (`_complete_group()`), if there was one to claim."""
        job = lease.job
        handler = get_handler(job.kind)
        error: BaseException | None = None
        started = time.monotonic()
        runs = True
        try:
            keep_usable()  # a worker's connections outlive CONN_MAX_AGE: not a request cycle
            # The lease's own clock, last thing before the start, whichever way the slot got
            # the job (claimed by the loop, with a completion, or ahead): a lease whose time ran
            # out (the worker paused, a claim answered late) may be another worker's by now.
            runs = not lease.lost
            if runs:
                started = time.monotonic()
                logger.debug("started job_id=%s attempt=%s", job.pk, lease.attempt)
                deadline = None if handler.timeout is None else started + handler.timeout
                handler.run(job, lease, deadline=deadline)
        except BaseException as exc:  # noqa: BLE001 - whatever it raises ends this attempt
            error = exc
        if not runs:
            # Nothing written: its ledger row stays open for the worker that takes it over.
            self._fenced_out(lease, f"not started: {lease.lost_reason}", recorded=True)
            return self._claim_next()
        lease.ending = True
        if self.stats.recorder is not None:
            self.stats.recorder.ran(job.kind, time.monotonic() - started)
        left_open = self._restore_connections()
        if error is None and left_open:
            error = HandlerError(left_open)
        if lease.outcome == TIMED_OUT:
            return None  # the loop ended this attempt at its timeout; the handler came back late
        if isinstance(error, LeaseLost):
            self._fenced_out(lease, str(error))
        elif isinstance(error, HandlerTimeout):
            delay = retry_delay(lease.attempt)
            self._record(lease, TIMED_OUT, partial(lease.time_out, str(error), retry_in=delay))
        elif error is not None and lease.lost:
            self._fenced_out(
                lease, f"handler raised {type(error).__name__} after the lease was lost"
            )
        elif isinstance(error, PermanentError):
            self._record(
                lease, AttemptOutcome.FAILED, partial(lease.fail, error, permanent=True), error
            )
        elif error is not None:
            delay = retry_delay(lease.attempt)
            self._record(
                lease, AttemptOutcome.RETRIED, partial(lease.fail, error, retry_in=delay), error
            )
        elif lease.finished:  # the handler wrote the outcome itself, e.g. with lease.atomic()
            outcome = lease.outcome or AttemptOutcome.COMPLETED
            self.stats.add(outcome, kind=job.kind)
            logger.debug(
                "%s job_id=%s attempt=%s by the handler in=%.3fs",
                outcome,
                job.pk,
                lease.attempt,
                time.monotonic() - started,
            )
        elif lease.lost:
            self._fenced_out(lease, "the lease was lost while the handler ran; result discarded")
        elif not self._defer_ack(lease, handler):
            return self._complete(lease)
        return self._claim_next()

    def _complete(self, lease: Lease) -> Lease | None:
        """Write the completion and claim the slot's next job in the same statement, with what
        other slots need at the same moment (`_complete_group()`); return the next job's lease.

        A job with a lock is completed on its own (its completion passes the lock on), and so is
        a job whose group statement failed: `_record()` retries it, or records why it cannot.
        """
        if lease.job.lock:
            self._record(lease, AttemptOutcome.COMPLETED, lease.complete)
            return self._claim_next()
        group = self._group(lease)
        if group is None or not group.written:
            # After a failed group statement a completion found done may be our own.
            failed = group is not None and group.failed
            self._record(lease, AttemptOutcome.COMPLETED, lease.complete, maybe_written=failed)
        elif group.won:
            lease.mark_completed()
            self._count(lease, AttemptOutcome.COMPLETED, AttemptOutcome.COMPLETED, None)
        else:
            self._fenced_out(lease, "lease lost before its completion", recorded=True)
        return None if group is None else group.following

    def _claim_next(self) -> Lease | None:
        """Claim the slot's next job with the group write; return its lease, if one was due.
        A worker that claims ahead (`_flush_and_claim()`) hands it a job claimed ahead instead."""
        if self._ahead:
            return self._next_ready()
        group = self._group(None)
        return None if group is None else group.following

    def _group(self, lease: Lease | None) -> GroupCompletion | None:
        """Submit `lease`'s completion (None: nothing to complete) and the claim of the slot's
        next job to the group write, and return what it did; None at once, writing nothing,
        once the worker stops claiming or counts its claims (`max_jobs`): its loop claims then.
        """
        return self._completions.submit(lease) if self._grouped() else None

    def _grouped(self) -> bool:
        """Whether slots claim their next jobs with the group write (`_group()`): not once the
        worker stops claiming, nor while it counts its claims (`max_jobs`): its loop claims."""
        return not self._stopping.is_set() and self.max_jobs is None

    def _complete_group(self, items: list[Lease | None]) -> list[GroupCompletion]:
        """Complete the leases of `items` and claim a next job for each item, in one statement
        where the database allows it (`complete_and_claim()`): one commit for the jobs finished
        and the next ones, however many slots asked at the same moment.

        A statement refused, or lost to an outage, leaves each completion to its slot (elsewhere
        than PostgreSQL its completions may have committed before its claim failed). A claim of
        it that committed unseen expires and is taken over, as any claim whose answer was lost.
        """
        if self._stopping.is_set():
            return [GroupCompletion(written=False) for _ in items]
        started = time.monotonic()
        try:
            won, jobs = self._jobs().complete_and_claim(
                self.worker_id,
                [lease.key for lease in items if lease is not None],
                ttl=self.ttl,
                limit=len(items),
                kinds=self.kinds,
            )
        except Exception as exc:  # noqa: BLE001 - each slot's _record() retries, or records why
            if not isinstance(exc, DatabaseError):  # a database's refusal _record() logs itself
                logger.exception("group write failed; each slot writes its completion alone")
            return [GroupCompletion(written=False, failed=True) for _ in items]
        self._note_claimed(jobs)
        following: list[Lease | None] = list(self._leases(jobs, started))
        following += [None] * (len(items) - len(jobs))
        return [
            GroupCompletion(
                written=True, won=lease is not None and lease.key in won, following=next_lease
            )
            for lease, next_lease in zip(items, following, strict=True)
        ]

    def _leases(self, jobs: list[Any], started: float) -> list[Lease]:
        """Return the leases of `jobs`, claimed by a statement sent at `started` (monotonic)."""
        return [
            Lease(job, ttl=self.ttl, renewed_at=started, presence=self.presence) for job in jobs
        ]

    def _note_claimed(self, jobs: list[Any]) -> None:
        """Count and log the jobs a claim took."""
        for job in jobs:
            self.stats.add("claimed", kind=job.kind)
            self.stats.claimed_after_wait(job)
            logger.debug(
                "claimed job_id=%s kind=%s attempt=%s token=%s owner=%s",
                job.pk,
                job.kind,
                job.attempts,
                job.lease_token,
                self.worker_id,
            )

    def _defer_ack(self, lease: Lease, handler: Handler) -> bool:
        """Buffer the completion of a job of an ack="batch" kind; False: write it now.

        Always in a worker that claims ahead (`_flush_and_claim()`). Otherwise only where it
        would cost a statement of its own: while slots claim with the group write (`_grouped()`),
        that statement carries the completion with the slot's next claim, which is cheaper than
        a buffered batch and leaves no job to run again after a crash. A job with a lock is
        completed at once: its completion passes the lock on.
        """
        if handler.ack != ACK_BATCH or lease.job.lock or (self._grouped() and not self._ahead):
            return False
        if not self._acks.add(lease):  # closed: the worker is writing its last batch
            return False
        logger.debug("ack buffered job_id=%s token=%s", lease.pk, lease.token)
        return True

    def _ack_loop(self) -> None:
        """Write buffered completions batch by batch until the buffer is closed and empty."""
        harden(connections[self.using], self.ttl)
        try:
            while (batch := self._acks.take()) is not None:
                short = False
                try:
                    if self._ahead:
                        short = self._flush_and_claim(batch)
                    else:
                        self._flush(batch)
                except Exception:  # noqa: BLE001 - a bug of ours: write them one by one
                    logger.exception("batched acknowledgement failed; writing each on its own")
                    for lease in batch:
                        if not lease.finished:
                            self._record(lease, AttemptOutcome.COMPLETED, lease.complete)
                finally:
                    self._acks.written()
                if short:
                    self._slot_free.set()  # the loop claims for idle slots, or sees no work
        finally:
            connections.close_all()

    def _start_ack_writer(self) -> None:
        """Start the thread that writes buffered completions, if a claimed kind batches them."""
        if not any(get_handler(kind).ack == ACK_BATCH for kind in self.kinds):
            self._acks.close()
            return
        self._ack_writer = self._started(self._ack_loop, "lease-acks")

    @staticmethod
    def _started(target: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread

    def _write_buffered_acks(self) -> None:
        """Write every buffered completion before the worker exits.

        The writer gives up on a lease once the database was unreachable for its whole TTL, so
        waiting one TTL (plus a network timeout's worth) is enough.
        """
        self._acks.close()
        if self._ack_writer is not None:
            self._ack_writer.join(timeout=self.ttl * 2)
            if self._ack_writer.is_alive():
                logger.warning("buffered completions not written: %s left", len(self._acks))

    def _flush_and_claim(self, batch: list[Lease]) -> bool:
        """Complete `batch` and claim jobs ahead for this worker's slots (`_wanted()`) in one
        statement where the database allows it (`complete_and_claim()`); hand them out. Return
        whether it claimed fewer than it wanted (or nothing is wanted): the loop then claims
        for idle slots itself, or finds that nothing is due.

        A statement refused or lost to an outage leaves the batch to `_flush()`, which finds
        the completions of it that committed; a claim of it that committed unseen expires and is
        taken over, as any claim whose answer was lost.
        """
        wanted = self._wanted()
        if not wanted:
            self._flush(batch)
            return True
        started = time.monotonic()
        try:
            won, jobs = self._jobs().complete_and_claim(
                self.worker_id,
                [lease.key for lease in batch],
                ttl=self.ttl,
                limit=wanted,
                kinds=self.kinds,
            )
        except Exception as exc:  # noqa: BLE001 - _flush() retries, or records why it cannot
            if not isinstance(exc, DatabaseError):
                logger.exception("batched acknowledgement with claim failed; writing it alone")
            self._flush(batch, maybe_written=True)
            return True
        self._note_claimed(jobs)
        self._acknowledged({lease.key: lease for lease in batch}, won, started, had_outage=False)
        self._hand_out(self._leases(jobs, started))
        return len(jobs) < wanted

    def _flush(self, batch: list[Lease], *, maybe_written: bool = False) -> None:
        """Complete `batch` in one statement, retrying while the database is down.

        Once the database is unreachable for a lease's whole TTL, that lease is taken as lost,
        as a single completion would be: its job runs again after the lease expires.
        `maybe_written`: an earlier write of it failed, and may have committed.
        """
        pending = {lease.key: lease for lease in batch}
        had_outage = maybe_written
        started = time.monotonic()
        while pending:
            try:
                won = self._jobs().complete_many(self.worker_id, list(pending))
                break
            except TRANSIENT as exc:
                if connections[self.using].is_usable():
                    # The database answered and refused the statement: write each on its own.
                    for lease in pending.values():
                        self._record(lease, AttemptOutcome.COMPLETED, lease.complete)
                    return
                had_outage = True
                for lease in [lease for lease in pending.values() if lease.lost]:
                    del pending[lease.key]
                    self._fenced_out(lease, "database unreachable for longer than the TTL")
                self._outage(f"acknowledgement of {len(pending)} job(s)", exc, wait=self._stopped)
        else:
            return
        self._acknowledged(pending, won, started, had_outage=had_outage)

    def _acknowledged(
        self,
        pending: dict[LeaseKey, Lease],
        won: set[LeaseKey],
        started: float,
        *,
        had_outage: bool,
    ) -> None:
        """Count the completions of a batch written: those in `won`, or (after an outage) found
        committed by an earlier write of ours; the others were fenced out."""
        done = [lease for key, lease in pending.items() if key in won]
        for key, lease in pending.items():
            if key in won:
                continue
            if had_outage and self._jobs().finished_by(lease.pk, lease.owner, lease.token):
                done.append(lease)  # our earlier write committed; only its answer was lost
            else:
                self._fenced_out(lease, "lease lost before its batched completion", recorded=True)
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

    def _restore_connections(self) -> str:
        """Undo a transaction the handler left open on this thread's connections.

        Returns what was wrong, or "". Left as it was, the worker's own write of the outcome
        would run inside the handler's transaction, and commit or vanish with it.
        """
        problems = []
        for conn in connections.all(initialized_only=True):
            try:
                if conn.in_atomic_block:
                    # An atomic block entered and never exited: the wrapper cannot leave it
                    # cleanly, so close the connection and forget it; the next use reconnects.
                    conn.close()
                    del connections[conn.alias]
                elif conn.connection is not None and not conn.get_autocommit():
                    conn.rollback()
                    conn.set_autocommit(True)
                else:
                    continue
            except DatabaseError:
                conn.close()
            problems.append(conn.alias)
        if not problems:
            return ""
        return (
            f"the handler returned with a transaction open on database(s) "
            f"{', '.join(problems)}; its uncommitted writes were rolled back"
        )

    def _record(
        self,
        lease: Lease,
        outcome: str,
        write: Callable[[], object],
        error: BaseException | None = None,
        *,
        maybe_written: bool = False,
    ) -> None:
        """Write a job's outcome, retrying while the database is down and the lease may be live.

        `maybe_written`: an earlier write of it failed, and may have committed.
        """
        had_outage = maybe_written
        while True:
            try:
                result = write()
                break
            except LeaseLost as exc:
                if had_outage and self._jobs().finished_by(lease.pk, lease.owner, lease.token):
                    # Our earlier attempt committed; only its acknowledgement was lost.
                    result = "unknown"
                    break
                self._fenced_out(lease, str(exc))
                return
            except TRANSIENT as exc:
                if connections[self.using].is_usable():
                    # The database answered, and refused this statement: not an outage.
                    self._unrecordable(lease, outcome, exc)
                    return
                had_outage = True
                if lease.lost:
                    self._fenced_out(lease, "database unreachable for longer than the TTL")
                    return
                self._outage(f"{outcome} of job {lease.pk}", exc)
                if self._stopped.is_set():
                    return
            except Exception as exc:  # noqa: BLE001 - e.g. a value the database cannot store
                self._unrecordable(lease, outcome, exc)
                return
        self._count(lease, outcome, result, error)

    def _count(
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
        if outcome != "failed-unrecordable":
            reason = (
                f"the worker could not record the outcome '{outcome}': the database refused it "
                f"({type(exc).__name__})"
            )
            delay = retry_delay(lease.attempt)
            self._record(
                lease,
                "failed-unrecordable",
                partial(lease.fail, HandlerError(reason), retry_in=delay),
                exc,
            )
            return
        self._abandon(lease, "the database refused every outcome write")

    def _fenced_out(self, lease: Lease, reason: str, *, recorded: bool = False) -> None:
        """Count and log a holder write refused; note it in the ledger unless `recorded`.

        A lease an operator cancelled is counted as cancelled: its attempt is closed already.
        """
        lease.mark_lost(reason)
        if lease.cancelled:
            self.stats.add(AttemptOutcome.CANCELLED, kind=lease.job.kind)
            logger.info(
                "cancelled job_id=%s token=%s: %s; nothing written",
                lease.pk,
                lease.token,
                lease.lost_reason,
            )
            return
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
            self._jobs().record_fenced(lease.pk, lease.token)
        except DatabaseError:
            close_old_connections()
