"""Operator actions: conditional per row, set-based in bounded batches, recorded as events
beside the attempt ledger, whose closed rows they never change."""

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_leases.exceptions import Cancelled, LeaseLost
from django_leases.models import JobAttempt, JobEvent, PaymentJob
from django_leases.querysets.operators import OPERATOR_BATCH_SIZE
from tests.leasing import claim_one, expire, ledger
from tests.testapp.models import BareJob

from .conftest import Processes, wait_for

pytestmark = pytest.mark.django_db

Status = PaymentJob.Status
ROW = ("attempt", "token", "owner", "outcome", "ended_by", "error_class", "error_message")


def rows(job: PaymentJob) -> list[tuple]:
    """The job's ledger, with the time it closed: a rewritten row would show a new one."""
    return list(
        JobAttempt.objects.filter(job_ref=job.pk).order_by("token").values_list(*ROW, "ended_at")
    )


def events(job: PaymentJob) -> list[tuple]:
    return list(
        JobEvent.objects.filter(job_ref=job.pk)
        .order_by("id")
        .values_list("action", "by", "attempts", "token", "reason")
    )


def test_requeue__leaves_the_failed_attempt_as_it_was_and_records_an_event() -> None:
    job = PaymentJob.objects.enqueue("a", max_attempts=1)
    held = claim_one("w1")
    PaymentJob.objects.fail(job.pk, "w1", held.lease_token, ValueError("card declined"))
    before = rows(job)
    assert [r[3:7] for r in before] == [("failed", "w1", "ValueError", "card declined")]

    assert PaymentJob.objects.filter(pk=job.pk).requeue(by="admin:ops") == 1

    assert rows(job) == before
    assert events(job) == [("requeued", "admin:ops", 1, held.lease_token, "")]
    # No attempts were left: the requeued job still runs again.
    again = claim_one("w2")
    assert (again.pk, again.attempts, again.max_attempts) == (job.pk, 2, 2)
    assert JobEvent.objects.get(job_ref=job.pk).at is not None


def test_mark_failed__of_a_rescued_pending_job_keeps_the_watchers_row() -> None:
    job = PaymentJob.objects.enqueue("a")
    held = claim_one("w1")
    expire(job)
    assert PaymentJob.objects.rescue(PaymentJob.objects.get(pk=job.pk), "retry", by="watcher")
    before = rows(job)

    assert PaymentJob.objects.filter(pk=job.pk).mark_failed(reason="fraud", by="admin:ops") == 1

    assert rows(job) == before and before[0][3:5] == ("rescued", "watcher")
    assert events(job) == [("failed", "admin:ops", 1, held.lease_token, "fraud")]
    assert PaymentJob.objects.get(pk=job.pk).status == Status.FAILED


def test_mark_failed__of_a_job_under_review_keeps_the_review_row() -> None:
    job = PaymentJob.objects.enqueue("a")
    claim_one("w1")
    expire(job)
    assert PaymentJob.objects.rescue(PaymentJob.objects.get(pk=job.pk), "review", by="watcher")
    before = rows(job)

    assert PaymentJob.objects.filter(pk=job.pk).mark_failed(reason="no", by="admin:ops") == 1

    assert rows(job) == before and before[0][3:5] == ("review", "watcher")
    assert [e[0] for e in events(job)] == ["failed"]


def test_forced_actions__close_the_open_attempt_once_then_never_again() -> None:
    job = PaymentJob.objects.enqueue("a")
    held = claim_one("w1")
    expire(job)
    # An expired processing job: its open attempt is ended by the operator, once.
    assert PaymentJob.objects.filter(pk=job.pk).mark_failed(reason="stuck", by="admin:a") == 1
    closed = rows(job)
    assert [r[3:7] for r in closed] == [("failed", "admin:a", "", "stuck")]
    assert PaymentJob.objects.filter(pk=job.pk).requeue(by="admin:b") == 1
    assert PaymentJob.objects.filter(pk=job.pk).mark_failed(reason="again", by="admin:c") == 1
    assert rows(job) == closed
    recorded = events(job)
    assert [(*e[:3], e[4]) for e in recorded] == [
        ("failed", "admin:a", 1, "stuck"),
        ("requeued", "admin:b", 1, ""),
        ("failed", "admin:c", 1, "again"),
    ]
    # Each fencing action gave the job a new token: each event saw the one before it.
    assert held.lease_token == recorded[0][3] < recorded[1][3] < recorded[2][3]


