"""The steps a handler recorded with `lease.step()` (`AbstractJobStep`, and `JobStep`, the
stock job table's): append-only rows, one per job and step name. `django_leases.models` exports
them."""

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from django_leases.limits import STEP_NAME_LENGTH


class AbstractJobStep(models.Model):
    """One row per step a handler recorded with `lease.step()`: append-only, never updated.

    A concrete step record adds a nullable foreign key named `job` to its job table.
    """

    # The job's id, kept when the job itself is pruned and `job` becomes NULL.
    job_ref = models.BigIntegerField(_("job id"))
    name = models.CharField(_("step"), max_length=STEP_NAME_LENGTH)
    result = models.JSONField(_("result"), null=True, blank=True)
    token = models.PositiveBigIntegerField(
        _("fencing token"), help_text=_("The token of the lease the step was recorded under.")
    )
    attempt = models.PositiveIntegerField(_("attempt"))
    recorded_at = models.DateTimeField(_("recorded at"), db_default=Now())

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"job {self.job_ref} step {self.name!r} (attempt {self.attempt})"


def step_constraints(prefix: str) -> list[models.BaseConstraint]:
    # A step is recorded once per job: a later attempt finds it and does not run it again.
    return [models.UniqueConstraint(fields=["job_ref", "name"], name=f"{prefix}_job_name_uniq")]


class JobStep(AbstractJobStep):
    # SET_NULL, like the ledger: prune_jobs with PRUNE_LEDGER = False keeps the steps.
    job = models.ForeignKey(
        "django_leases.PaymentJob",
        verbose_name=_("job"),
        null=True,
        on_delete=models.SET_NULL,
        related_name="step_log",
    )

    class Meta:
        verbose_name = _("job step")
        verbose_name_plural = _("job steps")
        ordering = ["job_ref", "id"]
        constraints = step_constraints("dl_step")
