"""Leased jobs: the abstract base, `PaymentJob`, the attempt ledger and the operator events; the
tables the queue's processes coordinate through (`coordination`) are exported from here too."""

from typing import Any, ClassVar

from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from django_leases.constraints import UniqueWhenSet
from django_leases.coordination import (
    KindEvent,
    KindGate,
    KindStart,
    PausedKind,
    ScheduleState,
    Worker,
)
from django_leases.history import QueueMinute
from django_leases.job_steps import AbstractJobStep, JobStep, step_constraints
from django_leases.querysets.leases import LeaseQuerySet
from django_leases.querysets.ledger import AttemptQuerySet
from django_leases.querysets.payments import PaymentJobQuerySet
from django_leases.status import (
    LOCK_HOLDING_STATUSES,
    AttemptOutcome,
    EventAction,
    JobStatus,
)

__all__ = [
    "AbstractJobAttempt",
    "AbstractLeasedJob",
    "AbstractJobEvent",
    "AbstractJobStep",
    "AttemptOutcome",
    "EventAction",
    "GUARDED_ACTIONS",
    "job_permissions",
    "attempt_constraints",
    "attempt_indexes",
    "JobAttempt",
    "JobEvent",
    "JobStatus",
    "JobStep",
    "KindEvent",
    "KindGate",
    "KindStart",
    "lease_constraints",
    "lease_indexes",
    "PaymentJob",
    "step_constraints",
    "PausedKind",
    "QueueMinute",
    "ScheduleState",
    "Worker",
]


class AbstractLeasedJob(models.Model):
    """The lease fields and `LeaseQuerySet`, for any project's own job table."""

    Status = JobStatus

    kind = models.CharField(_("kind"), max_length=100)
    payload = models.JSONField(_("payload"), default=dict, blank=True)
    status = models.CharField(
        _("status"), max_length=20, choices=JobStatus.choices, default=JobStatus.PENDING
    )
    priority = models.SmallIntegerField(_("priority"), default=0, help_text=_("Higher runs first."))
    run_at = models.DateTimeField(_("run at"), db_default=Now())
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    max_attempts = models.PositiveIntegerField(_("max attempts"), default=5)
    lease_owner = models.CharField(_("lease owner"), max_length=255, blank=True, default="")
    lease_until = models.DateTimeField(_("lease until"), null=True, blank=True)
    lease_token = models.PositiveBigIntegerField(
        _("fencing token"),
        default=0,
        help_text=_("Grows with every acquisition; a holder's writes must present it."),
    )
    heartbeat_at = models.DateTimeField(_("last heartbeat at"), null=True, blank=True)
    checkpoint = models.CharField(_("checkpoint"), max_length=100, blank=True, default="")
    last_error = models.TextField(_("last error"), blank=True, default="")
    result = models.JSONField(
        _("result"), null=True, blank=True, help_text=_("What the handler returned, if it asked.")
    )
    lock = models.CharField(
        _("lock"),
        max_length=255,
        blank=True,
        default="",
        help_text=_("Jobs sharing a lock run one at a time, in enqueue order."),
    )
    # Equal to `lock` while this job holds it (LOCK_HOLDING_STATUSES), NULL otherwise: unique
    # (`lease_constraints()`: `UniqueWhenSet`), so one job per lock holds it, on every database
    # (MariaDB/MySQL ignore partial-index conditions, so the lock cannot be a partial unique
    # index on `lock` there). The system check django_leases.E039 sees that it is.
    lock_holder = models.CharField(  # noqa: DJ001 - NULL: no lock held; unique where set
        _("holds lock"),
        max_length=255,
        null=True,
        blank=True,
        editable=False,
        help_text=_("The lock this job holds: next in line, running or under review."),
    )
    ends_as = models.CharField(
        _("ends as"),
        max_length=20,
        blank=True,
        default="",
        choices=JobStatus.choices,
        editable=False,
        help_text=_("While stopping: the status the job takes when its execution ends."),
    )
    # Dependencies (`enqueue(after=...)`, querysets/dependencies.py). NULL, not `[]`: no
    # default called per INSERT, and the completions' fast paths test `dependents IS NULL`.
    waits_for = models.JSONField(
        _("waits for"),
        null=True,
        blank=True,
        editable=False,
        help_text=_("The jobs this job was enqueued after (their ids)."),
    )
    unmet = models.PositiveIntegerField(
        _("prerequisites not completed"),
        default=0,
        editable=False,
        help_text=_("While waiting: how many of the jobs it waits for have not completed."),
    )
    dependents = models.JSONField(
        _("waited on by"),
        null=True,
        blank=True,
        editable=False,
        help_text=_("The jobs enqueued after this one (their ids): released when it completes."),
    )
    # Groups (`enqueue_group()`, querysets/groups.py): set on a group's callback only, `{}` at
    # its enqueue; each member's end is written in by the transaction that ended it.
    group_results = models.JSONField(
        _("group results"),
        null=True,
        blank=True,
        editable=False,
        help_text=_(
            "A group's callback: how each member ended (id: kind, status, last error), "
            "filled as they end."
        ),
    )
    # The W3C trace context of the code that enqueued the job (`tracing.py`): the worker's
    # spans of its attempts continue that trace. NULL when tracing is off or no span was
    # current: no default called per INSERT.
    trace_context = models.JSONField(
        _("trace context"),
        null=True,
        blank=True,
        editable=False,
        help_text=_("The enqueuer's W3C trace context (traceparent, tracestate)."),
    )
    created_at = models.DateTimeField(_("created at"), db_default=Now())
    completed_at = models.DateTimeField(
        _("completed at"),
        null=True,
        blank=True,
        help_text=_("When the job reached its final status."),
    )

    objects = LeaseQuerySet.as_manager()

    # The concrete ledger model (an `AbstractJobAttempt` subclass with a nullable foreign key
    # `job` to this model) as "app_label.ModelName", or None for a job table without a ledger.
    # Checked by django_leases.E031.
    attempt_model: ClassVar[str | None] = None
    # The concrete operator event log (an `AbstractJobEvent` subclass), or None for none.
    event_model: ClassVar[str | None] = None
    # The concrete step record (an `AbstractJobStep` subclass) `lease.step()` writes, or None.
    step_model: ClassVar[str | None] = None
    # The columns of the lease, which `enqueue(**fields)` never sets: set below, from `_meta`.
    lease_fields: ClassVar[frozenset[str]]

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk} ({self.status})"