def test_force_requeue__of_a_live_lease_ends_its_attempt_as_requeued_by_the_operator() -> None:
    job = PaymentJob.objects.enqueue("a")
    claim_one("w1")
    assert PaymentJob.objects.filter(pk=job.pk).requeue(by="admin:ops") == 0
    assert PaymentJob.objects.filter(pk=job.pk).requeue(force=True, by="admin:ops") == 1
    assert [r[3:5] for r in rows(job)] == [("requeued", "admin:ops")]
    # The event says it was forced; the attempt's outcome is the requeue's, as without force.
    assert [e[:2] for e in events(job)] == [("force_requeued", "admin:ops")]


def test_release_stuck_cancel_and_review_verdicts__each_record_one_event() -> None:
    stuck = PaymentJob.objects.enqueue("a")
    claim_one("w1")
    expire(stuck)
    pending = PaymentJob.objects.enqueue("a")
    review = PaymentJob.objects.enqueue("a")
    PaymentJob.objects.filter(pk=review.pk).update(status=Status.REVIEW)

    assert PaymentJob.objects.all().release_stuck(by="admin:ops") == 1
    assert PaymentJob.objects.filter(pk=pending.pk).cancel(by="admin:ops") == 1
    assert PaymentJob.objects.all().resolve_review("retry", by="admin:ops") == 1

    assert [e[:2] for e in events(stuck)] == [("released", "admin:ops")]
    assert [r[3:5] for r in rows(stuck)] == [("rescued", "admin:ops")]
    # cancel() reaches running jobs unless told not to (running=False): a force cancel.
    assert [e[:2] for e in events(pending)] == [("force_cancelled", "admin:ops")]
    assert [e[:2] for e in events(review)] == [("review_retry", "admin:ops")]
    # Nothing changed, nothing recorded.
    assert PaymentJob.objects.filter(pk=pending.pk).cancel(by="admin:ops") == 0
    assert PaymentJob.objects.filter(pk=stuck.pk).release_stuck(by="admin:ops") == 0
    assert JobEvent.objects.count() == 3


def test_requeue__is_one_update_per_bounded_batch() -> None:
    total = 2 * OPERATOR_BATCH_SIZE + 7
    PaymentJob.objects.bulk_create(
        PaymentJob(kind="a", status=Status.FAILED, attempts=5, lease_token=5) for _ in range(total)
    )
    PaymentJob.objects.bulk_create(PaymentJob(kind="a", status=Status.COMPLETED) for _ in range(3))
    table = PaymentJob._meta.db_table

    with CaptureQueriesContext(connection) as ctx:
        assert PaymentJob.objects.all().requeue(by="admin:ops") == total

    updates = [q["sql"] for q in ctx.captured_queries if q["sql"].startswith("UPDATE")]
    job_updates = [sql for sql in updates if table in sql.split("SET")[0]]
    assert len(job_updates) == 3
    assert PaymentJob.objects.filter(status=Status.PENDING, max_attempts=6).count() == total
    assert PaymentJob.objects.filter(status=Status.COMPLETED).count() == 3
    assert JobEvent.objects.filter(action="requeued", attempts=5, token=5).count() == total


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_mark_failed__racing_workers_records_exactly_the_jobs_it_failed(
    processes: Processes,
) -> None:
    total = 1000
    PaymentJob.objects.bulk_create(PaymentJob(kind="noop") for _ in range(total))
    assert len(PaymentJob.objects.claim("dead", ttl=60, limit=total)) == total
    PaymentJob.objects.update(lease_until=Now() - timedelta(seconds=5))
    workers = [
        processes.manage(
            "run_lease_worker",
            "--burst",
            "--kind",
            "noop",
            "--worker-id",
            f"w{n}",
            "--concurrency",
            "4",
            "--ttl",
            "30",
            "--heartbeat",
            "5",
        )  # fmt: skip
        for n in range(2)
    ]
    wait_for(lambda: PaymentJob.objects.filter(status=Status.COMPLETED).exists())

    changed = 0
    while any(proc.poll() is None for proc in workers):
        changed += PaymentJob.objects.all().mark_failed(reason="ops", by="ops")
    changed += PaymentJob.objects.all().mark_failed(reason="ops", by="ops")

    assert [proc.wait(timeout=60) for proc in workers] == [0, 0]
    failed = set(PaymentJob.objects.filter(status=Status.FAILED).values_list("pk", flat=True))
    completed = PaymentJob.objects.filter(status=Status.COMPLETED)
    assert failed and len(failed) + completed.count() == total
    assert changed == len(failed) == JobEvent.objects.count()
    assert set(JobEvent.objects.values_list("job_ref", flat=True)) == failed
    assert not JobAttempt.objects.filter(ended_at__isnull=True).exists()
    # A failed job's only attempt was closed once, by the operator; a completed job's first
    # attempt by the worker that took it over.
    first = JobAttempt.objects.filter(owner="dead")
    assert set(
        first.filter(outcome="failed", ended_by="ops").values_list("job_ref", flat=True)
    ) == (failed)
    taken = first.filter(outcome="lease_lost", ended_by__in=["w0", "w1"])
    assert taken.count() == completed.count() == JobAttempt.objects.filter(attempt=2).count()


