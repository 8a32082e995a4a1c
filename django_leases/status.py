"""The words of the lease state machine: the only place they are spelled out.

Job statuses, ledger outcomes, the watcher's policies and the verdicts a reconcile hook or an
operator gives. Everything else imports these names; migrations keep their own frozen copies.
"""

from django.db import models
from django.utils.translation import gettext_lazy as _


class JobStatus(models.TextChoices):
    PENDING = "pending", _("Pending")
    """Enqueued, retried, released or requeued: claimable once `run_at` has passed."""
    PROCESSING = "processing", _("Processing")
    """Claimed: a worker holds the lease until `lease_until`."""
    COMPLETED = "completed", _("Completed")
    """The handler returned and its holder recorded the success."""
    FAILED = "failed", _("Failed")
    """A permanent error, or no attempts left."""
    REVIEW = "review", _("Under review")
    """The lease expired after a risky checkpoint: an operator or a reconcile hook decides."""
    CANCELLED = "cancelled", _("Cancelled")
    """Cancelled by an operator: pending, waiting or running (its holder is told to stop)."""
    WAITING = "waiting", _("Waiting for its lock")
    """Enqueued with a `lock` an earlier job still holds: pending once that job is finished; or
    enqueued `after=` jobs not all completed: pending (or in its lock's line) once they are."""
    STOPPING = "stopping", _("Stopping")
    """Cancelled or timed out while its handler may still run: keeps its lock and its `limit=`
    slot, unrenewable and unclaimable, until its holder acknowledges the stop or its lease
    expires; it then takes the status `ends_as` names."""


class AttemptOutcome(models.TextChoices):
    RUNNING = "running", _("Running")
    COMPLETED = "completed", _("Completed")
    FAILED = "failed", _("Failed")
    RETRIED = "retried", _("Failed, retry scheduled")
    LEASE_LOST = "lease_lost", _("Lease lost (taken over after expiry)")
    RESCUED = "rescued", _("Returned to pending after its lease expired")
    REVIEW = "review", _("Held for review by the watcher")
    RELEASED = "released", _("Released by its holder")
    REQUEUED = "requeued", _("Requeued by an operator")
    TIMED_OUT = "timed_out", _("Timed out (ran past its kind's timeout)")
    CANCELLED = "cancelled", _("Cancelled by an operator while running")


class EventAction(models.TextChoices):
    """What an operator action (or a review verdict) did to a job: the operator events."""

    REQUEUED = "requeued", _("Requeued")
    FORCE_REQUEUED = "force_requeued", _("Requeued by force (a live lease fenced out)")
    RELEASED = "released", _("Stuck lease released")
    FAILED = "failed", _("Marked failed")
    CANCELLED = "cancelled", _("Cancelled")
    FORCE_CANCELLED = "force_cancelled", _("Cancelled by force (running jobs too)")
    EDITED = "edited", _("Edited (priority or payload)")
    REVIEW_COMPLETED = "review_completed", _("Review resolved: completed")
    REVIEW_RETRY = "review_retry", _("Review resolved: retry")
    REVIEW_FAILED = "review_failed", _("Review resolved: failed")
    RUN_NOW = "run_now", _("Enqueued by running its schedule now")


class Verdict(models.TextChoices):
    """What becomes of an expired or reviewed job: a reconcile hook's or an operator's answer."""

    COMPLETED = "completed", _("Completed")
    RETRY = "retry", _("Retry")
    FAILED = "failed", _("Failed")


class StuckPolicy(models.TextChoices):
    """What the watcher does with an expired lease of a job that passed a checkpoint."""

    RETRY = "retry", _("Retry")
    REVIEW = "review", _("Review")


PENDING, PROCESSING, COMPLETED, FAILED, REVIEW, CANCELLED, WAITING, STOPPING = (
    JobStatus.PENDING.value,
    JobStatus.PROCESSING.value,
    JobStatus.COMPLETED.value,
    JobStatus.FAILED.value,
    JobStatus.REVIEW.value,
    JobStatus.CANCELLED.value,
    JobStatus.WAITING.value,
    JobStatus.STOPPING.value,
)
FINAL_STATUSES = (COMPLETED, FAILED, CANCELLED)
"""Statuses no transition leaves except an operator's requeue; the ones `prune_jobs` deletes."""
LOCK_HOLDING_STATUSES = (PENDING, PROCESSING, STOPPING, REVIEW)
"""Statuses in which a job with a `lock` holds it: the one job of its lock that may run next,
runs, is stopping, or waits for a verdict. The lock passes on when the job leaves them for a
final status."""
LEASED_STATUSES = (PROCESSING, STOPPING)
"""Statuses of a job whose execution may be running: until its lease expires, it counts
against its kind's `limit=`."""
TIMED_OUT = AttemptOutcome.TIMED_OUT.value
"""The outcome of an attempt still running past its kind's `timeout`."""
HISTORY_COUNTS = (COMPLETED, FAILED, AttemptOutcome.RETRIED.value)
"""What the queue history counts per kind and minute, its columns named so: jobs completed,
jobs failed, attempts retried."""
HOLDER_OUTCOMES = (
    AttemptOutcome.COMPLETED.value,
    AttemptOutcome.FAILED.value,
    AttemptOutcome.RETRIED.value,
    AttemptOutcome.RELEASED.value,
    AttemptOutcome.TIMED_OUT.value,
)
"""Ledger outcomes only a holder's own write gives its attempt."""
