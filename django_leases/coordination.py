"""The tables a queue's processes coordinate through: the worker registry (who runs, how often
it reports in, a watcher's last pass), each schedule's state (its definition and last enqueued
tick), the throttled kinds' gates and starts, and the paused kinds with their audit.
`django_leases.models` exports them."""

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from django_leases.querysets.pauses import KindAction, PausedKindQuerySet
from django_leases.querysets.schedules import CRON_LENGTH, TZ_LENGTH, ScheduleStateQuerySet
from django_leases.querysets.throttles import KindGateQuerySet
from django_leases.querysets.workers import Role, WorkerQuerySet


class Worker(models.Model):
    """A worker or watcher process, upserted by itself while it runs: who is alive, since
    when, how often it reports in and (a watcher) what its last pass did."""

    worker_id = models.CharField(_("worker id"), max_length=255, unique=True)
    instance = models.CharField(
        _("process instance"),
        max_length=32,
        blank=True,
        default="",
        help_text=_("Random per process: which process holds this worker id now."),
    )
    hostname = models.CharField(_("host"), max_length=255)
    pid = models.PositiveIntegerField(_("process id"))
    kinds = models.JSONField(_("kinds"), default=list)
    concurrency = models.PositiveIntegerField(_("concurrency"), default=1)
    role = models.CharField(
        _("role"), max_length=16, choices=Role.choices, default=Role.WORKER, db_default=Role.WORKER
    )
    # A worker's heartbeat interval, a running watcher's pass interval (see LATE_AFTER).
    heartbeat = models.FloatField(_("reports every (seconds)"), null=True, blank=True)
    started_at = models.DateTimeField(_("started at"), db_default=Now())
    last_seen_at = models.DateTimeField(_("last seen at"), db_default=Now())
    stopped_at = models.DateTimeField(_("stopped at"), null=True, blank=True)
    last_pass_at = models.DateTimeField(_("last pass at"), null=True, blank=True)
    last_pass = models.JSONField(_("last pass"), null=True, blank=True)  # per action, or error

    objects = WorkerQuerySet.as_manager()

    class Meta:
        verbose_name = _("worker")
        verbose_name_plural = _("workers")
        ordering = ["-last_seen_at"]

    def __str__(self) -> str:
        return self.worker_id


class ScheduleState(models.Model):
    """The last tick a schedule enqueued into a job table: what decides that a tick is due.

    Moved by one conditional UPDATE in the transaction that enqueues the tick's job (see
    `ScheduleStateQuerySet.advance()`), so each tick gets exactly one job whatever `prune_jobs`
    deleted since. One row per job table and schedule name, holding the series its ticks belong
    to (`every`, or `cron` and `tz`): a schedule whose definition differs from its row's (new,
    edited or rolled back) starts a new series at its next tick, the row moved to the current
    tick without a job. A cron schedule's row has `every` 0 and its ticks are fire times.
    """

    job_model = models.CharField(
        _("job model"), max_length=255, help_text=_("The table the ticks' jobs go to.")
    )
    name = models.CharField(_("schedule"), max_length=100)
    every = models.FloatField(_("every (seconds)"), help_text=_("0 for a cron schedule."))
    cron = models.CharField(
        _("cron expression"), max_length=CRON_LENGTH, blank=True, default="", db_default=""
    )
    tz = models.CharField(
        _("time zone"), max_length=TZ_LENGTH, blank=True, default="", db_default=""
    )
    last_tick = models.BigIntegerField(
        _("last enqueued tick"),
        help_text=_(
            "Tick n is the span from n × every to (n + 1) × every of Unix time (UTC); a cron "
            "schedule's tick is its fire time in Unix seconds."
        ),
    )
    start_tick = models.BigIntegerField(
        _("series started at tick"),
        null=True,
        blank=True,
        help_text=_(
            "The tick current when the series started (the schedule was added or its every, "
            "cron or tz edited): covered without a job."
        ),
    )
    enqueued_at = models.DateTimeField(_("last enqueued at"), db_default=Now())

    objects = ScheduleStateQuerySet.as_manager()

    class Meta:
        verbose_name = _("schedule state")
        verbose_name_plural = _("schedule states")
        ordering = ["job_model", "name"]
        # The admin's "Run now": enqueue a schedule's job at once, outside its ticks.
        permissions = [("run_schedule", "Can run a schedule now")]
        constraints = [
            # One row per schedule: of racing first runs, one INSERT wins; an edit moves the row.
            models.UniqueConstraint(fields=["job_model", "name"], name="dl_schedule_name_uniq")
        ]

    def __str__(self) -> str:
        if self.cron:
            return f"{self.name} {self.cron} ({self.tz}): fire time {self.last_tick}"
        return f"{self.name} every {self.every:g}s: tick {self.last_tick}"