# ---- each action on its own ------------------------------------------------------------


def test_requeue__refuses_a_healthy_lease_unless_forced() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    assert PaymentJob.objects.filter(pk=job.pk).requeue() == 0
    assert PaymentJob.objects.get(pk=job.pk).status == Status.PROCESSING
    assert PaymentJob.objects.filter(pk=job.pk).requeue(force=True) == 1
    requeued = PaymentJob.objects.get(pk=job.pk)
    assert requeued.status == Status.PENDING and requeued.lease_token > job.lease_token
    # The fenced-out holder can write nothing any more.
    with pytest.raises(LeaseLost):
        PaymentJob.objects.complete(job.pk, "w1", job.lease_token)
    assert ledger(job) == [(1, 1, "w1", "requeued")]


def test_requeue__failed_job_gets_another_attempt() -> None:
    PaymentJob.objects.enqueue("a", max_attempts=1)
    job = claim_one("w1")
    PaymentJob.objects.fail(job.pk, "w1", job.lease_token, "x")
    assert PaymentJob.objects.filter(pk=job.pk).requeue() == 1
    again = claim_one("w2")
    assert (again.pk, again.attempts, again.max_attempts) == (job.pk, 2, 2)


def test_release_stuck__only_expired_leases() -> None:
    PaymentJob.objects.enqueue("a")
    PaymentJob.objects.enqueue("a")
    stuck, live = PaymentJob.objects.claim("w1", ttl=60, limit=2)
    expire(stuck)
    assert PaymentJob.objects.all().release_stuck() == 1
    assert PaymentJob.objects.get(pk=stuck.pk).status == Status.PENDING
    assert PaymentJob.objects.get(pk=live.pk).status == Status.PROCESSING


def test_mark_failed_cancel_and_resolve_review() -> None:
    PaymentJob.objects.enqueue("a")
    live = claim_one("w1")
    pending = PaymentJob.objects.enqueue("a")
    other = PaymentJob.objects.enqueue("a")
    # A live lease is neither failed (unless forced) nor cancelled (running=False); a pending
    # job is cancelled.
    assert PaymentJob.objects.filter(pk=live.pk).mark_failed(reason="ops") == 0
    assert PaymentJob.objects.filter(pk=live.pk).cancel(running=False) == 0
    assert PaymentJob.objects.get(pk=live.pk).status == Status.PROCESSING
    assert PaymentJob.objects.filter(pk=pending.pk).cancel() == 1
    assert PaymentJob.objects.get(pk=pending.pk).status == Status.CANCELLED
    assert PaymentJob.objects.filter(pk=live.pk).mark_failed(reason="ops", force=True) == 1
    failed = PaymentJob.objects.get(pk=live.pk)
    assert (failed.status, failed.last_error) == (Status.FAILED, "ops")
    assert failed.lease_token > live.lease_token
    with pytest.raises(LeaseLost):
        PaymentJob.objects.complete(live.pk, "w1", live.lease_token)
    PaymentJob.objects.filter(pk=other.pk).update(status=Status.REVIEW)
    assert PaymentJob.objects.filter(pk=other.pk).resolve_review("completed") == 1
    assert PaymentJob.objects.get(pk=other.pk).status == Status.COMPLETED
    with pytest.raises(ValueError, match="verdict"):
        PaymentJob.objects.all().resolve_review("maybe")


def test_release_stuck__gives_a_job_without_attempts_left_one_more() -> None:
    PaymentJob.objects.enqueue("a", max_attempts=1)
    job = claim_one("w1")
    expire(job)
    assert PaymentJob.objects.all().release_stuck(by="admin:ops") == 1
    again = claim_one("w2")
    assert (again.pk, again.attempts, again.max_attempts) == (job.pk, 2, 2)
    assert JobAttempt.objects.get(job_ref=job.pk, attempt=1).ended_by == "admin:ops"


