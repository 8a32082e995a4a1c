"""Completions written together with the slots' next claims: `GroupCommit` (flat combining),
`complete_and_claim()` on the three databases, and the worker that uses them."""

import threading
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from django_leases.exceptions import InvalidArgument
from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets.claims import Claimer
from django_leases.worker import LeaseWorker
from django_leases.worker.group_commit import GroupCommit

from .conftest import wait_for
from .leasing import expire, ledger, statements, token_of

Status = PaymentJob.Status

# ---- GroupCommit ------------------------------------------------------------------------------


def submit_all(group: GroupCommit[int, int], items: list[int]) -> list[threading.Thread]:
    threads = [threading.Thread(target=group.submit, args=(item,)) for item in items]
    for thread in threads:
        thread.start()
    return threads


def test_group_commit__items_waiting_during_a_write_are_written_together() -> None:
    batches: list[list[int]] = []
    first_write = threading.Event()
    go_on = threading.Event()

    def write(items: list[int]) -> list[int]:
        batches.append(items)
        if len(batches) == 1:
            first_write.set()
            assert go_on.wait(timeout=30)
        return [item * 10 for item in items]

    group: GroupCommit[int, int] = GroupCommit(write)
    results: dict[int, int] = {}

    def run(item: int) -> None:
        results[item] = group.submit(item)

    first = threading.Thread(target=run, args=(0,))
    first.start()
    assert first_write.wait(timeout=30)
    others = [threading.Thread(target=run, args=(item,)) for item in range(1, 6)]
    for thread in others:
        thread.start()
    wait_for(lambda: len(group._waiting) == 5)  # all five wait while the first write runs
    go_on.set()
    for thread in [first, *others]:
        thread.join(timeout=30)
    assert batches[0] == [0]
    assert sorted(batches[1]) == [1, 2, 3, 4, 5] and len(batches) == 2
    assert results == {item: item * 10 for item in range(6)}


def test_group_commit__a_lone_item_is_written_at_once() -> None:
    group: GroupCommit[str, str] = GroupCommit(lambda items: [item.upper() for item in items])
    assert [group.submit("a"), group.submit("b")] == ["A", "B"]


def test_group_commit__an_error_reaches_every_thread_of_its_batch_and_the_next_write_runs() -> None:
    failing = threading.Event()
    released = threading.Event()
    writes: list[list[int]] = []

    def write(items: list[int]) -> list[int]:
        writes.append(items)
        if len(writes) == 2:
            raise RuntimeError("refused")
        if len(writes) == 1:
            failing.set()
            assert released.wait(timeout=30)
        return items

    group: GroupCommit[int, int] = GroupCommit(write)
    errors: list[str] = []

    def run(item: int) -> None:
        try:
            group.submit(item)
        except RuntimeError as exc:
            errors.append(f"{item}: {exc}")

    first = threading.Thread(target=run, args=(0,))
    first.start()
    assert failing.wait(timeout=30)
    others = [threading.Thread(target=run, args=(item,)) for item in (1, 2)]
    for thread in others:
        thread.start()
    wait_for(lambda: len(group._waiting) == 2)
    released.set()
    for thread in [first, *others]:
        thread.join(timeout=30)
    assert sorted(errors) == ["1: refused", "2: refused"]
    assert group.submit(3) == 3


def test_group_commit__a_write_with_the_wrong_number_of_results_raises() -> None:
    group: GroupCommit[int, int] = GroupCommit(lambda items: [])
    with pytest.raises(RuntimeError, match="0 results for 1 items"):
        group.submit(1)


# ---- complete_and_claim ----------------------------------------------------------------------


@pytest.mark.django_db
def test_complete_and_claim__completes_the_rows_still_held_and_claims_the_next() -> None:
    held_jobs = [PaymentJob.objects.enqueue("noop") for _ in range(5)]
    held = {job.pk: job.lease_token for job in PaymentJob.objects.claim("w1", ttl=60, limit=5)}
    ok, taken, stale, mine_expired, stale_expired = held_jobs
    expire(taken)
    assert PaymentJob.objects.claim_job(taken.pk, "w2", ttl=60) is not None
    expire(mine_expired)  # expired, not taken over: the holder's completion still wins
    expire(stale_expired)  # and acknowledged under a token it never had: refused, claimable
    acks = {**held, stale.pk: held[stale.pk] + 5, stale_expired.pk: held[stale_expired.pk] + 5}
    due = [PaymentJob.objects.enqueue("noop", priority=p) for p in (0, 5, 0)]
    other_kind = PaymentJob.objects.enqueue("noop_batch", priority=9)

    won, claimed = PaymentJob.objects.complete_and_claim(
        "w1", acks, ttl=60, limit=3, kinds=["noop"]
    )

    assert won == {(ok.pk, held[ok.pk]), (mine_expired.pk, held[mine_expired.pk])}
    # Claim order: expired leases first, then priority; never a job this call completed (on
    # PostgreSQL the same statement), nor another kind. A refused one is taken over, as after
    # complete_many() then claim().
    assert [job.pk for job in claimed] == [stale_expired.pk, due[1].pk, due[0].pk]
    assert all(job.lease_owner == "w1" and job.status == Status.PROCESSING for job in claimed)
    rows = {job.pk: job for job in PaymentJob.objects.all()}
    assert rows[ok.pk].status == rows[mine_expired.pk].status == Status.COMPLETED
    assert (rows[taken.pk].lease_owner, rows[stale.pk].status) == ("w2", Status.PROCESSING)
    assert (rows[stale_expired.pk].lease_token, rows[stale_expired.pk].attempts) == (
        token_of(stale_expired, 2),
        2,
    )
    assert rows[due[2].pk].status == rows[other_kind.pk].status == Status.PENDING
    assert ledger(ok) == ledger(mine_expired) == [(1, 1, "w1", "completed")]
    assert ledger(taken) == [(1, 1, "w1", "lease_lost"), (2, 2, "w2", "running")]
    assert ledger(stale) == [(1, 1, "w1", "running")]
    assert ledger(stale_expired) == [(1, 1, "w1", "lease_lost"), (2, 2, "w1", "running")]
    assert ledger(due[1]) == ledger(due[0]) == [(1, 1, "w1", "running")]
    fenced = JobAttempt.objects.filter(fenced_at__isnull=False)
    assert set(fenced.values_list("job_ref", "attempt")) == {
        (taken.pk, 1)
    }  # none had the stale tokens


