"""`prune_jobs` and `LeaseQuerySet.prune()`: only finished jobs past retention go, in batches."""

import re
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.models import Count
from django.db.models.functions import Now
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_leases.checks import check_worker_retention
from django_leases.models import JobAttempt, JobEvent, PaymentJob, Worker
from django_leases.querysets.prune import prune_batch

from .conftest import Processes, subprocess_env
from .rows import copy_row

pytestmark = pytest.mark.django_db

Status = PaymentJob.Status
DAY = 86400
# kind (naming the group) -> (status, rows, days since completed_at); the default RETENTION
# keeps completed jobs 7 days, failed and cancelled ones 30.
GROUPS = {
    "completed-old": (Status.COMPLETED, 2_500, 8),
    "completed-young": (Status.COMPLETED, 2_500, 6),
    "failed-old": (Status.FAILED, 1_000, 31),
    "failed-young": (Status.FAILED, 1_000, 29),
    "cancelled-old": (Status.CANCELLED, 1_000, 40),
    # Open jobs are never pruned, even with a (stray) completed_at from long ago.
    "pending": (Status.PENDING, 1_000, 400),
    "processing": (Status.PROCESSING, 500, 400),
    "review": (Status.REVIEW, 500, 400),
}
PRUNED = {"completed-old", "failed-old", "cancelled-old"}
JOB_TABLE = re.compile(r"^DELETE FROM [`\"]?django_leases_paymentjob[`\"]? WHERE")


def make_jobs(groups: dict[str, tuple[str, int, float]]) -> None:
    """Create each group's jobs, then age them with the database clock."""
    for kind, (status, rows, _days) in groups.items():
        # A live lease, far enough away not to matter (the check constraint wants one).
        lease = {"lease_owner": "w", "lease_until": timezone.now() + timedelta(hours=1)}
        job = PaymentJob.objects.create(
            kind=kind, status=status, **(lease if status == "processing" else {})
        )
        if rows > 1:
            copy_row(PaymentJob, job.pk, rows - 1)  # the same row again, in one statement
    for kind, (_status, _rows, days) in groups.items():
        PaymentJob.objects.filter(kind=kind).update(completed_at=Now() - timedelta(days=days))


def add_attempts(kind: str, rows: int) -> list[int]:
    """Give the first `rows` jobs of `kind` one ledger row each; return their ids."""
    ids = list(PaymentJob.objects.filter(kind=kind).order_by("pk").values_list("pk", flat=True))
    ids = ids[:rows]
    JobAttempt.objects.bulk_create(
        (
            JobAttempt(job_id=pk, job_ref=pk, attempt=1, token=1, owner="w", outcome="completed")
            for pk in ids
        ),
        batch_size=5000,
    )
    return ids


def in_list_sizes(sql: list[str]) -> list[int]:
    sizes = []
    for statement in sql:
        match = re.search(r"IN \(([\d, ]+)\)", statement)
        assert match, statement
        sizes.append(len(match.group(1).split(",")))
    return sizes


# Batches of 100 over 10,000 jobs: the shape of 1,000 over 100,000, at a tenth of the cost.
@override_settings(DJANGO_LEASES={"PRUNE_BATCH_SIZE": 100})
def test_prune_jobs__deletes_only_old_finished_jobs_in_bounded_batches() -> None:
    make_jobs(GROUPS)
    assert PaymentJob.objects.count() == 10_000
    doomed_ledger = add_attempts("completed-old", 500)
    kept_ledger = add_attempts("completed-young", 500)
    out = StringIO()

    with CaptureQueriesContext(connection) as queries:
        call_command("prune_jobs", stdout=out)

    deletes = [q["sql"] for q in queries.captured_queries if JOB_TABLE.match(q["sql"])]
    sizes = in_list_sizes(deletes)
    # 2 500 + 1 000 + 1 000 jobs in batches of PRUNE_BATCH_SIZE (100): 45 full DELETEs.
    assert (len(deletes), max(sizes), sum(sizes)) == (45, 100, 4_500)
    remaining = dict(PaymentJob.objects.values_list("kind").annotate(n=Count("pk")))
    assert remaining == {
        kind: rows for kind, (_s, rows, _d) in GROUPS.items() if kind not in PRUNED
    }
    assert not JobAttempt.objects.filter(job_ref__in=doomed_ledger).exists()
    assert JobAttempt.objects.filter(job_ref__in=kept_ledger, job__isnull=False).count() == 500
    assert "pruned 4500 job(s) in 45 batch(es)" in out.getvalue()
    assert "completed 2500 (older than 7 days), failed 1000 (older than 30 days)" in (
        out.getvalue()
    )
    assert "500 attempt ledger row(s) deleted" in out.getvalue()