def test_resolve_review__records_verdict_and_who_on_the_ledger() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    expire(job)
    assert PaymentJob.objects.rescue(PaymentJob.objects.get(pk=job.pk), "review", by="watcher")
    assert PaymentJob.objects.filter(pk=job.pk).resolve_review("failed", by="admin:ops") == 1
    row = JobAttempt.objects.get(job_ref=job.pk)
    assert (row.outcome, row.ended_by, row.resolution, row.resolved_by) == (
        "review",
        "watcher",
        "failed",
        "admin:ops",
    )
    assert row.resolved_at is not None


def test_cancel__says_who_cancelled() -> None:
    job = PaymentJob.objects.enqueue("a")
    assert PaymentJob.objects.filter(pk=job.pk).cancel(by="admin:ops") == 1
    job.refresh_from_db()
    assert (job.status, job.last_error) == (Status.CANCELLED, "cancelled by admin:ops")


def test_cancel__a_running_job_stops_fenced_out_and_ends_cancelled_once_its_holder_is_done() -> (
    None
):
    PaymentJob.objects.enqueue("a", lock="payment:1")
    behind = PaymentJob.objects.enqueue("a", lock="payment:1")
    held = claim_one("w1")
    key = (held.pk, held.lease_token)
    assert PaymentJob.objects.filter(pk=held.pk).cancel(by="admin:ops", reason="refunded") == 1

    # Its handler may still run: stopping, its lock and lease kept, its attempt not closed.
    job = PaymentJob.objects.get(pk=held.pk)
    assert (job.status, job.ends_as, job.lease_token, job.last_error, job.completed_at) == (
        Status.STOPPING,
        Status.CANCELLED,
        held.lease_token,
        "cancelled by admin:ops: refunded",
        None,
    )
    assert (job.lock_holder, PaymentJob.objects.get(pk=behind.pk).status) == (
        "payment:1",
        Status.WAITING,
    )
    assert [r[3:5] + r[-1:] for r in rows(job)] == [("cancelled", "admin:ops", None)]
    assert events(job) == [("force_cancelled", "admin:ops", 1, held.lease_token, "refunded")]
    assert PaymentJob.objects.cancelled_leases([key]) == {key: "admin:ops"}
    before = (rows(job), PaymentJob.objects.filter(pk=job.pk).values().get())
    assert PaymentJob.objects.heartbeat("w1", [key], ttl=60) == set()
    writes = [
        lambda: PaymentJob.objects.checkpoint(held.pk, "w1", held.lease_token, "psp_called"),
        lambda: PaymentJob.objects.complete(held.pk, "w1", held.lease_token),
        lambda: PaymentJob.objects.fail(held.pk, "w1", held.lease_token, "psp 502"),
        lambda: PaymentJob.objects.release(held.pk, "w1", held.lease_token),
    ]
    for write in writes:
        with pytest.raises(Cancelled, match="cancelled by admin:ops"):
            write()
    # Never claimed, requeued (without force) or cancelled again while it stops.
    assert PaymentJob.objects.claim("w2", ttl=60) == []
    assert PaymentJob.objects.filter(pk=job.pk).requeue() == 0
    assert PaymentJob.objects.filter(pk=job.pk).cancel() == 0
    after = PaymentJob.objects.filter(pk=job.pk).values().get()
    assert [r[:7] for r in rows(job)] == [r[:7] for r in before[0]] and after == before[1]

    # Its holder's handler returned: the execution ends, and the lock passes on.
    assert PaymentJob.objects.acknowledge_stops("w2", [key]) == {}
    assert PaymentJob.objects.acknowledge_stops("w1", [key]) == {key: Status.CANCELLED}
    job = PaymentJob.objects.get(pk=held.pk)
    assert (job.status, job.ends_as, job.lease_token, job.lock_holder) == (
        Status.CANCELLED,
        "",
        held.lease_token + 1,
        None,
    )
    assert job.completed_at is not None
    assert PaymentJob.objects.get(pk=behind.pk).status == Status.PENDING
    ((outcome, by, ended_at),) = [r[3:5] + r[-1:] for r in rows(job)]
    assert (outcome, by) == ("cancelled", "admin:ops") and ended_at is not None
    assert PaymentJob.objects.cancelled_leases([key]) == {key: "admin:ops"}
    assert PaymentJob.objects.acknowledge_stops("w1", [key]) == {}
    # Never claimable again, whatever its lease said; once more is no change.
    expire(job, seconds=3600)
    assert [j.pk for j in PaymentJob.objects.claim("w2", ttl=60)] == [behind.pk]
    assert PaymentJob.objects.filter(pk=job.pk).cancel() == 0