class KindGate(models.Model):
    """One row per job table and kind with a `limit=` or `rate=`: every claim of that kind
    writes it first, which serialises them (see `querysets/throttles.py`)."""

    job_model = models.CharField(
        _("job model"), max_length=255, help_text=_("The table whose jobs of the kind it gates.")
    )
    kind = models.CharField(_("kind"), max_length=100)
    last_claim_at = models.DateTimeField(_("last claim at"), null=True, blank=True)

    objects = KindGateQuerySet.as_manager()

    class Meta:
        verbose_name = _("kind gate")
        verbose_name_plural = _("kind gates")
        ordering = ["job_model", "kind"]
        constraints = [
            # One row per job table and kind: of racing first claims, one INSERT wins.
            models.UniqueConstraint(fields=["job_model", "kind"], name="dl_gate_kind_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.kind} on {self.job_model}"


class KindStart(models.Model):
    """`count` jobs of a rate-limited kind claimed at `at` (the database clock, after the
    claim): the sliding window its next claims count. Rows older than the window are deleted
    by the kind's next claim."""

    gate = models.ForeignKey(
        KindGate, verbose_name=_("gate"), on_delete=models.CASCADE, related_name="starts"
    )
    at = models.DateTimeField(_("at"))
    count = models.PositiveIntegerField(_("jobs started"))

    class Meta:
        verbose_name = _("kind start")
        verbose_name_plural = _("kind starts")
        indexes = [models.Index(fields=["gate", "at"], name="dl_start_gate_at_idx")]

    def __str__(self) -> str:
        return f"{self.count} started at {self.at}"


class PausedKind(models.Model):
    """A kind paused on a job table: while its row exists no worker starts a job of it (claims
    leave it out, and a worker checks it as it starts each job); running jobs finish,
    enqueueing and schedules go on. Written by `LeaseQuerySet.pause_kind()`, deleted by
    `resume_kind()`."""

    job_model = models.CharField(
        _("job model"), max_length=255, help_text=_("The table whose jobs of the kind wait.")
    )
    kind = models.CharField(_("kind"), max_length=100)
    paused_at = models.DateTimeField(_("paused at"), db_default=Now())
    paused_by = models.CharField(_("paused by"), max_length=255)
    reason = models.TextField(_("reason"), blank=True, default="")

    objects = PausedKindQuerySet.as_manager()

    class Meta:
        verbose_name = _("paused kind")
        verbose_name_plural = _("paused kinds")
        ordering = ["job_model", "kind"]
        permissions = [("pause_kind", _("Can pause and resume a kind"))]
        constraints = [
            # One row per job table and kind: of racing pauses, one INSERT wins.
            models.UniqueConstraint(fields=["job_model", "kind"], name="dl_paused_kind_uniq")
        ]

    def __str__(self) -> str:
        return f"{self.kind} on {self.job_model}, paused by {self.paused_by}"


class KindEvent(models.Model):
    """One row per pause or resume of a kind: who, when, why. Append-only, like `JobEvent`."""

    job_model = models.CharField(_("job model"), max_length=255)
    kind = models.CharField(_("kind"), max_length=100)
    action = models.CharField(_("action"), max_length=20, choices=KindAction.choices)
    by = models.CharField(_("by"), max_length=255)
    at = models.DateTimeField(_("at"), db_default=Now())
    reason = models.TextField(_("reason"), blank=True, default="")

    class Meta:
        verbose_name = _("kind event")
        verbose_name_plural = _("kind events")
        ordering = ["-id"]
        indexes = [models.Index(fields=["kind", "at"], name="dl_kind_event_idx")]

    def __str__(self) -> str:
        return f"{self.kind}: {self.action} by {self.by}"