AbstractLeasedJob.lease_fields = frozenset(f.name for f in AbstractLeasedJob._meta.local_fields)


def lease_indexes(prefix: str) -> list[models.Index]:
    """Return the indexes that keep claims cheap however many finished rows pile up.

    PostgreSQL and SQLite honour `condition`, so each index holds only the live rows it serves.
    MariaDB/MySQL ignore `condition` and build the full index; `status` leads each index so that
    the claim still reads one contiguous range of it there.
    """
    return [
        # claim(): due pending jobs in claim order.
        # Plain fields, not expressions: MariaDB/MySQL skip expression indexes altogether.
        models.Index(
            fields=["status", "-priority", "run_at", "id"],
            name=f"{prefix}_due_idx",
            condition=Q(status=JobStatus.PENDING),
        ),
        # claim() of given kinds: the due jobs of one kind in claim order, so that other kinds'
        # backlog is not walked past (the index above serves claims of every kind). `kind`
        # leads: PostgreSQL leaves `status = 'pending'` out of the index condition (the index
        # predicate implies it), so with `status` first a scan for one kind would start at
        # the index's first entry. MariaDB/MySQL still find (kind, status) as one range.
        models.Index(
            fields=["kind", "status", "-priority", "run_at", "id"],
            name=f"{prefix}_kind_due_idx",
            condition=Q(status=JobStatus.PENDING),
        ),
        # claim() takeovers, expired(), near_expiry() and the watcher. Processing jobs only:
        # SQLite uses a partial index only for a query that restates its condition, and a
        # claim says `status = 'processing'` (stopping jobs are few; the status index finds them).
        models.Index(
            fields=["status", "lease_until"],
            name=f"{prefix}_lease_idx",
            condition=Q(status=JobStatus.PROCESSING),
        ),
        # claim() takeovers of given kinds, led by `kind` as the index above, and the live
        # leases a `limit=` counts.
        models.Index(
            fields=["kind", "status", "lease_until"],
            name=f"{prefix}_kind_lease_idx",
            condition=Q(status=JobStatus.PROCESSING),
        ),
        # Passing a lock on: the first waiting job of a lock.
        models.Index(
            fields=["status", "lock", "id"],
            name=f"{prefix}_waiting_idx",
            condition=Q(status=JobStatus.WAITING),
        ),
    ]


