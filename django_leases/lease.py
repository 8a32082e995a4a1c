"""`Lease`: what a handler receives beside its job. It calls queryset methods only."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.db import transaction

from django_leases.conf import to_seconds
from django_leases.exceptions import LeaseLost
from django_leases.querysets import LeaseQuerySet, leased_jobs
from django_leases.status import FAILED, TIMED_OUT, AttemptOutcome

if TYPE_CHECKING:
    from django_leases.models import AbstractLeasedJob

P = ParamSpec("P")
R = TypeVar("R")


class Lease:
    """The claim of one job by one owner under one fencing token.

    Its holder knows the lease is lost when a write of its own is refused, when the worker's
    heartbeat is refused, or — without asking the database — once a whole TTL has passed since
    the start of the last renewal the database confirmed: after that, someone else may own the job
    whatever happened to the network. `lost` reads the worker's monotonic clock, never the wall
    clock.
    """

    def __init__(
        self, job: AbstractLeasedJob, *, ttl: float | timedelta, renewed_at: float | None = None
    ) -> None:
        self.job = job
        self.pk: int = job.pk
        self.owner: str = job.lease_owner
        self.token: int = job.lease_token
        self.attempt: int = job.attempts
        self.ttl = to_seconds(ttl, "ttl")
        self.finished = False
        # What the holder's last write made of the job: "completed", "retried", "failed",
        # "released" or "timed_out"; None while it holds the job.
        self.outcome: str | None = None
        self._lost = threading.Event()
        self._lost_reason = ""
        # The claim's statement started at or after `renewed_at`, so the database's lease ends
        # no earlier than this deadline.
        self._valid_until = (time.monotonic() if renewed_at is None else renewed_at) + self.ttl

    def __repr__(self) -> str:
        state = "lost" if self.lost else "finished" if self.finished else "held"
        return f"<Lease job={self.pk} owner={self.owner} token={self.token} {state}>"

    @property
    def key(self) -> tuple[int, int]:
        """(job id, fencing token): one acquisition, even when one worker claims a job again."""
        return self.pk, self.token

    @property
    def lost(self) -> bool:
        """True once this holder knows, or must assume, that it no longer owns the job."""
        if not self._lost.is_set() and time.monotonic() >= self._valid_until:
            self.mark_lost("not renewed for a whole TTL (database unreachable?)")
        return self._lost.is_set()

    @property
    def valid_until(self) -> float:
        """Monotonic time at which the lease must be taken as lost unless renewed before."""
        return self._valid_until

    @property
    def lost_reason(self) -> str:
        return self._lost_reason

    def mark_lost(self, reason: str) -> None:
        if not self._lost.is_set():
            self._lost_reason = reason
            self._lost.set()

    def renewed(self, started_at: float) -> None:
        """Note a renewal the database confirmed, sent at `started_at` (monotonic)."""
        self._valid_until = max(self._valid_until, started_at + self.ttl)

    def check(self) -> None:
        """Raise `LeaseLost` if the lease is known to be lost."""
        if self.lost:
            raise LeaseLost(f"job {self.pk}: {self._lost_reason or 'lease lost'}")

    def _jobs(self) -> LeaseQuerySet[Any]:
        return leased_jobs(type(self.job))

    def heartbeat(self) -> None:
        """Renew the lease now for another TTL; raise `LeaseLost` if it was lost."""
        self.check()
        started = time.monotonic()
        if self.pk not in self._jobs().heartbeat(self.owner, {self.pk: self.token}, ttl=self.ttl):
            self.mark_lost("heartbeat refused: the lease expired or was taken over")
            self.check()
        self.renewed(started)

    def checkpoint(self, step: str) -> None:
        """Record that the handler reached `step` (e.g. "psp_called") before a risky action.

        Refused (`LeaseLost`) once the lease has expired, even if nobody took it over yet: the
        watcher may already have decided what to do with the job from the checkpoint it read.
        """
        self.check()
        self._guard(lambda: self._jobs().checkpoint(self.pk, self.owner, self.token, step))

    def complete(self, result: Any = None) -> None:
        """Complete the job now (storing `result`, if given); the worker then writes nothing."""
        self._guard(lambda: self._jobs().complete(self.pk, self.owner, self.token, result=result))
        self.finished, self.outcome = True, AttemptOutcome.COMPLETED

    def mark_completed(self) -> None:
        """Note that the worker's batched acknowledgement completed the job."""
        self.finished, self.outcome = True, AttemptOutcome.COMPLETED

    def fail(
        self, error: BaseException | str, *, retry_in: float | None = None, permanent: bool = False
    ) -> str:
        status = self._guard(
            lambda: self._jobs().fail(
                self.pk, self.owner, self.token, error, retry_in=retry_in, permanent=permanent
            )
        )
        self.finished, self.outcome = (
            True,
            (AttemptOutcome.FAILED if status == FAILED else AttemptOutcome.RETRIED),
        )
        return str(status)

    def release(self) -> None:
        self._guard(lambda: self._jobs().release(self.pk, self.owner, self.token))
        self.finished, self.outcome = True, AttemptOutcome.RELEASED

    def time_out(self, reason: str, *, retry_in: float) -> str:
        """End the attempt as timed out (the worker's run-time limit); return the new status."""
        status = self._guard(
            lambda: self._jobs().time_out(
                self.pk, self.owner, self.token, retry_in=retry_in, reason=reason
            )
        )
        self.mark_lost(reason)
        self.finished, self.outcome = True, TIMED_OUT
        return str(status)

    @contextmanager
    def atomic(self) -> Iterator[None]:
        """Run the block in a transaction that holds the lease and completes the job on exit.

        The lease is re-checked (and the job row locked) when the block starts, so a holder that
        lost its lease gets `LeaseLost` and its writes roll back; on a clean exit the job is
        completed in the same transaction as the handler's own writes: both commit or neither.
        Keep the block short: it holds the job row (and, on SQLite, the database) locked.
        """
        self.check()
        jobs = self._jobs()
        with transaction.atomic(using=jobs.db):
            self._guard(lambda: jobs.lock_held(self.pk, self.owner, self.token))
            yield
            self._guard(lambda: jobs.complete(self.pk, self.owner, self.token))
        self.finished, self.outcome = True, AttemptOutcome.COMPLETED

    def run_atomic(self, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call `func` inside `atomic()`: its writes and the completion commit together."""
        with self.atomic():
            return func(*args, **kwargs)

    # ---- from async handlers ------------------------------------------------------------------
    # Each runs the synchronous method on the worker's slot thread (thread-sensitive
    # sync_to_async), whose database connection the handler's own `sync_to_async` calls and
    # Django's async ORM methods use too. The event loop never blocks on the database.

    async def acheck(self) -> None:
        """Raise `LeaseLost` if the lease is known to be lost (no database access)."""
        self.check()

    async def aheartbeat(self) -> None:
        await sync_to_async(self.heartbeat)()

    async def acheckpoint(self, step: str) -> None:
        await sync_to_async(self.checkpoint)(step)

    async def acomplete(self, result: Any = None) -> None:
        await sync_to_async(self.complete)(result)

    async def afail(
        self, error: BaseException | str, *, retry_in: float | None = None, permanent: bool = False
    ) -> str:
        return await sync_to_async(self.fail)(error, retry_in=retry_in, permanent=permanent)

    async def arelease(self) -> None:
        await sync_to_async(self.release)()

    async def aatomic(self, func: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Call the synchronous `func` inside `atomic()` on the slot thread; return its result.

        The async counterpart of `with lease.atomic():` — Django's transactions are
        synchronous, so the writes that must commit with the completion go in one function:
        `await lease.aatomic(Payment.objects.filter(pk=pk).update, status="captured")`.
        """
        return await sync_to_async(self.run_atomic)(func, *args, **kwargs)

    def _guard(self, write: Callable[[], R]) -> R:
        try:
            return write()
        except LeaseLost as exc:
            self.mark_lost(str(exc))
            raise
