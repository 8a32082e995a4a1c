"""`LeaseWorker`: the claim loop, the job slots and the heartbeat, for one worker process.

It parses no arguments, prints nothing and installs no signal handlers: `run_lease_worker`
drives it, and tests or other programs can embed it. Every lease write goes through
`LeaseQuerySet`.

One lock protocol holds it together. Each slot runs one job at a time on its own thread (and
database connection); the claim loop queues claimed leases (`_ready`) and wakes one idle slot,
which wakes the next as it takes one, and a slot that finishes a job claims its next one itself,
with its completion (`_complete_group`), or, claiming ahead, takes one from `_ready`: a lease
is only ever held by a slot whose thread is alive, or queued for the slots and renewed with
theirs. Whatever a handler raises ends that attempt, never the thread. The loop supervises
every turn: a slot thread that died (a bug of ours) is replaced and its lease abandoned; a
handler past its kind's `timeout` is timed out and its thread abandoned to finish (fenced) on
its own. The heartbeat (`heartbeat.py`) renews only leases that a live slot runs within their
time limit, and those queued.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Collection
from typing import Any, TypeVar

from django.db import (
    DatabaseError,
    close_old_connections,
    connections,
)

from django_leases.ack_buffer import AckBuffer
from django_leases.attempts import TRANSIENT, Recorder, RunsAttempts, WorkerStats
from django_leases.backoff import retry_delay
from django_leases.checks.databases import database_clock_problems
from django_leases.conf import leases_settings, to_seconds
from django_leases.db import harden, keep_usable
from django_leases.exceptions import (
    DatabaseMisconfigured,
    LeaseLost,
    WorkerIdTaken,
)
from django_leases.group_commit import GroupCommit
from django_leases.handlers import ACK_BATCH, get_handler, registered_kinds
from django_leases.heartbeat import RenewsLeases
from django_leases.lease import Lease, Presence
from django_leases.limits import MIN_HEARTBEAT, MIN_POLL_INTERVAL, MIN_TTL, check_kind
from django_leases.listener import Listener
from django_leases.outages import check_tables, outage_or_raise
from django_leases.querysets import (
    LeaseQuerySet,
    WorkerQuerySet,
    leased_jobs,
    queue_models,
    registered_workers,
)
from django_leases.redaction import error_text
from django_leases.schedules import Ticker
from django_leases.status import TIMED_OUT, AttemptOutcome

logger = logging.getLogger("django_leases.worker")

# A coroutine is cancelled at its timeout by its own event loop; the loop supervises it only this
# much later, for a coroutine that blocks its loop and so cannot be cancelled.
ASYNC_TIMEOUT_SLACK = 2.0
T = TypeVar("T")


def default_worker_id() -> str:
    """Return "<host>:<pid>:<random>": unique per process, readable in the admin and logs."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Slot:
    """One job at a time, on its own thread. Its fields change only under the worker's lock."""

    def __init__(self, number: int, lock: threading.Lock) -> None:
        self.number = number
        self.wake = threading.Condition(lock)
        """Notified when this slot gets a lease, a new thread, or the worker closes."""
        self.thread: threading.Thread | None = None
        self.lease: Lease | None = None
        self.started: float | None = None
        """Monotonic time the handler started; None while the lease waits for the thread."""
        self.deadline: float | None = None
        """Monotonic time past which the loop ends the attempt as timed out."""

    @property
    def running(self) -> bool:
        return self.lease is not None and self.started is not None


