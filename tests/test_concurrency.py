"""Races between real OS processes on the real database: exactly one owner per job."""

import json
import os
import threading
import time
from collections import Counter

import pytest
from django.db import OperationalError, connection, transaction

from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets import deadlocked, retry_deadlocks

from .conftest import ON_SQLITE, Processes

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

RACE_JOBS = int(os.environ.get("LEASES_RACE_JOBS", "2000"))


def run_claimers(processes: Processes, count: int, *args: str) -> list[dict]:
    start_at = f"{time.time() + 2:.3f}"  # let every process import Django before the race
    procs = [
        processes.start(
            "-m", "tests.claimer", "--owner", f"racer-{n}", "--start-at", start_at, *args
        )
        for n in range(count)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.slow
def test_claim__eight_processes_claim_every_job_exactly_once(processes: Processes) -> None:
    PaymentJob.objects.bulk_create(PaymentJob(kind="noop") for _ in range(RACE_JOBS))
    limit = 5
    results = run_claimers(processes, 8, "--limit", str(limit))

    won = Counter(pk for result in results for pk in result["won"])
    assert len(won) == RACE_JOBS
    assert set(won.values()) == {1}
    # The PostgreSQL planner trap would show here as a batch larger than the limit.
    assert max(result["largest_batch"] for result in results) <= limit
    assert sum(1 for result in results if result["won"]) >= 2, "the race had a single runner"
    assert PaymentJob.objects.exclude(status="completed").count() == 0
    assert set(PaymentJob.objects.values_list("attempts", flat=True).distinct()) == {1}
    # Each job holds the token of its one acquisition, which no other job's row names.
    assert dict(PaymentJob.objects.values_list("pk", "lease_token")) == dict(
        JobAttempt.objects.values_list("job_ref", "token")
    )
    assert JobAttempt.objects.count() == RACE_JOBS
    assert set(JobAttempt.objects.values_list("outcome", flat=True).distinct()) == {"completed"}


def test_claim_job__two_processes_race_one_job_a_thousand_times(processes: Processes) -> None:
    PaymentJob.objects.bulk_create(PaymentJob(kind="noop") for _ in range(1000))
    results = run_claimers(processes, 2, "--mode", "claim_job")

    won = Counter(pk for result in results for pk in result["won"])
    assert len(won) == 1000 and set(won.values()) == {1}
    assert [result["tried"] for result in results] == [1000, 1000]
    assert set(PaymentJob.objects.values_list("attempts", flat=True).distinct()) == {1}
    ledger = Counter(JobAttempt.objects.values_list("job_ref", flat=True))
    assert len(ledger) == 1000 and set(ledger.values()) == {1}


def test_claim__under_contention_never_exceeds_limit_of_one(processes: Processes) -> None:
    PaymentJob.objects.bulk_create(PaymentJob(kind="noop") for _ in range(400))
    results = run_claimers(processes, 4, "--limit", "1")
    assert max(result["largest_batch"] for result in results) == 1
    won = Counter(pk for result in results for pk in result["won"])
    assert len(won) == 400 and set(won.values()) == {1}


@pytest.mark.skipif(
    ON_SQLITE,
    reason="SQLite has one writer at a time: two transactions cannot deadlock on row locks",
)
def test_retry_deadlocks__recognises_a_real_deadlock_and_runs_again() -> None:
    a, b = (PaymentJob.objects.enqueue("noop").pk for _ in range(2))
    barrier = threading.Barrier(2)
    errors: list[OperationalError] = []

    def lock(first: int, second: int) -> None:
        try:
            with transaction.atomic():
                PaymentJob.objects.select_for_update().get(pk=first)
                barrier.wait(timeout=10)
                PaymentJob.objects.select_for_update().get(pk=second)
        except OperationalError as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=lock, args=pair) for pair in ((a, b), (b, a))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(errors) == 1, "the database must pick exactly one deadlock victim"
    assert deadlocked(errors[0], connection.vendor)

    calls = []

    @retry_deadlocks
    def flaky(queryset: object) -> str:
        calls.append(1)
        if len(calls) == 1:
            raise errors[0]
        return "won"

    assert flaky(PaymentJob.objects.all()) == "won" and len(calls) == 2
