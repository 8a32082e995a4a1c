"""Operator actions: requeue, release, fail, cancel and review verdicts on a selection of jobs.

The admin's actions and any operator script call these, never their own UPDATEs. Each action is
conditional per row: it changes only the rows still eligible when its UPDATE runs, and returns
how many it changed.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Greatest, Now

from django_leases.querysets.base import retry_deadlocks
from django_leases.querysets.ledger import MAX_ERROR_LENGTH, J
from django_leases.querysets.prune import Pruning
from django_leases.status import (
    CANCELLED,
    COMPLETED,
    FAILED,
    PENDING,
    PROCESSING,
    REVIEW,
    AttemptOutcome,
    Verdict,
)


class OperatorActions(Pruning[J]):
    """The operator actions of a job table; `LeaseQuerySet` builds on them (and on pruning
    and the ledger writes, the classes below it) to keep each concern in its own module."""

    def requeue(self, *, force: bool = False, by: str = "operator") -> int:
        """Make the selected jobs pending and due now; return how many changed.

        Failed, cancelled, under-review and expired jobs are requeued; a processing job with a
        live lease only with `force`, which also bumps its fencing token so that the current
        holder is fenced out of every further write. Completed jobs are never requeued.
        """
        eligible = Q(status__in=[FAILED, CANCELLED, REVIEW, PENDING]) | Q(
            status=PROCESSING, lease_until__lt=Now()
        )
        if force:
            eligible |= Q(status=PROCESSING)
        values = {
            "status": PENDING,
            "run_at": Now(),
            "completed_at": None,
            # A requeued job gets at least one more attempt, whatever it used up.
            "max_attempts": Greatest(F("max_attempts"), F("attempts") + 1),
            "lease_token": F("lease_token") + 1,
        }
        return self._operator_write(eligible, values, AttemptOutcome.REQUEUED, by)

    def release_stuck(self, *, by: str = "operator") -> int:
        """Return the selected jobs whose lease expired to pending (the watcher's retry).

        A job that used its last attempt gets one more, or it would sit pending unclaimable.
        """
        return self._operator_write(
            Q(status=PROCESSING, lease_until__lt=Now()),
            {
                "status": PENDING,
                "run_at": Now(),
                "max_attempts": Greatest(F("max_attempts"), F("attempts") + 1),
            },
            AttemptOutcome.RESCUED,
            by,
        )

    def mark_failed(self, *, reason: str, force: bool = False, by: str = "operator") -> int:
        """Fail the selected pending, under-review or expired jobs (any processing one with
        `force`, fencing out its holder); return how many changed."""
        eligible = Q(status__in=[PENDING, REVIEW]) | Q(status=PROCESSING, lease_until__lt=Now())
        if force:
            eligible |= Q(status=PROCESSING)
        values = {
            "status": FAILED,
            "completed_at": Now(),
            "last_error": reason[:MAX_ERROR_LENGTH],
            "lease_token": F("lease_token") + 1,
        }
        return self._operator_write(eligible, values, AttemptOutcome.FAILED, by, reason)

    def cancel(self, *, by: str = "operator") -> int:
        """Cancel the selected pending jobs; return how many changed."""
        values = {"status": CANCELLED, "completed_at": Now(), "last_error": f"cancelled by {by}"}
        return self._operator_write(Q(status=PENDING), values, None, by)

    def resolve_review(self, verdict: str, *, by: str = "operator") -> int:
        """Resolve the selected jobs under review: "completed", "retry" or "failed".

        The verdict and who gave it are recorded on the ledger row that put the job under review.
        """
        values: dict[str, Any]
        if verdict == Verdict.RETRY:
            values = {
                "status": PENDING,
                "run_at": Now(),
                "max_attempts": Greatest(F("max_attempts"), F("attempts") + 1),
            }
        elif verdict in (COMPLETED, FAILED):
            values = {"status": verdict, "completed_at": Now()}
        else:
            raise ValueError(f"unknown review verdict {verdict!r}")
        return self._operator_write(Q(status=REVIEW), values, None, by, resolution=verdict)

    @retry_deadlocks
    def _operator_write(
        self,
        eligible: Q,
        values: dict[str, Any],
        outcome: str | None,
        by: str,
        reason: str = "",
        *,
        resolution: str = "",
    ) -> int:
        # One transaction per action: the jobs' transition and the closing of their open
        # ledger rows commit together. Each row is updated by its own conditional UPDATE so the
        # ledger is closed exactly for the rows whose UPDATE won.
        changed = 0
        with transaction.atomic(using=self.db):
            candidates = list(self.filter(eligible).values_list("pk", "lease_token"))
            for pk, token in candidates:
                if self.filter(eligible, pk=pk, lease_token=token).update(**values):
                    changed += 1
                    if outcome is not None:
                        self._close_attempt(
                            pk, token, outcome, by=by, error=("", reason) if reason else None
                        )
                    if resolution:
                        self._ledger_update(
                            {pk: token}, resolution=resolution, resolved_by=by, resolved_at=Now()
                        )
        return changed
