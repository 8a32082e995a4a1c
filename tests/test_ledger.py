"""The attempt ledger (querysets/ledger.py): a row per acquisition, closed once; finished_by."""

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now

from django_leases.exceptions import LeaseLost
from django_leases.models import JobAttempt, PaymentJob
from tests.leasing import claim_one, expire, ledger, token_of
from tests.testapp.models import PayoutAttempt, PayoutJob

pytestmark = pytest.mark.django_db

Status = PaymentJob.Status


def test_attempt_rows__reads_the_tables_own_ledger_oldest_first() -> None:
    job = PayoutJob.objects.enqueue("payout.send")
    PayoutJob.objects.claim("w1", ttl=60)
    PayoutJob.objects.filter(pk=job.pk).update(lease_until=Now() - timedelta(seconds=5))
    PayoutJob.objects.claim("w2", ttl=60)
    rows = PayoutJob.objects.attempt_rows(job.pk)
    assert [(r.attempt, r.owner, r.outcome) for r in rows] == [
        (1, "w1", "lease_lost"),
        (2, "w2", "running"),
    ]
    assert rows[0].token < rows[1].token == PayoutJob.objects.get(pk=job.pk).lease_token
    assert all(isinstance(row, PayoutAttempt) for row in rows)
    assert JobAttempt.objects.count() == 0


def test_attempts_never_reset_and_ledger_agrees() -> None:
    PaymentJob.objects.enqueue("a", max_attempts=10)
    for n in range(1, 5):
        job = claim_one(f"w{n}")
        assert job.attempts == n
        if n % 2:
            expire(job)
        else:
            PaymentJob.objects.fail(job.pk, job.lease_owner, job.lease_token, "x")
            PaymentJob.objects.filter(pk=job.pk).update(run_at=Now())
    job.refresh_from_db()
    rows = ledger(job)
    assert job.attempts == len(rows) == 4
    assert [r[0] for r in rows] == [1, 2, 3, 4] and [r[1] for r in rows] == [1, 2, 3, 4]
    assert PaymentJob.objects.filter(lease_token=token_of(job, 4)).count() == 1


def test_finished_by__tells_a_lost_acknowledgement_from_a_takeover() -> None:
    PaymentJob.objects.enqueue("a")
    PaymentJob.objects.enqueue("a")
    done, taken = PaymentJob.objects.claim("w1", ttl=60, limit=2)
    assert not PaymentJob.objects.finished_by(done.pk, "w1", done.lease_token)
    PaymentJob.objects.complete(done.pk, "w1", done.lease_token)
    assert PaymentJob.objects.finished_by(done.pk, "w1", done.lease_token)
    expire(taken)
    claim_one("w2")
    assert not PaymentJob.objects.finished_by(taken.pk, "w1", taken.lease_token)
    assert list(PaymentJob.objects.held_by("w2").values_list("pk", flat=True)) == [taken.pk]


def test_finished_by__no_when_the_watcher_rescued_the_job_meanwhile() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    expire(job)
    # The holder's completion never committed; the watcher rescued the job, token unchanged.
    assert PaymentJob.objects.rescue(PaymentJob.objects.expired().get(), "retry", by="watcher")
    assert PaymentJob.objects.get(pk=job.pk).lease_token == job.lease_token
    assert not PaymentJob.objects.finished_by(job.pk, "w1", job.lease_token)


@pytest.mark.parametrize("outcome", ["failed", "retried", "released", "timed_out"])
def test_finished_by__yes_for_each_write_of_the_holder_itself(outcome: str) -> None:
    PaymentJob.objects.enqueue("a", max_attempts=1 if outcome == "failed" else 5)
    job = claim_one("w1")
    jobs, pk, token = PaymentJob.objects, job.pk, job.lease_token
    if outcome == "released":
        jobs.release(pk, "w1", token)
    elif outcome == "timed_out":
        jobs.time_out(pk, "w1", token, retry_in=None, reason="ran too long")
    else:
        jobs.fail(pk, "w1", token, "x")
    assert ledger(job) == [(1, 1, "w1", outcome)]
    assert jobs.finished_by(pk, "w1", token)
    assert not jobs.finished_by(pk, "w2", token)


def test_record_fenced__never_stamps_a_row_its_holder_closed() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    PaymentJob.objects.complete(job.pk, "w1", job.lease_token)
    # The acknowledgement was lost and the holder sends its completion again: refused.
    with pytest.raises(LeaseLost):
        PaymentJob.objects.complete(job.pk, "w1", job.lease_token)
    PaymentJob.objects.record_fenced(job.pk, job.lease_token)
    row = JobAttempt.objects.get(job_ref=job.pk)
    assert (row.outcome, row.ended_by, row.fenced_at) == ("completed", "w1", None)


def test_record_fenced__stamps_the_row_of_a_holder_that_was_taken_over() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    expire(job)
    claim_one("w2")
    with pytest.raises(LeaseLost):
        PaymentJob.objects.complete(job.pk, "w1", job.lease_token)
    row = JobAttempt.objects.get(job_ref=job.pk, token=job.lease_token)
    assert (row.outcome, row.ended_by) == ("lease_lost", "w2") and row.fenced_at is not None


REVIEW_CAPTURE = {"STUCK_POLICY_BY_KIND": {"capture": "review"}}


@pytest.mark.parametrize("model", [JobAttempt, PayoutAttempt], ids=lambda m: m.__name__)
def test_ledger__no_index_holds_a_column_an_attempts_end_writes(model: type[JobAttempt]) -> None:
    # So that closing an attempt enters no index (a HOT update on PostgreSQL): its open row is
    # found by the (job_ref, token) index. A row's identity (id, job, job_ref, token) and when
    # it began (claimed_at, written by its insert only: the queue history counts the attempts
    # claimed in a minute) are all an index may hold; every other column is one an attempt's
    # end may write (`ledger.close()`, PostgreSQL's completion and takeover), now or in a later
    # release.
    names = ("id", "job", "job_ref", "token", "claimed_at")
    identity = {model._meta.get_field(name).column for name in names}
    written_later = {field.column for field in model._meta.concrete_fields} - identity
    assert {"ended_at", "outcome", "ended_by", "error_class"} <= written_later
    with connection.cursor() as cursor:
        found = connection.introspection.get_constraints(cursor, model._meta.db_table)
    indexed = {name: c["columns"] for name, c in found.items() if c["index"] or c["unique"]}
    assert {name: cols for name, cols in indexed.items() if written_later & set(cols)} == {}
    assert ["job_ref", "token"] in indexed.values()


def test_ledger__closing_an_attempt_is_a_hot_update_on_postgresql() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("HOT updates are PostgreSQL's")

    def updates() -> tuple[int, int]:
        # The counts of this transaction so far (updates, HOT updates), as pg_stat_xact keeps.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = %s",
                [JobAttempt._meta.db_table],
            )
            return cursor.fetchone() or (0, 0)

    PaymentJob.objects.enqueue("noop")
    job = claim_one("w1")
    before = updates()
    assert PaymentJob.objects.complete_many("w1", [(job.pk, job.lease_token)])
    after = updates()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