@pytest.mark.django_db
def test_complete_and_claim__one_statement_on_postgresql_and_nothing_left_to_claim() -> None:
    PaymentJob.objects.enqueue("noop")
    (job,) = PaymentJob.objects.claim("w1", ttl=60)
    with CaptureQueriesContext(connection) as ctx:
        won, claimed = PaymentJob.objects.complete_and_claim(
            "w1", {job.pk: job.lease_token}, ttl=60, limit=3
        )
    assert (won, claimed) == ({(job.pk, job.lease_token)}, [])
    # PostgreSQL: one statement; elsewhere complete_many()'s and claim()'s.
    if connection.vendor == "postgresql":
        assert len(statements(ctx)) == 1
    assert ledger(job) == [(1, 1, "w1", "completed")]
    assert PaymentJob.objects.complete_and_claim("w1", {}, ttl=60, kinds=[]) == (set(), [])


@pytest.mark.django_db
def test_complete_and_claim__refuses_bad_input_and_writes_nothing() -> None:
    PaymentJob.objects.enqueue("noop")
    (job,) = PaymentJob.objects.claim("w1", ttl=60)
    PaymentJob.objects.enqueue("noop")
    good = {job.pk: job.lease_token}
    calls: list[Callable[[], object]] = [
        lambda: PaymentJob.objects.complete_and_claim("w1", good, ttl=60, limit=0),
        lambda: PaymentJob.objects.complete_and_claim("", good, ttl=60),
        lambda: PaymentJob.objects.complete_and_claim("w1", good, ttl=-1),
        lambda: PaymentJob.objects.complete_and_claim("w1", good, ttl=60, kinds=[""]),
        lambda: PaymentJob.objects.complete_and_claim("w1", {job.pk: "1"}, ttl=60),  # type: ignore[dict-item]
        lambda: PaymentJob.objects.complete_and_claim("w1", {-1: 1}, ttl=60),
    ]
    for call in calls:
        with pytest.raises(InvalidArgument):
            call()
    assert list(PaymentJob.objects.values_list("status", flat=True).order_by("pk")) == [
        Status.PROCESSING,
        Status.PENDING,
    ]
    assert JobAttempt.objects.count() == 1 and ledger(job) == [(1, 1, "w1", "running")]


# ---- the worker --------------------------------------------------------------------------------


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__slots_complete_and_claim_their_next_jobs_together() -> None:
    jobs = [PaymentJob.objects.enqueue("noop") for _ in range(60)]
    locked = PaymentJob.objects.enqueue("noop", lock="order:1")
    groups: list[tuple[int, int]] = []
    real = Claimer.complete_and_claim

    def spy(self: Claimer[Any], leases: list[Any], limit: int, **kwargs: bool) -> object:
        won, claimed = real(self, leases, limit, **kwargs)
        groups.append((len(leases), len(claimed)))
        return won, claimed

    with mock.patch.object(Claimer, "complete_and_claim", spy):
        stats = LeaseWorker(
            worker_id="w", burst=True, concurrency=4, ttl=30, heartbeat=5, poll_interval=0.05
        ).run()

    assert (stats.claimed, stats.completed, stats.lost, stats.failed) == (61, 61, 0, 0)
    for job in [*jobs, locked]:
        assert ledger(job) == [(1, 1, "w", "completed")]
    assert PaymentJob.objects.exclude(status=Status.COMPLETED).count() == 0
    # Most jobs were claimed by a completion, not by the claim loop; the locked job's
    # completion went in a group write like any other (the write passes its lock on).
    assert sum(claimed for _, claimed in groups) > 30
    assert sum(completed for completed, _ in groups) == 61


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__with_max_jobs_claims_only_in_its_loop() -> None:
    for _ in range(5):
        PaymentJob.objects.enqueue("noop")
    with mock.patch.object(Claimer, "complete_and_claim") as combined:
        stats = LeaseWorker(
            worker_id="w", max_jobs=3, concurrency=2, ttl=30, heartbeat=5, poll_interval=0.05
        ).run()
    combined.assert_not_called()
    assert (stats.claimed, stats.completed) == (3, 3)
    assert PaymentJob.objects.filter(status=Status.PENDING).count() == 2
