"""Dependencies: `enqueue(after=[...])` waits until every job it names has completed.

The unit tests drive each completion point through the queryset API; the process tests race
real `run_lease_worker` processes over prerequisites that complete at the same moment, on
whichever database DATABASE_URL names.
"""

import signal
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.urls import reverse

from django_leases.exceptions import IdempotencyKeyReused, InvalidArgument
from django_leases.models import JobAttempt, PaymentJob
from tests.testapp.models import BareJob, LockRun

from .conftest import Processes, wait_for

Status = PaymentJob.Status
LOCK = "payment:7"


def row(job: PaymentJob) -> PaymentJob:
    return PaymentJob.objects.get(pk=job.pk)


def claim(pk: int, owner: str = "w") -> PaymentJob:
    job = PaymentJob.objects.claim_job(pk, owner, ttl=60)
    assert job is not None
    return job


def complete(job: PaymentJob) -> None:
    held = claim(job.pk)
    PaymentJob.objects.complete(held.pk, "w", held.lease_token)


# ---- enqueue -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue__after_waits_until_every_prerequisite_completed() -> None:
    first, second = PaymentJob.objects.enqueue("noop"), PaymentJob.objects.enqueue("noop")
    dependent = PaymentJob.objects.enqueue("noop", after=[first, second.pk])
    waiting = row(dependent)
    assert (waiting.status, waiting.unmet, waiting.waits_for) == (
        Status.WAITING,
        2,
        [first.pk, second.pk],
    )
    assert row(first).dependents == [dependent.pk] == row(second).dependents
    # Out of every claim's sight while it waits.
    claimed = PaymentJob.objects.claim("w", ttl=60, limit=10)
    assert dependent.pk not in {job.pk for job in claimed}

    PaymentJob.objects.complete(first.pk, "w", row(first).lease_token)
    assert (row(dependent).status, row(dependent).unmet) == (Status.WAITING, 1)
    PaymentJob.objects.complete(second.pk, "w", row(second).lease_token)
    released = row(dependent)
    assert (released.status, released.unmet) == (Status.PENDING, 0)
    assert [job.pk for job in PaymentJob.objects.claim("w", ttl=60)] == [dependent.pk]


@pytest.mark.django_db
def test_enqueue__after_completed_prerequisites_is_due_at_once() -> None:
    done = PaymentJob.objects.enqueue("noop")
    complete(done)
    dependent = PaymentJob.objects.enqueue("noop", after=[done])
    assert (row(dependent).status, row(dependent).unmet) == (Status.PENDING, 0)
    assert row(dependent).waits_for == [done.pk]
    assert row(done).dependents is None  # nothing to release: the completed job is not told


@pytest.mark.django_db
def test_enqueue__after_an_empty_list_is_a_plain_job() -> None:
    job = PaymentJob.objects.enqueue("noop", after=[])
    assert (row(job).status, row(job).waits_for) == (Status.PENDING, None)


@pytest.mark.django_db
def test_enqueue_many__after_makes_every_job_wait_and_releases_them_together() -> None:
    capture = PaymentJob.objects.enqueue("capture")
    fanned = PaymentJob.objects.enqueue_many(
        "notify", [{"n": 1}, {"n": 2}, {"n": 3}], after=[capture]
    )
    assert {row(job).status for job in fanned} == {Status.WAITING}
    assert row(capture).dependents == [job.pk for job in fanned]
    complete(capture)
    assert {row(job).status for job in fanned} == {Status.PENDING}


@pytest.mark.django_db(transaction=True)
def test_aenqueue__after_waits_as_enqueue_does() -> None:
    capture = PaymentJob.objects.enqueue("capture")

    @async_to_sync
    async def aenqueue() -> list[PaymentJob]:
        one = await PaymentJob.objects.aenqueue("refund", after=[capture])
        many = await PaymentJob.objects.aenqueue_many("notify", [{}, {}], after=[capture.pk])
        return [one, *many]

    dependents = aenqueue()
    assert [row(job).status for job in dependents] == [Status.WAITING] * 3
    assert row(capture).dependents == [job.pk for job in dependents]
    complete(capture)
    assert [row(job).status for job in dependents] == [Status.PENDING] * 3


