from django.db import models


class Charge(models.Model):
    """A business write made by a handler inside `lease.atomic()`."""

    job_ref = models.BigIntegerField()
    token = models.PositiveBigIntegerField()
    owner = models.CharField(max_length=255)

    def __str__(self) -> str:
        return f"charge for job {self.job_ref} by {self.owner}"
