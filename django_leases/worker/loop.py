"""`LeaseWorker`: one worker process's claim loop, put together from its parts.

It parses no arguments, prints nothing and installs no signal handlers: `run_lease_worker`
drives it, and tests or other programs can embed it. Every lease write goes through
`LeaseQuerySet`.

The parts (`django_leases/worker/`), each chosen or built once here, each owning its thread's
fields: `SlotPool` (`slots.py`), `Attempts` (`attempt.py`), a `Completer` and the `AckWriter`
(`completion.py`), `Outcomes` (`outcomes.py`) and `Heartbeat` (`heartbeat.py`).

The loop supervises every turn: a slot thread that died (a bug of ours) is replaced and its
lease abandoned; a handler past its kind's `timeout` is timed out and its thread abandoned to
finish (fenced) on its own; a dead heartbeat or acknowledgement thread is started again.
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections.abc import Collection
from contextlib import nullcontext
from typing import Any

from django.db import DatabaseError, connections

from django_leases import tracing
from django_leases.checks.databases import database_clock_problems
from django_leases.conf import leases_settings, to_seconds
from django_leases.exceptions import DatabaseMisconfigured
from django_leases.handlers import ACK_BATCH, get_handler, lease_length, min_lease, registered_kinds
from django_leases.lease import Lease, Presence
from django_leases.limits import MIN_HEARTBEAT, MIN_POLL_INTERVAL, MIN_TTL, check_kind, check_owner
from django_leases.listener import Listener, Wakeups
from django_leases.network import harden, keep_usable
from django_leases.outages import Outages, check_tables, outage_or_raise
from django_leases.querysets.claims import failures_of
from django_leases.schedules import Ticker
from django_leases.tables import leased_jobs, queue_models
from django_leases.worker.attempt import Attempts, TracedAttempts
from django_leases.worker.completion import AckBuffer, AckWriter, choose
from django_leases.worker.counters import Recorder, WorkerStats
from django_leases.worker.heartbeat import Heartbeat, RegistryRow, default_worker_id
from django_leases.worker.outcomes import Outcomes
from django_leases.worker.owners import Owner, part_lock, under
from django_leases.worker.slots import Slot, SlotPool

logger = logging.getLogger("django_leases.worker")


class LeaseWorker:
    """Claim jobs of the registered kinds and run them, `concurrency` at a time.

    The jobs are `model`'s (default: `JOB_MODEL`) on the database `using` (default: where the
    routers send writes of the model); the worker's registry row, leases and ledger rows live
    there too.

    Its own mutable fields are the loop's (the thread that calls `run()`), except `_failure`,
    which the loop and the heartbeat write under `_failure_lock`, and the events, which any
    thread sets.
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
        wakeups: Wakeups | None = None,
    ) -> None:
        jobs = leased_jobs(model, using)
        self.model: type[Any] = jobs.model
        self.worker_id = check_owner(worker_id, "worker_id") if worker_id else default_worker_id()
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
        for kind in self.kinds:
            length = lease_length(kind, self.ttl)
            if self.heartbeat_interval >= length:
                raise ValueError(
                    f"heartbeat ({self.heartbeat_interval:g}s) must be shorter than the ttl of "
                    f"job kind {kind!r} ({length:g}s)"
                )
        self.min_lease = min_lease(self.kinds, self.ttl)
        """The shortest lease of the kinds served; the network timeout ("auto") follows it."""
        self.burst = burst
        self.max_jobs = max_jobs
        poll = leases_settings.POLL_INTERVAL if poll_interval is None else poll_interval
        self.poll_interval = to_seconds(poll, "poll_interval", MIN_POLL_INTERVAL)
        self.grace_period = leases_settings.GRACE_PERIOD if grace_period is None else grace_period
        self.using = jobs.db
        # One unevaluated queryset for every thread: its methods clone it or write through it,
        # and none fills its result cache. Building one per statement was ~7% of a busy worker.
        self._jobs = jobs
        self._look_next = False  # a --burst claim found nothing, not looking for expired leases
        self.stats = WorkerStats(recorder=recorder)
        self.presence = Presence(gone_after)
        """When the watcher may take this worker for gone: its leases end then too."""
        self._failure: str | None = None
        self._failure_lock = part_lock()
        self._instance = secrets.token_hex(8)
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._slot_free = threading.Event()
        self._ticker = Ticker(model=self.model, using=self.using)
        self._wakeups = wakeups  # what wakes the idle loop; default: a LISTEN of its own
        self._loop = Owner("loop")
        """The thread that calls `run()`: it alone starts and replaces the parts' threads."""
        self._checked_at = time.monotonic()
        self._build(ack_batch_size, ack_flush_interval)

    def _build(self, ack_batch_size: int | None, ack_flush_interval: float | None) -> None:
        """Make the worker's parts, and choose its completer, from its configuration."""
        self._outages = Outages(self.stats, self.using, self.poll_interval, self._stopping)
        outcomes = Outcomes(
            self._jobs,
            kinds=self.kinds,
            worker_id=self.worker_id,
            ttl=self.ttl,
            presence=self.presence,
            stats=self.stats,
            outages=self._outages,
            stopped=self._stopped,
        )
        self._outcomes = outcomes
        self._pool = SlotPool(
            self.concurrency,
            stopping=self._stopping,
            slot_free=self._slot_free,
            release=outcomes.release_unstarted,
            lost=outcomes.lost_unstarted,
            loop=self._loop,
        )
        if self.stats.recorder is not None:
            self.stats.recorder.serve_slots(self._pool.busy, self.concurrency)
        # A buffered completion's lease is no longer renewed: it is written at the latest one
        # heartbeat interval before the worker would have to take that lease as lost.
        self._acks = AckBuffer.configured(
            ack_batch_size, ack_flush_interval, margin=self.heartbeat_interval
        )
        self._ahead = self.max_jobs is None and all(
            get_handler(k).ack == ACK_BATCH for k in self.kinds
        )
        """Claim ahead: every kind batches its completions, and the writer of a batch claims
        with it one job ahead for each slot (`AckWriter._flush_and_claim()`)."""
        if self._ahead:
            self._acks.narrow(self.concurrency)  # a batch is due once every slot finished one
        self._ack_writer = AckWriter(
            self._acks,
            outcomes,
            self._jobs,
            pool=self._pool,
            kinds=self.kinds,
            ahead=self._ahead,
            slot_free=self._slot_free,
            loop=self._loop,
        )
        completer = choose(
            outcomes,
            pool=self._pool,
            acks=self._acks,
            stopping=self._stopping,
            counts_claims=self.max_jobs is not None,
            claims_ahead=self._ahead,
        )
        self._attempts = (TracedAttempts if tracing.enabled() else Attempts)(outcomes, completer)
        self._row = RegistryRow(
            using=self.using,
            worker_id=self.worker_id,
            instance=self._instance,
            kinds=self.kinds,
            concurrency=self.concurrency,
            presence=self.presence,
            heartbeat=self.heartbeat_interval,
        )
        self._heartbeat = Heartbeat(
            self._jobs,
            self._row,
            held=self._pool.held,
            tidy=self._pool.release_waited_too_long,
            taken=self._taken,
            stats=self.stats,
            ttl=self.ttl,
            interval=self.heartbeat_interval,
            stopped=self._stopped,
            loop=self._loop,
        )

    @property
    def failure(self) -> str | None:
        """Why the worker stopped itself (for its supervisor to restart it); None otherwise."""
        with self._failure_lock:
            return self._failure

    # ---- public -----------------------------------------------------------------------------

    def run(self) -> WorkerStats:
        """Run until stopped, or until --burst finds nothing left, or --max-jobs is reached.

        Raises `WorkerIdTaken` (before any claim) if a live process already uses the worker id,
        and `DatabaseMisconfigured` (at once, or as soon as the database answers) if the
        database refuses the connection settings, lacks the tables or has a session clock
        that is not UTC.
        """
        self._loop.bind()
        harden(connections[self.using], self.min_lease)
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
        longest = max(lease_length(kind, self.ttl) for kind in self.kinds)
        if longest > self.presence.gone_after:
            logger.warning(
                "ttl=%s is longer than WORKER_GONE_AFTER=%s: cut off from the database, this "
                "worker gives its leases up %ss after its last registry beat, when the watcher "
                "may rescue them",
                longest,
                self.presence.gone_after,
                self.presence.gone_after,
            )
        listener = self._wakeups or Listener.for_model(self.model, self.using, self.min_lease)
        try:
            self._ack_writer.start()
            self._row.take(self._outages, self._stopping)
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
                    self._pool.in_flight(),
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
        looked = self._look_next or self._outcomes.takes_over()
        try:
            jobs = self._outcomes.claimer.claim(free, takeover=looked)
        except DatabaseError as exc:
            outage_or_raise(exc, self.using)  # the loop stops for a configuration error
            self._outages.pause("claim", exc)
            return None
        self._outages.over()
        self._pool.hand_out(self._outcomes.leases(jobs, started))
        self._outcomes.note_claimed(jobs, looked=looked)
        self._look_next = self.burst and not jobs and not looked
        # A kind skipped (its gate held), or expired leases not looked for: --burst waits on.
        return None if self._look_next or not jobs and failures_of(jobs) else len(jobs)

    def stop(self) -> None:
        """Stop claiming; running jobs get the grace period. Call it from any thread; from a
        signal, through `stop_signals()` (in a handler on the loop's thread it may deadlock)."""
        self._stopping.set()
        self._slot_free.set()

    # ---- the loop ---------------------------------------------------------------------------

    def _wait_until_ready(self) -> None:
        """Check the tables and the session clock before anything is logged or claimed,
        waiting out database outages (until stopped)."""
        while not self._stopping.is_set():
            try:
                check_tables(self.using, queue_models(self.model))
                problems = database_clock_problems(self.using)
            except DatabaseError as exc:
                outage_or_raise(exc, self.using)
                self._outages.pause("the start", exc)
                continue
            if problems:
                raise DatabaseMisconfigured(problems[0])
            self._outages.over()
            return

    def _taken(self, why: str) -> None:
        """On the heartbeat: another live process took the registry row; stop."""
        with self._failure_lock:
            under(self._failure_lock, "LeaseWorker._failure")
            self._failure = why
        self.stop()

    def _owed(self) -> int:
        """Completions not yet written whose writes claim ahead (none unless claiming ahead)."""
        return self._acks.pending if self._ahead else 0

    def _claimable(self) -> int:
        return self._pool.claimable(ahead=self._ahead, owed=self._owed(), batch=self._acks.size)

    def _quota_reached(self) -> bool:
        return self.max_jobs is not None and self.stats.claimed >= self.max_jobs

    def _finished(self, claimed: int) -> bool:
        in_flight = self._pool.in_flight
        if self._quota_reached() and in_flight() == 0:
            return True
        return self.burst and claimed == 0 and in_flight() + self._owed() == 0

    def _next_wakeup(self, limit: float) -> float:
        """Seconds until the earliest run-time limit of a running slot or the next schedule
        tick, at most `limit`."""
        deadlines = self._pool.deadlines()
        deadlines.append(self._ticker.next_check)
        return max(0.01, min(limit, min(deadlines) - time.monotonic()))

    def _wait_for_slot(self) -> None:
        self._slot_free.wait(timeout=self._next_wakeup(self.poll_interval))
        self._slot_free.clear()

    def _wait_for_work(self, listener: Wakeups | None) -> None:
        if self.burst and self._pool.in_flight() + self._owed() == 0:
            return
        # Jitter keeps idle workers from polling in lockstep.
        wait = self.poll_interval * random.uniform(0.5, 1.5)  # noqa: S311
        deadline = time.monotonic() + self._next_wakeup(wait)
        with listener.waiting() if listener is not None else nullcontext():
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

    # ---- supervision ------------------------------------------------------------------------

    def _supervise(self) -> None:
        """Replace dead threads, time out handlers past their limit, count abandoned threads."""
        for slot, lease in self._pool.reap(self._outcomes.abandon):
            self._time_out(slot, lease)
        abandoned = self._pool.start_threads(self._slot_main)
        self._heartbeat.ensure_running()
        self._ack_writer.ensure_running()
        if abandoned > self.concurrency:
            why = (
                f"{abandoned} handler thread(s) still running past their timeout, more than "
                f"--concurrency ({self.concurrency}); stopping so that a supervisor restarts "
                "the process"
            )
            with self._failure_lock:
                first = self._failure is None
                if first:
                    under(self._failure_lock, "LeaseWorker._failure")
                    self._failure = why
            if first:
                logger.error("%s", why)

    def _time_out(self, slot: Slot, lease: Lease) -> None:
        """End the attempt of a handler past its time limit and give its slot a new thread.

        Python cannot stop a thread: the handler runs on, abandoned, and every lease write it
        makes later (`lease.atomic()` included) is refused.
        """
        reason, status = self._outcomes.time_out(lease)
        if self._pool.abandon_timed_out(slot, lease, reason):
            self._outcomes.timed_out(lease, reason, status)
            self._slot_free.set()
        # else the handler returned meanwhile; its slot wrote the outcome

    # ---- slots ------------------------------------------------------------------------------

    def _slot_main(self, slot: Slot) -> None:
        """A slot thread: start the jobs the pool gives it, one at a time, until it is no
        longer the slot's thread or the worker closes."""
        try:
            while True:
                go_on, lease = self._pool.start_next(slot)
                if not go_on:
                    return
                if lease is None:
                    continue  # another slot took the job it was woken for
                harden(connections[self.using], self.min_lease)  # per job: a dropped wrapper is new
                following = self._attempts.execute(lease)
                mine, free = self._pool.finish(slot, lease, following)
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

    # ---- shutdown ---------------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Release unstarted jobs, let running ones finish within the grace period."""
        self._pool.close()
        deadline = time.monotonic() + self.grace_period
        # Wait in short slices: a signal the kernel hands to another thread only runs its
        # Python handler (a second SIGTERM exits at once) when the main thread runs bytecode.
        while self._pool.in_flight() and time.monotonic() < deadline:
            self._slot_free.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            self._slot_free.clear()
            self._supervise()
        for lease in self._pool.running():
            # Releasing a job whose handler still runs would let a second worker start it
            # alongside. Instead stop renewing: the lease expires and the watcher returns it.
            self._outcomes.abandon(
                lease, f"still running after the {self.grace_period}s grace period"
            )
        self._ack_writer.write_all()
        self._stopped.set()
        try:
            self._row.stopped()
        except DatabaseError:
            pass  # the row ages out; a database that refuses us already said why
        finally:
            connections.close_all()