class LeaseWorker(RunsAttempts, RenewsLeases):
    """Claim jobs of the registered kinds and run them, `concurrency` at a time.

    The jobs are `model`'s (default: `JOB_MODEL`) on the database `using` (default: where the
    routers send writes of the model); the worker's registry row, leases and ledger rows live
    there too.
    """

    def __init__(
        self,
        *,
        model: type[Any] | None = None,
        using: str | None = None,
        worker_id: str | None = None,
        ttl: float | None = None,
        heartbeat: float | None = None,
        concurrency: int | None = None,
        kinds: Collection[str] | None = None,
        burst: bool = False,
        max_jobs: int | None = None,
        poll_interval: float | None = None,
        grace_period: float | None = None,
        ack_batch_size: int | None = None,
        ack_flush_interval: float | None = None,
        recorder: Recorder | None = None,
    ) -> None:
        jobs = leased_jobs(model, using)
        self.model: type[Any] = jobs.model
        self.worker_id = worker_id or default_worker_id()
        self.ttl = to_seconds(ttl if ttl is not None else leases_settings.TTL, "ttl", MIN_TTL)
        self.heartbeat_interval = to_seconds(
            heartbeat if heartbeat is not None else leases_settings.HEARTBEAT,
            "heartbeat",
            MIN_HEARTBEAT,
        )
        if self.heartbeat_interval >= self.ttl:
            raise ValueError(
                f"heartbeat ({self.heartbeat_interval:g}s) must be shorter than ttl ({self.ttl:g}s)"
            )
        gone_after = leases_settings.WORKER_GONE_AFTER
        if self.heartbeat_interval * 2 > gone_after:
            # The registry row is refreshed once per heartbeat; with less than two heartbeats of
            # slack the watcher would take this live worker for gone and rescue its jobs.
            raise ValueError(
                f"heartbeat ({self.heartbeat_interval:g}s) must be at most half of "
                f"DJANGO_LEASES['WORKER_GONE_AFTER'] ({gone_after:g}s)"
            )
        self.concurrency = concurrency if concurrency is not None else leases_settings.CONCURRENCY
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {self.concurrency}")
        known = registered_kinds()
        self.kinds = sorted(check_kind(kind, "kinds") for kind in kinds) if kinds else known
        unknown = sorted(set(self.kinds) - set(known))
        if unknown:
            raise ValueError(
                f"no handler for job kind(s) {', '.join(unknown)}; "
                f"registered: {', '.join(known) or 'none'}"
            )
        if not self.kinds:
            raise ValueError(
                "no job handlers are registered: decorate functions with @job_handler in a "
                "jobs.py module of an installed app"
            )
        self.burst = burst
        self.max_jobs = max_jobs
        self.poll_interval = to_seconds(
            poll_interval if poll_interval is not None else leases_settings.POLL_INTERVAL,
            "poll_interval",
            MIN_POLL_INTERVAL,
        )
        self.grace_period = (
            grace_period if grace_period is not None else leases_settings.GRACE_PERIOD
        )
        # A buffered completion's lease is no longer renewed: it is written at the latest one
        # heartbeat interval before the worker would have to take that lease as lost.
        self._acks = AckBuffer.configured(
            ack_batch_size, ack_flush_interval, margin=self.heartbeat_interval
        )
        self._ack_writer: threading.Thread | None = None
        self._ahead = max_jobs is None and all(get_handler(k).ack == ACK_BATCH for k in self.kinds)
        """Claim ahead: every kind batches its completions, and the writer of a batch claims
        with it one job ahead for each slot (`_flush_and_claim()`)."""
        if self._ahead:
            self._acks.narrow(self.concurrency)  # a batch is due once every slot finished one
        self._ready: deque[Lease] = deque()
        """Jobs claimed ahead, for the slots to start as they finish their own (oldest first)."""
        self._queued_at: dict[tuple[int, int], float] = {}
        """When each lease of `_ready` was queued (monotonic), by `Lease.key`."""
        self._completions = GroupCommit(self._complete_group)
        self.using = jobs.db
        self._job_rows = jobs
        self.stats = WorkerStats(recorder=recorder)
        self.presence = Presence(gone_after)
        """When the watcher may take this worker for gone: its leases end then too."""
        self.failure: str | None = None
        """Why the worker stopped itself (for its supervisor to restart it); None otherwise."""
        self._instance = secrets.token_hex(8)
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._slot_free = threading.Event()
        self._lock = threading.Lock()
        self._closing = False
        self._slots = [Slot(n, self._lock) for n in range(self.concurrency)]
        self._abandoned: list[threading.Thread] = []
        self._heartbeat: threading.Thread | None = None
        self._reported_lost: set[tuple[int, int]] = set()
        self._ticker = Ticker(model=self.model, using=self.using)
        self._checked_at = time.monotonic()

    # ---- public -----------------------------------------------------------------------------

    def run(self) -> WorkerStats:
        """Run until stopped, or until --burst finds nothing left, or --max-jobs is reached.

        Raises `WorkerIdTaken` (before any claim) if a live process already uses the worker id,
        and `DatabaseMisconfigured` (at once, or as soon as the database answers) if the
        database refuses the connection settings, lacks the tables or has a session clock
        that is not UTC.
        """
        harden(connections[self.using], self.ttl)
        self._wait_until_ready()
        logger.info(
            "worker starting worker_id=%s kinds=%s concurrency=%s ttl=%s heartbeat=%s",
            self.worker_id,
            ",".join(self.kinds),
            self.concurrency,
            self.ttl,
            self.heartbeat_interval,
        )
        logger.info(
            "database connections are kept open for the worker's lifetime, whatever "
            "CONN_MAX_AGE says; broken ones are replaced, and CONN_HEALTH_CHECKS runs at most "
            "once per claim loop pass and poll interval"
        )
        if self.ttl > self.presence.gone_after:
            logger.warning(
                "ttl=%s is longer than WORKER_GONE_AFTER=%s: cut off from the database, this "
                "worker gives its leases up %ss after its last registry beat, when the watcher "
                "may rescue them",
                self.ttl,
                self.presence.gone_after,
                self.presence.gone_after,
            )
        listener = Listener.for_model(self.model, self.using, self.ttl)
        try:
            self._start_ack_writer()
            self._register()
            while not self._stopping.is_set():
                self._supervise()
                if self.failure is not None:
                    break
                self._tidy_connections()
                self._ticker.poll()
                free = self._claimable()
                claimed = self.run_once() if free > 0 and not self._quota_reached() else 0
                # A claim the database did not answer found nothing out: --burst waits on.
                if claimed is not None and self._finished(claimed):
                    break
                if claimed is not None and claimed >= free:
                    self._wait_for_slot()
                else:
                    self._wait_for_work(listener)
        finally:
            if self._stopping.is_set():
                logger.info(
                    "stop requested; waiting up to %ss for %s running job(s)",
                    self.grace_period,
                    self._in_flight(),
                )
            if listener is not None:
                listener.close()
            self._shutdown()
        logger.info("worker stopped worker_id=%s %s", self.worker_id, self.stats.summary())
        return self.stats

    def run_once(self) -> int | None:
        """Claim jobs for the idle slots and hand them over; return how many were claimed, or
        None if the database could not be asked (an outage, logged and backed off)."""
        free = self._claimable()
        if self.max_jobs is not None:
            free = min(free, self.max_jobs - self.stats.claimed)
        if free <= 0:
            return 0
        started = time.monotonic()
        try:
            jobs = self._jobs().claim(self.worker_id, ttl=self.ttl, limit=free, kinds=self.kinds)
        except DatabaseError as exc:
            outage_or_raise(exc, self.using)  # the loop stops for a configuration error
            self._outage("claim", exc)
            return None
        self._hand_out(self._leases(jobs, started))
        self._note_claimed(jobs)
        return len(jobs)

    def stop(self) -> None:
        """Stop claiming; running jobs get the grace period. Safe to call from a signal handler."""
        self._stopping.set()
        self._slot_free.set()

    # ---- the loop ---------------------------------------------------------------------------

    def _jobs(self) -> LeaseQuerySet[Any]:
        # One unevaluated queryset for every thread: its methods clone it or write through it,
        # and none fills its result cache. Building one per statement was ~7% of a busy worker.
        return self._job_rows

    def _workers(self) -> WorkerQuerySet:
        return registered_workers(self.using)

    def _wait_until_ready(self) -> None:
        """Check the tables and the session clock before anything is logged or claimed,
        waiting out database outages (until stopped)."""
        while not self._stopping.is_set():
            try:
                check_tables(self.using, queue_models(self.model))
                problems = database_clock_problems(self.using)
            except DatabaseError as exc:
                outage_or_raise(exc, self.using)
                self._outage("the start", exc)
                continue
            if problems:
                raise DatabaseMisconfigured(problems[0])
            return

    def _register(self) -> None:
        """Take this worker's registry row, waiting out database outages (until stopped)."""
        while True:
            started = time.monotonic()
            try:
                registered = self._workers().register(self.worker_id, **self._registry_fields())
            except DatabaseError as exc:
                outage_or_raise(exc, self.using)
                if self._stopping.is_set():
                    return
                self._outage("registration", exc)
                continue
            if not registered:
                raise WorkerIdTaken(
                    f"worker id {self.worker_id!r} is in use by a live worker process; "
                    "give each process its own --worker-id"
                )
            self.presence.confirmed(started)
            return

    def _registry_fields(self) -> dict[str, Any]:
        return {
            "instance": self._instance,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "kinds": self.kinds,
            "concurrency": self.concurrency,
        }

    def _wake_slots(self) -> None:
        # Called under the lock.
        for slot in self._slots:
            slot.wake.notify()

    def _idle_slots(self) -> list[Slot]:
        return [slot for slot in self._slots if slot.lease is None]

    def _claimable(self) -> int:
        """How many jobs the loop claims: one per idle slot; when claiming ahead, also one
        ahead per slot, at most a batch, less the jobs claimed ahead and the completions not
        yet written (each write claims a job for a slot)."""
        if not self._ahead:
            with self._lock:
                return max(0, len(self._idle_slots()) - len(self._ready))
        owed = self._owed()
        with self._lock:
            idle = len(self._idle_slots())
            if not idle:
                return 0
            wanted = idle + self.concurrency - len(self._ready) - owed
            return max(0, min(self._acks.size, wanted))

    def _wanted(self) -> int:
        """How many jobs a batch's write claims ahead: up to one waiting per slot beside one
        running, at most a batch; none once the worker stops."""
        with self._lock:
            if self._stopping.is_set() or self._closing:
                return 0
            wanted = len(self._idle_slots()) + self.concurrency - len(self._ready)
            return max(0, min(self._acks.size, wanted))

    def _hand_out(self, leases: list[Lease]) -> None:
        """Queue claimed jobs for the slots (`_ready`) and wake one idle slot: each slot that
        takes one wakes the next (`_wake_idle()`), off the claiming thread, whose next statement
        is the pipeline's critical path. Release them all once the worker closes."""
        with self._lock:
            late = self._closing
            if not late:
                now = time.monotonic()
                self._queued_at.update((lease.key, now) for lease in leases)
                self._ready.extend(leases)
                self._wake_idle()
        if late:
            for lease in leases:
                self._release_unstarted(lease)

    def _wake_idle(self) -> None:
        """Under the lock: wake one idle slot for the jobs waiting in `_ready`, if any."""
        if self._ready:
            for slot in self._slots:
                if slot.lease is None and slot.thread is not None:
                    slot.wake.notify()
                    return

    def _take_ready(self, lost: list[Lease]) -> Lease | None:
        """Under the lock: the oldest job in `_ready`. One whose lease ran out while it waited
        goes to `lost`, never started: its job is taken over once the lease expires in the
        database. The caller, its slot no longer idle, wakes a slot for the next (`_wake_idle`)."""
        while self._ready:
            lease = self._ready.popleft()
            self._queued_at.pop(lease.key, None)
            if not lease.lost:
                return lease
            lost.append(lease)
        return None

    def _release_waited_too_long(self) -> None:
        """Release the jobs that waited a whole TTL in `_ready`: the heartbeat renews a queued
        job while a slot may soon start it, not for as long as the slots' handlers hang."""
        now = time.monotonic()
        with self._lock:
            stale = [
                lease
                for lease in self._ready
                if now - self._queued_at.get(lease.key, now) >= self.ttl
            ]
            for lease in stale:
                self._ready.remove(lease)
                self._queued_at.pop(lease.key, None)
        for lease in stale:
            self._release_unstarted(lease)

    def _lost_while_ready(self, lost: list[Lease]) -> None:
        for lease in lost:
            self._fenced_out(lease, "lost before a slot started it", recorded=True)

    def _next_ready(self) -> Lease | None:
        """The oldest job claimed ahead, for a slot that finished its own; None if there is none
        or the worker stops (its shutdown releases them)."""
        lost: list[Lease] = []
        with self._lock:
            lease = None if self._stopping.is_set() else self._take_ready(lost)
            self._wake_idle()  # this slot still holds the lease it just finished
        self._lost_while_ready(lost)
        return lease

    def _owed(self) -> int:
        """Completions not yet written whose writes claim ahead (none unless claiming ahead)."""
        return self._acks.pending if self._ahead else 0

    def _in_flight(self) -> int:
        """Jobs held and not finished: in the slots, and claimed ahead."""
        with self._lock:
            return len(self._ready) + sum(slot.lease is not None for slot in self._slots)

    def _quota_reached(self) -> bool:
        return self.max_jobs is not None and self.stats.claimed >= self.max_jobs

    def _finished(self, claimed: int) -> bool:
        if self._quota_reached() and self._in_flight() == 0:
            return True
        return self.burst and claimed == 0 and self._in_flight() + self._owed() == 0

    def _next_wakeup(self, limit: float) -> float:
        """Seconds until the earliest run-time limit of a running slot or the next schedule
        tick, at most `limit`."""
        with self._lock:
            deadlines = [s.deadline for s in self._slots if s.running and s.deadline is not None]
        deadlines.append(self._ticker.next_check)
        return max(0.01, min(limit, min(deadlines) - time.monotonic()))

    def _wait_for_slot(self) -> None:
        self._slot_free.wait(timeout=self._next_wakeup(self.poll_interval))
        self._slot_free.clear()

    def _wait_for_work(self, listener: Listener | None) -> None:
        if self.burst and self._in_flight() + self._owed() == 0:
            return
        # Jitter keeps idle workers from polling in lockstep.
        wait = self.poll_interval * random.uniform(0.5, 1.5)  # noqa: S311
        deadline = time.monotonic() + self._next_wakeup(wait)
        while not self._stopping.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._slot_free.is_set():
                break
            if listener is not None and listener.wait(min(remaining, 0.25)):
                break
            if listener is None:
                self._slot_free.wait(timeout=min(remaining, 0.25))
        self._slot_free.clear()

    def _tidy_connections(self) -> None:
        """Replace the loop's broken connections; health-check at most once per poll interval."""
        now = time.monotonic()
        check = now - self._checked_at >= self.poll_interval
        if check:
            self._checked_at = now
        keep_usable(health_check=check)

    def _outage(self, what: str, exc: Exception, *, wait: threading.Event | None = None) -> None:
        """Log a database outage, drop the broken connection and back off (jittered) unless
        `wait` (default: the stop request) is set first."""
        self.stats.add("outages")
        logger.warning("database unavailable during %s: %s; retrying", what, error_text(exc))
        close_old_connections()
        connections[self.using].close()
        pause = min(5.0, self.poll_interval) * random.uniform(0.5, 1.5)  # noqa: S311
        (wait or self._stopping).wait(timeout=pause)

    # ---- supervision ------------------------------------------------------------------------

    def _supervise(self) -> None:
        """Replace dead threads, time out handlers past their limit, count abandoned threads."""
        now = time.monotonic()
        with self._lock:
            for slot in self._slots:
                if slot.thread is not None and not slot.thread.is_alive():
                    if self._closing and slot.lease is None:
                        slot.thread = None  # it ended on its own: the worker is closing
                    else:
                        self._replace_dead_slot(slot)
            late = [
                (slot, slot.lease)
                for slot in self._slots
                if slot.running and slot.deadline is not None and now >= slot.deadline
            ]
        for slot, lease in late:
            if lease is not None:
                self._time_out(slot, lease)
        with self._lock:
            for slot in self._slots:
                if slot.thread is None and not self._closing:
                    slot.thread = threading.Thread(
                        target=self._slot_main,
                        args=(slot,),
                        name=f"lease-slot-{slot.number}",
                        daemon=True,
                    )
                    slot.thread.start()
            self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
            abandoned = len(self._abandoned)
        if self._heartbeat is None or not self._heartbeat.is_alive():
            if self._heartbeat is not None:
                logger.error("the heartbeat thread died; starting a new one")
            self._heartbeat = self._started(self._heartbeat_loop, "lease-heartbeat")
        if self._ack_writer is not None and not self._ack_writer.is_alive():
            # Its code catches what a write raises, so this is a bug of ours. Completions it had
            # taken are not written: their leases run out and those jobs run again, as after a
            # crash; without a writer every later ack of the batch kinds would be lost too.
            logger.error("the acknowledgement thread died; starting a new one")
            self._acks.written()
            self._ack_writer = self._started(self._ack_loop, "lease-acks")
        if abandoned > self.concurrency and self.failure is None:
            self.failure = (
                f"{abandoned} handler thread(s) still running past their timeout, more than "
                f"--concurrency ({self.concurrency}); stopping so that a supervisor restarts "
                "the process"
            )
            logger.error("%s", self.failure)

    def _replace_dead_slot(self, slot: Slot) -> None:
        # Called under the lock. The slot's code catches everything a job raises, so this is a
        # bug of ours: never keep (or renew) a lease whose handler nobody runs.
        lease = slot.lease
        logger.error("slot thread %s died; starting a new one", slot.number)
        if lease is not None:
            self._abandon(lease, "its slot thread died")
        slot.thread, slot.lease, slot.started, slot.deadline = None, None, None, None
        self._slot_free.set()

    def _abandon(self, lease: Lease, why: str) -> None:
        lease.mark_lost(f"abandoned: {why}")
        self.stats.add("abandoned", kind=lease.job.kind)
        logger.warning(
            "abandoned job_id=%s token=%s: %s; its lease expires in at most %ss",
            lease.pk,
            lease.token,
            why,
            self.ttl,
        )

    def _time_out(self, slot: Slot, lease: Lease) -> None:
        """End the attempt of a handler past its time limit and give its slot a new thread.

        Python cannot stop a thread: the handler runs on, abandoned, and every lease write it
        makes later (`lease.atomic()` included) is refused.
        """
        reason = f"ran past its timeout of {get_handler(lease.job.kind).timeout:g}s"
        try:
            status = lease.time_out(reason, retry_in=retry_delay(lease.attempt))
        except LeaseLost:
            status = "lost before its timeout"
        except DatabaseError as exc:
            # Without the database we cannot end the attempt: stop renewing, so that the lease
            # expires and the watcher applies the same policy.
            logger.warning("could not time out job_id=%s: %s", lease.pk, type(exc).__name__)
            status = "left to expire"
        with self._lock:
            if slot.lease is not lease or slot.thread is None:
                return  # the handler returned meanwhile; its slot wrote the outcome
            lease.mark_lost(reason)
            self._abandoned.append(slot.thread)
            slot.thread, slot.lease, slot.started, slot.deadline = None, None, None, None
            self._wake_slots()
        self.stats.add(TIMED_OUT, kind=lease.job.kind)
        logger.warning(
            "timed out job_id=%s attempt=%s token=%s: %s; %s; its thread is abandoned",
            lease.pk,
            lease.attempt,
            lease.token,
            reason,
            status,
        )
        self._slot_free.set()

    # ---- slots ------------------------------------------------------------------------------

    def _slot_main(self, slot: Slot) -> None:
        me = threading.current_thread()
        try:
            while True:
                lost: list[Lease] = []
                with self._lock:
                    # Once stop is requested an unstarted lease stays where it is, in the slot
                    # or in `_ready`: the shutdown releases it (and counts it) before it waits
                    # for running ones.
                    slot.wake.wait_for(
                        lambda: (
                            slot.thread is not me
                            or self._closing
                            or (
                                not self._stopping.is_set()
                                and (
                                    (slot.lease is None and bool(self._ready))
                                    or (slot.lease is not None and slot.started is None)
                                )
                            )
                        )
                    )
                    if slot.thread is not me or self._closing or slot.started is not None:
                        return
                    if slot.lease is None:
                        slot.lease = self._take_ready(lost)
                        self._wake_idle()
                    lease = slot.lease
                    if lease is not None:
                        slot.started = time.monotonic()
                        slot.deadline = self._deadline(lease, slot.started)
                self._lost_while_ready(lost)
                if lease is None:
                    continue  # another slot took the job it was woken for
                harden(connections[self.using], self.ttl)  # per job: a dropped wrapper is new
                following = self._execute(lease)
                with self._lock:
                    mine = slot.thread is me
                    if mine and slot.lease is lease:
                        slot.lease, slot.started, slot.deadline = None, None, None
                        if following is not None and not self._closing:
                            # The completion claimed this slot's next job: it starts at once
                            # (a shutdown releases the unstarted leases it finds in slots).
                            slot.lease, following = following, None
                    free = slot.lease is None
                if following is not None:
                    self._release_unstarted(following)  # its slot was taken from this thread
                if free and not self._owed():
                    # Claiming ahead, a completion still to be written claims for this slot:
                    # the loop need not wake (the writer wakes it if that claim comes up short).
                    self._slot_free.set()
                if not mine:
                    return  # abandoned past its timeout: the slot has a new thread
        except BaseException:  # noqa: BLE001 - a bug of ours; the loop abandons the slot's lease
            logger.exception("slot thread %s failed", slot.number)
            self._slot_free.set()
        finally:
            connections.close_all()

    @staticmethod
    def _deadline(lease: Lease, started: float) -> float | None:
        """When the loop ends this attempt: at the kind's timeout; for a coroutine, which its
        own event loop cancels at the timeout, only if it blocks that loop."""
        handler = get_handler(lease.job.kind)
        if handler.timeout is None:
            return None
        slack = ASYNC_TIMEOUT_SLACK if handler.is_async else 0.0
        return started + handler.timeout + slack

    # ---- shutdown ---------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Release unstarted jobs, let running ones finish within the grace period."""
        with self._lock:
            unstarted = [s.lease for s in self._slots if s.lease is not None and s.started is None]
            unstarted += self._ready
            self._ready.clear()
            self._queued_at.clear()
            for slot in self._slots:
                if slot.started is None:
                    slot.lease = None
            self._closing = True
            self._wake_slots()
        for lease in unstarted:
            if lease is not None:
                self._release_unstarted(lease)
        deadline = time.monotonic() + self.grace_period
        # Wait in short slices: a signal the kernel hands to another thread only runs its
        # Python handler (a second SIGTERM exits at once) when the main thread runs bytecode.
        while self._in_flight() and time.monotonic() < deadline:
            self._slot_free.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            self._slot_free.clear()
            self._supervise()
        with self._lock:
            still_running = [slot.lease for slot in self._slots if slot.lease is not None]
        for lease in still_running:
            # Releasing a job whose handler still runs would let a second worker start it
            # alongside. Instead stop renewing: the lease expires and the watcher returns it.
            self._abandon(lease, f"still running after the {self.grace_period}s grace period")
        self._write_buffered_acks()
        self._stopped.set()
        try:
            self._workers().stopped(self.worker_id, self._instance)
        except DatabaseError:
            pass  # the row ages out; a database that refuses us already said why
        finally:
            connections.close_all()

    def _release_unstarted(self, lease: Lease) -> None:
        try:
            lease.release()
        except (LeaseLost, *TRANSIENT) as exc:
            logger.warning("could not release job_id=%s: %s", lease.pk, error_text(exc))
            return
        self.stats.add(AttemptOutcome.RELEASED, kind=lease.job.kind)
        logger.info("released unstarted job_id=%s token=%s", lease.pk, lease.token)
