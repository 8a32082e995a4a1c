"""`Lease`: what a handler receives beside its job. It calls queryset methods only."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.db import router, transaction

from django_leases.conf import to_seconds
from django_leases.exceptions import LeaseLost

if TYPE_CHECKING:
    from django_leases.models import AbstractLeasedJob
    from django_leases.querysets import LeaseQuerySet


class Lease:
    """The claim of one job by one owner under one fencing token."""

    def __init__(self, job: AbstractLeasedJob, *, ttl: float | timedelta) -> None:
        self.job = job
        self.pk: int = job.pk
        self.owner: str = job.lease_owner
        self.token: int = job.lease_token
        self.attempt: int = job.attempts
        self.ttl = to_seconds(ttl, "ttl")
        self.finished = False
        # What the holder's last write made of the job: "completed", "retried", "failed" or
        # "released"; None while it holds the job.
        self.outcome: str | None = None
        self._lost = threading.Event()
        self._lost_reason = ""

    def __repr__(self) -> str:
        state = "lost" if self.lost else "finished" if self.finished else "held"
        return f"<Lease job={self.pk} owner={self.owner} token={self.token} {state}>"

    @property
    def lost(self) -> bool:
        """True once this holder knows it no longer owns the job."""
        return self._lost.is_set()

    def mark_lost(self, reason: str) -> None:
        self._lost_reason = reason
        self._lost.set()

    def check(self) -> None:
        """Raise `LeaseLost` if the lease is known to be lost."""
        if self.lost:
            raise LeaseLost(f"job {self.pk}: {self._lost_reason or 'lease lost'}")

    def _jobs(self) -> LeaseQuerySet[Any]:
        model = type(self.job)
        return model._default_manager.db_manager(router.db_for_write(model)).all()

    def heartbeat(self) -> None:
        """Renew the lease now for another TTL; raise `LeaseLost` if it was lost."""
        self.check()
        if self.pk not in self._jobs().heartbeat(self.owner, {self.pk: self.token}, ttl=self.ttl):
            self.mark_lost("heartbeat refused: the lease expired or was taken over")
            self.check()

    def checkpoint(self, step: str) -> None:
        """Record that the handler reached `step` (e.g. "psp_called") before a risky action."""
        self.check()
        self._guard(lambda: self._jobs().checkpoint(self.pk, self.owner, self.token, step))

    def complete(self, result: Any = None) -> None:
        """Complete the job now (storing `result`, if given); the worker then writes nothing."""
        self._guard(lambda: self._jobs().complete(self.pk, self.owner, self.token, result=result))
        self.finished, self.outcome = True, "completed"

    def fail(
        self, error: BaseException | str, *, retry_in: float | None = None, permanent: bool = False
    ) -> str:
        status = self._guard(
            lambda: self._jobs().fail(
                self.pk, self.owner, self.token, error, retry_in=retry_in, permanent=permanent
            )
        )
        self.finished, self.outcome = True, ("failed" if status == "failed" else "retried")
        return str(status)

    def release(self) -> None:
        self._guard(lambda: self._jobs().release(self.pk, self.owner, self.token))
        self.finished, self.outcome = True, "released"

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
        self.finished, self.outcome = True, "completed"

    def _guard(self, write: Any) -> Any:
        try:
            return write()
        except LeaseLost as exc:
            self.mark_lost(str(exc))
            raise
