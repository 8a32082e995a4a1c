"""Helpers of the lease-layer tests: a lease made stale by the database clock, a claim, the
ledger as tuples, the statements a block sent."""

from datetime import timedelta

from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets.base import FencingClock


def expire(job: PaymentJob, seconds: float = 5) -> None:
    """Make the job's lease end `seconds` ago, by the database clock."""
    PaymentJob.objects.filter(pk=job.pk).update(lease_until=Now() - timedelta(seconds=seconds))


def claim_one(owner: str = "w1", **kwargs: object) -> PaymentJob:
    (job,) = PaymentJob.objects.claim(owner, ttl=60, **kwargs)  # type: ignore[arg-type]
    return job


def statements(ctx: CaptureQueriesContext) -> list[str]:
    """The SQL statements captured, without transaction and savepoint bookkeeping."""
    bookkeeping = ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE SAVEPOINT", "ROLLBACK")
    return [q["sql"] for q in ctx.captured_queries if not q["sql"].startswith(bookkeeping)]


def ledger(job: PaymentJob) -> list[tuple[int, int, str, str]]:
    """The job's attempt ledger in token order: (attempt, n, owner, outcome), `n` the rank of
    the row's token among the job's (1 the lowest). Tokens are database-clock numbers; a test
    states their order (rank == attempt: tokens rise with attempts), not their values."""
    rows = (
        JobAttempt.objects.filter(job_ref=job.pk)
        .order_by("token")
        .values_list("attempt", "owner", "outcome")
    )
    return [(attempt, n, owner, outcome) for n, (attempt, owner, outcome) in enumerate(rows, 1)]


def token_of(job: PaymentJob, attempt: int = 1) -> int:
    """The fencing token the job's `attempt`-th acquisition was given, from the ledger."""
    return int(JobAttempt.objects.get(job_ref=job.pk, attempt=attempt).token)


def database_micros() -> int:
    """The database clock in microseconds since the epoch: the floor of a new fencing token."""
    return int(PaymentJob.objects.annotate(now=FencingClock()).values_list("now", flat=True)[0])
