"""The queue's history table: per job table, kind and minute, what the watcher recorded
(`querysets/history.py` reads and writes it). `django_leases.models` exports it."""

from django.db import models
from django.utils.translation import gettext_lazy as _

from django_leases.querysets import QueueMinuteQuerySet


class QueueMinute(models.Model):
    """One kind's minute (kind "": every kind's), written once by the first watcher to close
    it; never updated."""

    job_model = models.CharField(_("job table"), max_length=100)
    kind = models.CharField(_("kind"), max_length=100, blank=True)
    minute = models.DateTimeField(_("minute"))
    completed = models.PositiveIntegerField(_("jobs completed"), default=0)
    failed = models.PositiveIntegerField(_("jobs failed"), default=0)
    retried = models.PositiveIntegerField(_("attempts retried"), default=0)
    depth = models.PositiveIntegerField(
        _("due pending jobs"),
        null=True,
        blank=True,
        help_text=_("The backlog as the minute was recorded; unknown for a minute filled in late."),
    )
    wait_p50 = models.FloatField(_("wait p50 (s)"), null=True, blank=True)
    wait_p95 = models.FloatField(_("wait p95 (s)"), null=True, blank=True)
    run_p50 = models.FloatField(_("run time p50 (s)"), null=True, blank=True)
    run_p95 = models.FloatField(_("run time p95 (s)"), null=True, blank=True)
    wait_counts = models.JSONField(
        _("wait buckets"), default=list, help_text=_("Jobs per wait bucket: due to start.")
    )
    run_counts = models.JSONField(
        _("run time buckets"), default=list, help_text=_("Jobs per run time bucket.")
    )

    objects = QueueMinuteQuerySet.as_manager()

    class Meta:
        verbose_name = _("queue minute")
        verbose_name_plural = _("queue history")
        constraints = [
            # One row per minute and kind: the racing watchers' arbiter, and the charts' range.
            models.UniqueConstraint(
                fields=["job_model", "kind", "minute"], name="dl_minute_kind_uniq"
            ),
        ]
        indexes = [
            # The overview's last hour of every kind, and the prune.
            models.Index(fields=["job_model", "minute"], name="dl_minute_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.kind or 'every kind'} at {self.minute:%Y-%m-%d %H:%M}"