@pytest.mark.django_db
def test_enqueue__after_an_idempotency_key_that_exists_returns_its_job() -> None:
    capture = PaymentJob.objects.enqueue("capture")
    first = PaymentJob.objects.enqueue("refund", {"a": 1}, idempotency_key="k", after=[capture])
    again = PaymentJob.objects.enqueue("refund", {"a": 1}, idempotency_key="k", after=[capture])
    assert again.pk == first.pk
    assert PaymentJob.objects.filter(kind="refund").count() == 1
    assert row(capture).dependents == [first.pk]  # listed once
    with pytest.raises(IdempotencyKeyReused):
        PaymentJob.objects.enqueue("refund", {"a": 2}, idempotency_key="k", after=[capture])
    assert PaymentJob.objects.filter(kind="refund").count() == 1


@pytest.mark.django_db
def test_enqueue__after_a_missing_job_is_refused_and_writes_nothing() -> None:
    capture = PaymentJob.objects.enqueue("capture")
    with pytest.raises(InvalidArgument, match=r"after: no job 999999 in django_leases\.PaymentJob"):
        PaymentJob.objects.enqueue("refund", after=[capture, 999_999])
    with pytest.raises(
        InvalidArgument, match=r"^after: no job 999999 in django_leases\.PaymentJob"
    ):
        PaymentJob.objects.enqueue_many("refund", [{}, {}], after=[capture, 999_999])
    assert PaymentJob.objects.count() == 1
    assert row(capture).dependents is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("after", "message"),
    [
        ("12", "after must be a list of jobs or job ids, got '12'"),
        (7, "after must be a list of jobs or job ids, got 7"),
        ([True], "after: expected jobs or job ids, got True"),
        ([0], "after: expected jobs or job ids, got 0"),
        (["3"], "after: expected jobs or job ids, got '3'"),
        ([PaymentJob(kind="unsaved")], "is not saved"),
        (list(range(1, 102)), "after names 101 jobs; at most 100"),
    ],
)
def test_enqueue__after_refuses_what_is_not_a_job(after: Any, message: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        PaymentJob.objects.enqueue("refund", after=after)
    assert message in str(caught.value)
    assert PaymentJob.objects.count() == 0


@pytest.mark.django_db
def test_enqueue__after_a_job_of_another_table_is_refused() -> None:
    bare = BareJob.objects.enqueue("noop")
    with pytest.raises(
        InvalidArgument, match=r"is a testapp\.BareJob, not a django_leases\.Payment"
    ):
        PaymentJob.objects.enqueue("refund", after=[bare])
    assert PaymentJob.objects.count() == 0
    assert BareJob.objects.get(pk=bare.pk).dependents is None


@pytest.mark.django_db(databases=["default", "other"])
def test_enqueue__after_a_job_of_another_database_is_refused() -> None:
    elsewhere = PaymentJob.objects.enqueue("capture", using="other")
    with pytest.raises(InvalidArgument, match="is on database 'other', this job goes to 'default'"):
        PaymentJob.objects.enqueue("refund", after=[elsewhere])
    assert PaymentJob.objects.count() == 0
    assert PaymentJob.objects.using("other").get(pk=elsewhere.pk).dependents is None


# ---- each completion point releases ----------------------------------------------------------


@pytest.mark.django_db
def test_complete_many__releases_the_dependents_of_a_batch() -> None:
    first, second = PaymentJob.objects.enqueue("noop"), PaymentJob.objects.enqueue("noop")
    plain = PaymentJob.objects.enqueue("noop")
    dependent = PaymentJob.objects.enqueue("noop", after=[first, second])
    held = [claim(job.pk) for job in (first, second, plain)]
    won = PaymentJob.objects.complete_many("w", [(job.pk, job.lease_token) for job in held])
    assert won == {(job.pk, job.lease_token) for job in held}
    assert (row(dependent).status, row(dependent).unmet) == (Status.PENDING, 0)
    assert JobAttempt.objects.filter(outcome="completed").count() == 3


@pytest.mark.django_db
def test_complete_and_claim__releases_and_claims_the_dependent() -> None:
    first = PaymentJob.objects.enqueue("noop")
    dependent = PaymentJob.objects.enqueue("noop", after=[first])
    held = claim(first.pk)
    done, jobs = PaymentJob.objects.complete_and_claim("w", [(held.pk, held.lease_token)], ttl=60)
    assert done == {(held.pk, held.lease_token)}
    assert row(first).status == Status.COMPLETED
    # Released in the completion's transaction: claimed by the same call, or by the next one.
    claimed = [job.pk for job in jobs] or [job.pk for job in PaymentJob.objects.claim("w", ttl=60)]
    assert claimed == [dependent.pk]


@pytest.mark.django_db
def test_resolve_review__completed_releases_failed_holds() -> None:
    completed, failed = PaymentJob.objects.enqueue("noop"), PaymentJob.objects.enqueue("noop")
    after_completed = PaymentJob.objects.enqueue("noop", after=[completed])
    after_failed = PaymentJob.objects.enqueue("noop", after=[failed])
    PaymentJob.objects.filter(pk__in=[completed.pk, failed.pk]).update(status=Status.REVIEW)
    PaymentJob.objects.filter(pk=completed.pk).resolve_review("completed")
    PaymentJob.objects.filter(pk=failed.pk).resolve_review("failed")
    assert row(after_completed).status == Status.PENDING
    assert (row(after_failed).status, row(after_failed).unmet) == (Status.WAITING, 1)


@pytest.mark.django_db
def test_fail__a_failed_prerequisite_holds_its_dependent_until_an_operator_acts() -> None:
    capture = PaymentJob.objects.enqueue("capture")
    refund = PaymentJob.objects.enqueue("refund", after=[capture])
    held = claim(capture.pk)
    PaymentJob.objects.fail(held.pk, "w", held.lease_token, "declined", permanent=True)
    assert (row(capture).status, row(refund).status) == (Status.FAILED, Status.WAITING)
    # A failed prerequisite requeued by an operator, which then completes, releases it.
    assert PaymentJob.objects.filter(pk=capture.pk).requeue() == 1
    complete(capture)
    assert row(refund).status == Status.PENDING


@pytest.mark.django_db
def test_cancel__a_waiting_dependent_is_cancelled_and_never_released() -> None:
    capture = PaymentJob.objects.enqueue("capture")
    refund = PaymentJob.objects.enqueue("refund", after=[capture])
    assert PaymentJob.objects.filter(pk=refund.pk).cancel() == 1
    complete(capture)
    assert row(refund).status == Status.CANCELLED


@pytest.mark.django_db
def test_requeue__a_cancelled_dependent_requeued_waits_for_what_is_left() -> None:
    first, second = PaymentJob.objects.enqueue("noop"), PaymentJob.objects.enqueue("noop")
    dependent = PaymentJob.objects.enqueue("noop", after=[first, second])
    PaymentJob.objects.filter(pk=dependent.pk).cancel()
    complete(first)
    assert (row(dependent).status, row(dependent).unmet) == (Status.CANCELLED, 1)
    assert PaymentJob.objects.filter(pk=dependent.pk).requeue() == 1
    assert row(dependent).status == Status.WAITING
    complete(second)
    assert (row(dependent).status, row(dependent).unmet) == (Status.PENDING, 0)


# ---- locks -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue__a_dependent_of_a_lock_joins_its_line_once_released() -> None:
    holder = PaymentJob.objects.enqueue("noop", lock=LOCK)
    capture = PaymentJob.objects.enqueue("capture")
    refund = PaymentJob.objects.enqueue("refund", lock=LOCK, after=[capture])
    behind = PaymentJob.objects.enqueue("noop", lock=LOCK)
    assert [row(job).status for job in (holder, refund, behind)] == [
        Status.PENDING,
        Status.WAITING,
        Status.WAITING,
    ]
    # The lock passes over a job still waiting for its prerequisites.
    complete(holder)
    assert (row(refund).status, row(behind).status) == (Status.WAITING, Status.PENDING)
    # Released while the lock is held: it waits in the lock's line, then takes it.
    complete(capture)
    assert (row(refund).status, row(refund).unmet, row(refund).lock_holder) == (
        Status.WAITING,
        0,
        None,
    )
    complete(behind)
    assert (row(refund).status, row(refund).lock_holder) == (Status.PENDING, LOCK)


@pytest.mark.django_db
def test_enqueue__a_dependent_released_with_its_lock_free_takes_it() -> None:
    capture = PaymentJob.objects.enqueue("capture", payment_id="p1", lock="")
    refund = PaymentJob.objects.enqueue("refund", payment_id="p1", after=[capture])
    assert (row(refund).status, row(refund).lock) == (Status.WAITING, "payment:p1")
    complete(capture)
    assert (row(refund).status, row(refund).lock_holder) == (Status.PENDING, "payment:p1")
    later = PaymentJob.objects.enqueue("notify", payment_id="p1")
    assert row(later).status == Status.WAITING  # behind the refund, which holds the lock


@pytest.mark.django_db
def test_enqueue__a_refund_of_the_same_payment_waits_for_its_capture() -> None:
    capture = PaymentJob.objects.enqueue("capture", payment_id="p2")
    refund = PaymentJob.objects.enqueue("refund", payment_id="p2", after=[capture])
    assert (row(capture).status, row(refund).status) == (Status.PENDING, Status.WAITING)
    complete(capture)
    assert (row(refund).status, row(refund).lock_holder) == (Status.PENDING, "payment:p2")


# ---- a chain costs a claim nothing -----------------------------------------------------------


@pytest.mark.django_db
def test_claim__a_long_chain_waits_out_of_every_claims_sight() -> None:
    head = PaymentJob.objects.enqueue("noop")
    links = [head]
    for _ in range(200):
        links.append(PaymentJob.objects.enqueue("noop", after=[links[-1]]))
    plain = PaymentJob.objects.enqueue("noop")
    assert PaymentJob.objects.filter(status=Status.WAITING).count() == 200
    claimed = PaymentJob.objects.claim("w", ttl=60, limit=10)
    assert {job.pk for job in claimed} == {head.pk, plain.pk}
    PaymentJob.objects.complete(head.pk, "w", row(head).lease_token)
    pending = PaymentJob.objects.filter(status=Status.PENDING).values_list("pk", flat=True)
    assert list(pending) == [links[1].pk]  # the next link only


# ---- worker processes ---------------------------------------------------------------------------


def worker(processes: Processes, name: str, *args: str) -> Any:
    return processes.manage(
        "run_lease_worker", "--worker-id", name, "--poll-interval", "0.05", *args, "-v", "2"
    )


def all_completed(jobs: list[PaymentJob]) -> bool:
    pks = [job.pk for job in jobs]
    return PaymentJob.objects.filter(pk__in=pks, status=Status.COMPLETED).count() == len(pks)


def first_starts(pks: list[int]) -> dict[int, Any]:
    """When each job's handler first started, by the database clock (`LockRun.started_at`,
    the statement time of an INSERT the handler sends after its claim returned).

    Not the ledger's `claimed_at`: that is the claim statement's STATEMENT_TIMESTAMP(), the
    time PostgreSQL received it, which on a loaded server may come milliseconds before the
    statement takes the snapshot that saw its job released."""
    started: dict[int, Any] = {}
    for run in LockRun.objects.filter(job_ref__in=pks).order_by("started_at"):
        started.setdefault(run.job_ref, run.started_at)
    return started


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__prerequisites_completing_at_once_release_their_dependent_once(
    processes: Processes,
) -> None:
    groups = []
    for _ in range(12):
        pair = [
            PaymentJob.objects.enqueue("locked_step", {"seconds": 0.2}, priority=1)
            for _ in range(2)
        ]
        dependent = PaymentJob.objects.enqueue("locked_step", {"seconds": 0}, after=pair)
        groups.append((pair, dependent))
    everything = [job for pair, dependent in groups for job in (*pair, dependent)]
    # Two workers of one slot each: each takes one job of a pair (the pairs come first, by
    # priority), and the two complete at about the same moment.
    for n in range(2):
        worker(processes, f"racer-{n}", "--concurrency", "1", "--ttl", "30", "--heartbeat", "5")

    wait_for(lambda: all_completed(everything), timeout=120)

    runs = list(LockRun.objects.values_list("job_ref", flat=True))
    assert sorted(runs) == sorted(job.pk for job in everything)  # each ran exactly once
    started = first_starts([job.pk for job in everything])
    for pair, dependent in groups:
        done = PaymentJob.objects.filter(pk__in=[job.pk for job in pair])
        last = max(done.values_list("completed_at", flat=True))
        assert started[dependent.pk] >= last, dependent.pk
        assert row(dependent).attempts == 1
    owners = set(PaymentJob.objects.values_list("lease_owner", flat=True))
    assert owners == {"racer-0", "racer-1"}


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__a_chain_runs_link_after_link(processes: Processes) -> None:
    chain = [PaymentJob.objects.enqueue("locked_step", {"seconds": 0})]
    for _ in range(15):
        chain.append(PaymentJob.objects.enqueue("locked_step", {"seconds": 0}, after=[chain[-1]]))
    for n in range(2):
        worker(processes, f"chain-{n}", "--ttl", "30", "--heartbeat", "5")

    wait_for(lambda: all_completed(chain), timeout=120)

    started = first_starts([job.pk for job in chain])
    for before, after in zip(chain, chain[1:], strict=False):
        assert started[after.pk] >= row(before).completed_at, after.pk
    assert LockRun.objects.count() == len(chain)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__a_failed_prerequisite_holds_its_dependent(processes: Processes) -> None:
    failing = PaymentJob.objects.enqueue("permanent")
    dependent = PaymentJob.objects.enqueue("locked_step", {"seconds": 0}, after=[failing])
    worker(processes, "holder", "--ttl", "30", "--heartbeat", "5")
    wait_for(lambda: row(failing).status == Status.FAILED)
    # A job enqueued after the failure runs: the worker claimed past the held dependent.
    later = PaymentJob.objects.enqueue("locked_step", {"seconds": 0})
    wait_for(lambda: row(later).status == Status.COMPLETED)

    assert (row(dependent).status, row(dependent).unmet) == (Status.WAITING, 1)
    assert not LockRun.objects.filter(job_ref=dependent.pk).exists()


# ---- admin -------------------------------------------------------------------------------------


def change_page(client: Any, job: PaymentJob) -> str:
    url = reverse("admin:django_leases_paymentjob_change", args=[job.pk])
    response = client.get(url)
    assert response.status_code == 200
    return str(response.content.decode())


@pytest.mark.django_db
def test_admin__a_job_page_shows_what_it_waits_for_and_what_waits_on_it(admin_client: Any) -> None:
    capture, webhook = PaymentJob.objects.enqueue("capture"), PaymentJob.objects.enqueue("hook")
    refund = PaymentJob.objects.enqueue("refund", after=[capture, webhook])
    complete(webhook)
    page = change_page(admin_client, refund)
    capture_url = reverse("admin:django_leases_paymentjob_change", args=[capture.pk])
    assert f'<a href="{capture_url}">#{capture.pk}</a> (Pending)' in page
    assert f"#{webhook.pk}</a> (Completed)" in page
    assert "waiting for 1 of them" in page
    refund_url = reverse("admin:django_leases_paymentjob_change", args=[refund.pk])
    assert f'<a href="{refund_url}">#{refund.pk}</a> (Waiting for its lock)' in change_page(
        admin_client, capture
    )


@pytest.mark.django_db
def test_admin__a_dependent_held_by_a_failed_prerequisite_says_so(admin_client: Any) -> None:
    capture = PaymentJob.objects.enqueue("capture")
    refund = PaymentJob.objects.enqueue("refund", after=[capture])
    held = claim(capture.pk)
    PaymentJob.objects.fail(held.pk, "w", held.lease_token, "declined", permanent=True)
    page = change_page(admin_client, refund)
    assert f"#{capture.pk}</a> (Failed)" in page
    assert "held: a prerequisite failed or was cancelled" in page
    assert "waiting for the jobs it was enqueued after" in page


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__a_prerequisite_whose_worker_is_killed_releases_its_dependent_once_rerun(
    processes: Processes,
) -> None:
    # The first attempt runs long enough to be killed; the rerun returns at once.
    capture = PaymentJob.objects.enqueue("locked_step", {"durations": [60, 0]})
    refund = PaymentJob.objects.enqueue("locked_step", {"seconds": 0}, after=[capture])
    victim = worker(processes, "victim", "--ttl", "2", "--heartbeat", "0.5")
    wait_for(lambda: LockRun.objects.filter(job_ref=capture.pk).exists())
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert (row(capture).status, row(refund).status) == (Status.PROCESSING, Status.WAITING)

    worker(processes, "heir", "--ttl", "2", "--heartbeat", "0.5")
    wait_for(lambda: all_completed([capture, refund]), timeout=60)

    lost, rerun = JobAttempt.objects.filter(job_ref=capture.pk).order_by("token")
    assert (lost.outcome, rerun.owner, rerun.outcome) == ("lease_lost", "heir", "completed")
    (after,) = JobAttempt.objects.filter(job_ref=refund.pk)
    assert after.claimed_at >= row(capture).completed_at
    assert LockRun.objects.filter(job_ref=refund.pk).count() == 1


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("pause", ["before_commit", "after_commit"])
def test_workers__sigkill_around_the_completing_commit_releases_the_dependent_once(
    processes: Processes, tmp_path: Path, pause: str
) -> None:
    # The prerequisite's worker is killed inside its completing transaction, right after the
    # statement that released the dependent (nothing of it commits: the prerequisite runs
    # again, and its rerun releases the dependent), or right after that commit (both the
    # completion and the release stand). Either way the dependent runs once, after it.
    marker = tmp_path / "paused"
    payload = {"marker": str(marker), "seconds": 60, "pause": pause}
    capture = PaymentJob.objects.enqueue("releases_then_pauses", payload)
    refund = PaymentJob.objects.enqueue("locked_step", {"seconds": 0}, after=[capture])
    # One slot: the victim cannot take the dependent while it pauses.
    victim = worker(processes, "victim", "--concurrency", "1", "--ttl", "2", "--heartbeat", "0.5")
    wait_for(marker.exists, timeout=60)
    committed = pause == "after_commit"
    seen = (
        (Status.COMPLETED, Status.PENDING, 0)
        if committed
        else (Status.PROCESSING, Status.WAITING, 1)
    )
    assert (row(capture).status, row(refund).status, row(refund).unmet) == seen
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert (row(capture).status, row(refund).status, row(refund).unmet) == seen

    worker(processes, "heir", "--ttl", "2", "--heartbeat", "0.5")
    wait_for(lambda: all_completed([capture, refund]), timeout=60)

    ledger = JobAttempt.objects.filter(job_ref=capture.pk).order_by("attempt")
    outcomes = [(attempt.owner, attempt.outcome) for attempt in ledger]
    if committed:
        assert outcomes == [("victim", "completed")]
    else:
        assert outcomes == [("victim", "lease_lost"), ("heir", "completed")]
    # The victim's own write rolled back with its uncommitted completion, or stands with it.
    assert LockRun.objects.filter(job_ref=capture.pk).count() == 1
    (after,) = JobAttempt.objects.filter(job_ref=refund.pk)
    assert (after.owner, after.outcome, row(refund).attempts) == ("heir", "completed", 1)
    assert LockRun.objects.filter(job_ref=refund.pk).count() == 1
    assert first_starts([refund.pk])[refund.pk] >= row(capture).completed_at