@override_settings(DJANGO_LEASES={"PRUNE_LEDGER": False, "PRUNE_BATCH_SIZE": 7})
def test_prune_jobs__keeps_the_ledger_detached_when_prune_ledger_is_false() -> None:
    make_jobs({"completed-old": (Status.COMPLETED, 30, 8)})
    ids = add_attempts("completed-old", 30)
    out = StringIO()

    with CaptureQueriesContext(connection) as queries:
        call_command("prune_jobs", stdout=out)

    deletes = [q["sql"] for q in queries.captured_queries if JOB_TABLE.match(q["sql"])]
    assert in_list_sizes(deletes) == [7, 7, 7, 7, 2]
    assert not PaymentJob.objects.exists()
    kept = JobAttempt.objects.filter(job_ref__in=ids)
    assert kept.count() == 30 and not kept.filter(job__isnull=False).exists()
    assert "30 attempt ledger row(s) kept (detached)" in out.getvalue()


def test_prune_jobs__dry_run_counts_and_deletes_nothing() -> None:
    make_jobs({"completed-old": (Status.COMPLETED, 3, 8), "failed-young": (Status.FAILED, 2, 29)})
    out = StringIO()
    call_command("prune_jobs", "--dry-run", stdout=out)
    assert out.getvalue().startswith("would prune 3 job(s): completed 3 (older than 7 days)")
    assert PaymentJob.objects.count() == 5


@override_settings(DJANGO_LEASES={"RETENTION": {"completed": 7 * DAY, "cancelled": DAY}})
def test_prune_jobs__older_than_overrides_the_statuses_retention_lists() -> None:
    make_jobs(
        {
            "completed-recent": (Status.COMPLETED, 4, 2 / 24),
            "cancelled-recent": (Status.CANCELLED, 3, 2 / 24),
            # RETENTION leaves failed jobs out: they are never pruned, --older-than or not.
            "failed-ancient": (Status.FAILED, 2, 400),
            "completed-now": (Status.COMPLETED, 1, 0),
        }
    )
    out = StringIO()
    call_command("prune_jobs", "--older-than", "3600", "--batch-size", "2", stdout=out)
    assert dict(PaymentJob.objects.values_list("kind").annotate(n=Count("pk"))) == {
        "failed-ancient": 2,
        "completed-now": 1,
    }
    assert "pruned 7 job(s) in 4 batch(es)" in out.getvalue()
    assert "completed 4 (older than 1 hour), cancelled 3 (older than 1 hour)" in out.getvalue()


def test_prune__spares_a_job_requeued_after_its_batch_was_read() -> None:
    make_jobs({"failed-old": (Status.FAILED, 3, 31)})
    stale = PaymentJob.objects.prunable()
    ids = list(stale.values_list("pk", flat=True))
    revived = PaymentJob.objects.get(pk=ids[0])
    JobAttempt.objects.create(job=revived, job_ref=revived.pk, attempt=1, token=1, owner="w")
    # An operator requeues it between the batch's read and its DELETE.
    PaymentJob.objects.filter(pk=revived.pk).requeue()

    batch = prune_batch(PaymentJob.objects.all(), "failed", stale.filter(pk__in=ids), False)

    assert (batch.jobs, batch.attempts) == (2, 0)
    assert list(PaymentJob.objects.values_list("pk", flat=True)) == [revived.pk]
    assert JobAttempt.objects.filter(job=revived).count() == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"retention": {"pending": 60}}, "pending, processing and under-review jobs are never"),
        ({"retention": {"completed": 0}}, "retention of completed must be a positive number"),
        ({"batch_size": 0}, "batch_size must be a whole number of at least 1"),
    ],
)
def test_prune__refuses_bad_arguments(kwargs: dict, message: str) -> None:
    PaymentJob.objects.enqueue("noop")
    with pytest.raises(ValueError, match=message):
        PaymentJob.objects.prune(**kwargs)
    assert PaymentJob.objects.count() == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-size", "0"], "argument --batch-size: '0' must be from 1 to 10000"),
        (["--batch-size", "lots"], "argument --batch-size: 'lots' is not a whole number"),
        (
            ["--older-than=-5"],
            "argument --older-than: '-5' must be a positive number of seconds up to "
            "3153600000 (100 years)",
        ),
        (["--older-than", "soon"], "argument --older-than: 'soon' is not a number of seconds"),
        (["--dry-run", "yes"], "unrecognized arguments: yes"),
    ],
)
def test_prune_jobs__bad_flags_fail_cleanly(
    processes: Processes, args: list[str], message: str
) -> None:
    PaymentJob.objects.enqueue("noop")
    proc = processes.manage("prune_jobs", *args)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1
    assert out == f"CommandError: prune_jobs: {message}\n"
    assert PaymentJob.objects.count() == 1


# ---- operator events and the worker registry ------------------------------------------------