def lease_constraints(prefix: str) -> list[models.BaseConstraint]:
    """Return the constraints of the lease fields, named after `prefix`."""
    return [
        # A processing job always has an owner and a lease end.
        models.CheckConstraint(
            condition=~Q(status=JobStatus.PROCESSING)
            | (Q(lease_until__isnull=False) & ~Q(lease_owner="")),
            name=f"{prefix}_processing_has_lease",
        ),
        models.CheckConstraint(
            condition=Q(status__in=JobStatus.values), name=f"{prefix}_status_valid"
        ),
        models.CheckConstraint(condition=Q(max_attempts__gte=1), name=f"{prefix}_max_attempts_min"),
        # One job per lock holds it: see `lock_holder`.
        UniqueWhenSet(fields=["lock_holder"], name=f"{prefix}_lock_holder_uniq"),
        # With `lock_holder` unique, these two make "one job per lock pending, processing or
        # under review" a property of the table, whatever a worker does: a job of a lock in
        # those statuses holds it, and a job holds nothing else.
        models.CheckConstraint(
            condition=Q(lock="")
            | ~Q(status__in=LOCK_HOLDING_STATUSES)
            | Q(lock_holder__isnull=False, lock_holder=F("lock")),
            name=f"{prefix}_lock_held_while_active",
        ),
        models.CheckConstraint(
            condition=Q(lock_holder__isnull=True)
            | (Q(lock_holder=F("lock")) & ~Q(lock="") & Q(status__in=LOCK_HOLDING_STATUSES)),
            name=f"{prefix}_lock_holder_is_lock",
        ),
        # A job waits for its lock, or for the jobs it was enqueued after.
        models.CheckConstraint(
            condition=~Q(status=JobStatus.WAITING) | ~Q(lock="") | Q(unmet__gt=0),
            name=f"{prefix}_waiting_has_lock",
        ),
    ]


# The operator actions that each need a permission of their own, beside "change": they take a
# live lease, move money's outcome by hand, or change what a handler will be given.
GUARDED_ACTIONS = {
    "force_requeue": _("Can force requeue (fences out a live lease)"),
    "force_cancel": _("Can force cancel (running jobs too)"),
    "resolve_review_completed": _("Can resolve a review as completed"),
    "resolve_review_failed": _("Can resolve a review as failed"),
    "edit_payload": _("Can edit the payload of a pending job"),
}


def job_permissions(model_name: str) -> list[tuple[str, Any]]:
    """Return the `Meta.permissions` of a job table's guarded actions, named as Django names its
    own (`force_requeue_paymentjob`): give them to a project's own table with its model name."""
    return [(f"{action}_{model_name}", text) for action, text in GUARDED_ACTIONS.items()]


class PaymentJob(AbstractLeasedJob):
    """A payment job: capture, refund, webhook delivery, reconciliation."""

    payment_id = models.CharField(_("payment id"), max_length=64, blank=True, default="")
    # NULL: no key. Unique where set, by `UniqueWhenSet` in Meta (enqueue() needs it unique).
    idempotency_key = models.CharField(  # noqa: DJ001
        _("idempotency key"), max_length=255, null=True, blank=True
    )

    # A subclass's manager narrows the base's; django-stubs reads it as a ClassVar override.
    objects = PaymentJobQuerySet.as_manager()  # type: ignore[misc]

    attempt_model: ClassVar[str | None] = "django_leases.JobAttempt"
    event_model: ClassVar[str | None] = "django_leases.JobEvent"
    step_model: ClassVar[str | None] = "django_leases.JobStep"

    class Meta:
        verbose_name = _("payment job")
        verbose_name_plural = _("payment jobs")
        indexes = [
            *lease_indexes("dl_job"),
            models.Index(fields=["payment_id"], name="dl_job_payment_idx"),
            # prune_jobs and the admin's "finished in the last hour".
            models.Index(fields=["status", "completed_at"], name="dl_job_finished_idx"),
        ]
        constraints = [
            *lease_constraints("dl_job"),
            UniqueWhenSet(fields=["idempotency_key"], name="dl_job_idempotency_key_uniq"),
        ]
        permissions = job_permissions("paymentjob")

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk} ({self.status})"