def test_cancel__an_expired_lease_ends_cancelled_at_once() -> None:
    PaymentJob.objects.enqueue("a", lock="payment:1")
    behind = PaymentJob.objects.enqueue("a", lock="payment:1")
    held = claim_one("w1")
    expire(held)
    assert PaymentJob.objects.filter(pk=held.pk).cancel(by="ops") == 1
    job = PaymentJob.objects.get(pk=held.pk)
    assert (job.status, job.lease_token) == (Status.CANCELLED, held.lease_token + 1)
    assert PaymentJob.objects.get(pk=behind.pk).status == Status.PENDING
    ((outcome, by, ended_at),) = [r[3:5] + r[-1:] for r in rows(job)]
    assert (outcome, by) == ("cancelled", "ops") and ended_at is not None


def test_cancel__a_lost_lease_that_was_not_cancelled_stays_lease_lost() -> None:
    PaymentJob.objects.enqueue("a")
    held = claim_one("w1")
    assert PaymentJob.objects.filter(pk=held.pk).requeue(force=True) == 1
    assert PaymentJob.objects.cancelled_leases([(held.pk, held.lease_token)]) == {}
    with pytest.raises(LeaseLost) as lost:
        PaymentJob.objects.complete(held.pk, "w1", held.lease_token)
    assert not isinstance(lost.value, Cancelled)


@override_settings(DJANGO_LEASES={"STUCK_POLICY_BY_KIND": {"risky": "review"}})
def test_cancel__a_review_policy_job_past_its_checkpoint_goes_to_review() -> None:
    PaymentJob.objects.enqueue("risky", lock="payment:1")
    behind = PaymentJob.objects.enqueue("a", lock="payment:1")
    unchecked = PaymentJob.objects.enqueue("risky")
    held, fresh_risky = PaymentJob.objects.claim("w1", ttl=60, limit=2)
    PaymentJob.objects.checkpoint(held.pk, "w1", held.lease_token, "psp_called")
    assert PaymentJob.objects.filter(pk__in=[held.pk, fresh_risky.pk]).cancel(by="ops") == 2
    with pytest.raises(Cancelled):
        PaymentJob.objects.complete(held.pk, "w1", held.lease_token)
    assert PaymentJob.objects.acknowledge_stops(
        "w1", [(held.pk, held.lease_token), (fresh_risky.pk, fresh_risky.lease_token)]
    ) == {
        (held.pk, held.lease_token): Status.REVIEW,
        (fresh_risky.pk, fresh_risky.lease_token): Status.CANCELLED,
    }

    job = PaymentJob.objects.get(pk=held.pk)
    # It may have moved money: under review, its lock held, its token kept for the verdict.
    assert (job.status, job.lease_token, job.lock_holder, job.completed_at) == (
        Status.REVIEW,
        held.lease_token,
        "payment:1",
        None,
    )
    assert [r[3:5] for r in rows(job)] == [("cancelled", "ops")]
    assert PaymentJob.objects.get(pk=behind.pk).status == Status.WAITING
    # Without a checkpoint it never reached the risky step: cancelled.
    assert PaymentJob.objects.get(pk=unchecked.pk).status == Status.CANCELLED
    assert PaymentJob.objects.filter(pk=job.pk).resolve_review("failed", by="ops") == 1
    row = JobAttempt.objects.get(job_ref=job.pk)
    assert (row.outcome, row.resolution) == ("cancelled", "failed")
    assert PaymentJob.objects.get(pk=behind.pk).status == Status.PENDING


def test_cancel__on_a_table_without_a_ledger_the_holder_learns_it_from_the_job() -> None:
    BareJob.objects.enqueue("bare")
    (held,) = BareJob.objects.claim("w1", ttl=60)
    assert BareJob.objects.filter(pk=held.pk).cancel() == 1
    assert BareJob.objects.get(pk=held.pk).status == Status.STOPPING
    key = (held.pk, held.lease_token)
    assert BareJob.objects.cancelled_leases([key]) == {key: "an operator"}
    with pytest.raises(Cancelled):
        BareJob.objects.complete(held.pk, "w1", held.lease_token)
    assert BareJob.objects.acknowledge_stops("w1", [key]) == {key: Status.CANCELLED}
    assert BareJob.objects.get(pk=held.pk).status == Status.CANCELLED
    assert BareJob.objects.cancelled_leases([key]) == {key: "an operator"}
    with pytest.raises(Cancelled):
        BareJob.objects.complete(held.pk, "w1", held.lease_token)
