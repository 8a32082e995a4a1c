from django.db import models
from django.db.models.functions import Now


class Charge(models.Model):
    """A business write made by a handler inside `lease.atomic()`."""

    job_ref = models.BigIntegerField()
    token = models.PositiveBigIntegerField()
    owner = models.CharField(max_length=255)

    def __str__(self) -> str:
        return f"charge for job {self.job_ref} by {self.owner}"


class LockRun(models.Model):
    """One execution of a locked job's handler, with its start and finish by the database clock."""

    job_ref = models.BigIntegerField()
    lock = models.CharField(max_length=255)
    token = models.PositiveBigIntegerField()
    started_at = models.DateTimeField(db_default=Now())
    finished_at = models.DateTimeField(null=True)

    def __str__(self) -> str:
        return f"run of job {self.job_ref} (lock {self.lock})"