@pytest.mark.parametrize("prune_ledger", [True, False])
def test_prune_jobs__events_follow_the_ledger(prune_ledger: bool) -> None:
    make_jobs({"failed-old": (Status.FAILED, 3, 31)})
    ids = list(PaymentJob.objects.values_list("pk", flat=True))
    assert PaymentJob.objects.all().requeue(by="ops") == 3
    assert PaymentJob.objects.all().mark_failed(reason="no", by="ops") == 3
    PaymentJob.objects.update(completed_at=Now() - timedelta(days=31))

    with override_settings(DJANGO_LEASES={"PRUNE_LEDGER": prune_ledger}):
        call_command("prune_jobs", stdout=StringIO())

    assert not PaymentJob.objects.exists()
    kept = JobEvent.objects.filter(job_ref__in=ids)
    assert kept.count() == (0 if prune_ledger else 6)
    assert not kept.filter(job__isnull=False).exists()


def make_workers(**ages: tuple[float | None, float]) -> None:
    """Registry rows: worker id -> (days since stopped or None, days since last seen)."""
    for worker_id, (stopped, seen) in ages.items():
        Worker.objects.create(worker_id=worker_id, hostname="h", pid=1)
        Worker.objects.filter(worker_id=worker_id).update(
            last_seen_at=Now() - timedelta(days=seen),
            stopped_at=None if stopped is None else Now() - timedelta(days=stopped),
        )


def test_prune_jobs__prunes_registry_rows_of_long_gone_workers() -> None:
    make_workers(
        running=(None, 0),
        stopped_yesterday=(1, 1),
        stopped_long_ago=(8, 8),
        killed_long_ago=(None, 9),  # SIGKILLed: never marked stopped
    )
    out = StringIO()
    call_command("prune_jobs", "--dry-run", stdout=out)
    assert "2 worker registry row(s) would be pruned" in out.getvalue()
    assert Worker.objects.count() == 4

    out = StringIO()
    call_command("prune_jobs", stdout=out)

    assert "2 worker registry row(s) pruned" in out.getvalue()
    assert set(Worker.objects.values_list("worker_id", flat=True)) == {
        "running",
        "stopped_yesterday",
    }


@override_settings(DJANGO_LEASES={"WORKER_RETENTION": DAY / 2})
def test_prune_jobs__worker_retention_setting_decides() -> None:
    make_workers(running=(None, 0), stopped_yesterday=(1, 1))
    call_command("prune_jobs", stdout=StringIO())
    assert list(Worker.objects.values_list("worker_id", flat=True)) == ["running"]


@pytest.mark.parametrize(
    ("settings", "bad"),
    [
        ({}, False),
        ({"WORKER_RETENTION": 3600}, False),
        ({"WORKER_RETENTION": 120, "WORKER_GONE_AFTER": 120}, False),
        ({"WORKER_RETENTION": 0}, True),
        ({"WORKER_RETENTION": "7d"}, True),
        ({"WORKER_RETENTION": float("nan")}, True),
        ({"WORKER_RETENTION": 60}, True),  # shorter than WORKER_GONE_AFTER (120)
        ({"WORKER_RETENTION": 600, "WORKER_GONE_AFTER": 900}, True),
    ],
)
def test_check_worker_retention__reports_e024(settings: dict, bad: bool) -> None:
    with override_settings(DJANGO_LEASES=settings):
        messages = check_worker_retention()
    assert [m.id for m in messages] == (["django_leases.E024"] if bad else [])
    if bad:
        assert "WORKER_RETENTION" in messages[0].msg and messages[0].hint


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(
    connection.vendor != "mysql",
    reason="only MariaDB/MySQL have a session time zone that moves NOW(); PostgreSQL's now() is "
    "a timestamptz and SQLite's clock is UTC",
)
@pytest.mark.parametrize("dry_run", [False, True], ids=["prune", "dry-run"])
def test_prune_jobs__refuses_a_session_zone_that_is_not_utc(
    processes: Processes, dry_run: bool
) -> None:
    """Under +02:00, NOW() runs two hours ahead of the UTC that workers wrote completed_at in:
    a job completed seconds ago was pruned with --older-than 3600. Refused like the worker and
    the watcher refuse that clock, with the same one line."""
    job = PaymentJob.objects.enqueue("noop")
    PaymentJob.objects.filter(pk=job.pk).update(status=Status.COMPLETED, completed_at=Now())
    JobAttempt.objects.create(job=job, job_ref=job.pk, attempt=1, token=1, owner="w")
    env = subprocess_env(LEASES_TEST_SESSION_TZ="+02:00")
    args = ["--older-than", "3600", *(["--dry-run"] if dry_run else [])]
    proc = processes.manage("prune_jobs", *args, env=env)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, out
    assert out.startswith("CommandError: database 'default': the session time zone is '+02:00'")
    assert len(out.strip().splitlines()) == 1, out
    assert PaymentJob.objects.filter(pk=job.pk).exists()
    assert JobAttempt.objects.filter(job_ref=job.pk).count() == 1