class AbstractJobAttempt(models.Model):
    """One row per lease acquisition: the append-only attempt ledger an auditor asks for.

    A concrete ledger adds a nullable foreign key named `job` to its job table.
    """

    Outcome = AttemptOutcome

    # The job's id, kept when the job itself is pruned and `job` becomes NULL.
    job_ref = models.BigIntegerField(_("job id"))
    attempt = models.PositiveIntegerField(_("attempt"))
    token = models.PositiveBigIntegerField(_("fencing token"))
    owner = models.CharField(_("owner"), max_length=255)
    claimed_at = models.DateTimeField(_("claimed at"), db_default=Now())
    last_heartbeat_at = models.DateTimeField(_("last heartbeat at"), null=True, blank=True)
    lease_until = models.DateTimeField(_("lease until at the end"), null=True, blank=True)
    checkpoint = models.CharField(_("last checkpoint"), max_length=100, blank=True, default="")
    ended_at = models.DateTimeField(_("ended at"), null=True, blank=True)
    outcome = models.CharField(
        _("outcome"), max_length=20, choices=AttemptOutcome.choices, default=AttemptOutcome.RUNNING
    )
    ended_by = models.CharField(
        _("ended by"),
        max_length=255,
        blank=True,
        default="",
        help_text=_(
            "Who closed the attempt: its holder, a worker that took over, the watcher, an operator."
        ),
    )
    fenced_at = models.DateTimeField(
        _("fenced out at"),
        null=True,
        blank=True,
        help_text=_("When the holder came back after losing the lease and was refused."),
    )
    error_class = models.CharField(_("error class"), max_length=255, blank=True, default="")
    error_message = models.TextField(_("error message"), blank=True, default="")
    resolution = models.CharField(
        _("review resolution"),
        max_length=20,
        blank=True,
        default="",
        help_text=_("For an attempt held for review: the verdict that resolved it."),
    )
    resolved_by = models.CharField(_("resolved by"), max_length=255, blank=True, default="")
    resolved_at = models.DateTimeField(_("resolved at"), null=True, blank=True)

    objects = AttemptQuerySet.as_manager()

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"attempt {self.attempt} (token {self.token}) by {self.owner}: {self.outcome}"


def attempt_indexes(prefix: str) -> list[models.Index]:
    """Return the ledger's indexes beside its constraints' own: `claimed_at`, the range the
    queue history reads a minute's retried attempts from.

    The claim, the holder's writes and prune_jobs find a job's rows, its open one included, by
    the `(job_ref, token)` index of `attempt_constraints()`. No index holds a column that
    closing an attempt writes (`ended_at`, `outcome`, ...), so on PostgreSQL the close is a HOT
    update, which enters no index: `claimed_at` is written by the INSERT alone.
    """
    return [models.Index(fields=["claimed_at"], name=f"{prefix}_claimed_idx")]


def attempt_constraints(prefix: str) -> list[models.BaseConstraint]:
    # One row per acquisition: a fencing token is never handed out twice for a job.
    return [models.UniqueConstraint(fields=["job_ref", "token"], name=f"{prefix}_job_token_uniq")]


class JobAttempt(AbstractJobAttempt):
    # SET_NULL keeps the audit trail when prune_jobs deletes jobs with PRUNE_LEDGER = False;
    # `job_ref` still names the job then.
    job = models.ForeignKey(
        PaymentJob,
        verbose_name=_("job"),
        null=True,
        on_delete=models.SET_NULL,
        related_name="attempt_log",
    )

    class Meta:
        verbose_name = _("job attempt")
        verbose_name_plural = _("job attempts")
        ordering = ["-claimed_at", "-id"]
        constraints = attempt_constraints("dl_attempt")
        indexes = attempt_indexes("dl_attempt")

    def __str__(self) -> str:
        return f"job {self.job_ref} attempt {self.attempt}: {self.outcome}"


class AbstractJobEvent(models.Model):
    """One row per job an operator action (or a reconcile hook's verdict) changed: append-only,
    beside the attempt ledger, never over it.

    A concrete event log adds a nullable foreign key named `job` to its job table.
    """

    Action = EventAction

    # The job's id, kept when the job itself is pruned and `job` becomes NULL.
    job_ref = models.BigIntegerField(_("job id"))
    action = models.CharField(_("action"), max_length=20, choices=EventAction.choices)
    by = models.CharField(_("by"), max_length=255)
    at = models.DateTimeField(_("at"), db_default=Now())
    reason = models.TextField(_("reason"), blank=True, default="")
    attempts = models.PositiveIntegerField(
        _("after attempts"), help_text=_("The job's attempts when the action applied.")
    )
    token = models.PositiveBigIntegerField(
        _("fencing token"), help_text=_("The job's fencing token when the action applied.")
    )
    changes = models.JSONField(
        _("changes"),
        null=True,
        blank=True,
        help_text=_("What an edit changed: each field's old and new value."),
    )

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"job {self.job_ref}: {self.action} by {self.by}"


class JobEvent(AbstractJobEvent):
    # SET_NULL, like the ledger: prune_jobs with PRUNE_LEDGER = False keeps the events.
    job = models.ForeignKey(
        PaymentJob,
        verbose_name=_("job"),
        null=True,
        on_delete=models.SET_NULL,
        related_name="event_log",
    )

    class Meta:
        verbose_name = _("operator event")
        verbose_name_plural = _("operator events")
        ordering = ["-id"]
        indexes = [models.Index(fields=["job_ref", "at"], name="dl_event_job_idx")]
