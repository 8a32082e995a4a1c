"""Groups: `enqueue_group(members, then=...)` runs its callback once every member has ended.

The unit tests drive each way a member ends through the queryset API; the process tests race
real `run_lease_worker` processes over members that end at the same moment, and kill one
mid-run, on whichever database DATABASE_URL names.
"""

import signal
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.urls import reverse

from django_leases.exceptions import IdempotencyKeyReused, InvalidArgument, LeaseError
from django_leases.lease import Lease
from django_leases.models import PaymentJob
from django_leases.querysets.groups import MAX_GROUP_MEMBERS, GroupMember
from tests.testapp.models import LockRun

from .conftest import Processes, wait_for
from .test_dependencies import change_page, claim, complete, row, worker

Status = PaymentJob.Status


def fail(job: PaymentJob, error: str = "declined") -> None:
    held = claim(job.pk)
    PaymentJob.objects.fail(held.pk, "w", held.lease_token, error, permanent=True)


def three() -> Any:
    return PaymentJob.objects.enqueue_group(
        [{"kind": "capture"}, {"kind": "capture", "payload": {"n": 2}}, {"kind": "refund"}],
        then="payout",
        payload={"batch": 7},
    )


# ---- enqueue -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_enqueue_group__members_run_and_the_callback_waits_for_every_one() -> None:
    group = three()
    pks = [job.pk for job in group.members]
    callback = row(group.callback)
    assert [row(job).status for job in group.members] == [Status.PENDING] * 3
    assert row(group.members[1]).payload == {"n": 2}
    assert (callback.kind, callback.payload, callback.status) == ("payout", {"batch": 7}, "waiting")
    assert (callback.waits_for, callback.unmet, callback.group_results) == (pks, 3, {})
    assert [row(job).dependents for job in group.members] == [[callback.pk]] * 3
    claimed = PaymentJob.objects.claim("w", ttl=60, limit=10)
    assert {job.pk for job in claimed} == set(pks)  # the callback is out of sight


@pytest.mark.django_db
def test_enqueue_group__released_by_the_last_end_with_how_each_ended() -> None:
    first, second, third = (group := three()).members
    complete(first)
    fail(second, "card declined")
    assert (row(group.callback).status, row(group.callback).unmet) == (Status.WAITING, 1)
    assert PaymentJob.objects.filter(pk=third.pk).cancel(reason="no longer wanted") == 1
    released = row(group.callback)
    assert (released.status, released.unmet) == (Status.PENDING, 0)

    held = claim(group.callback.pk)
    assert Lease(held, ttl=60).group() == [
        GroupMember(first.pk, "capture", Status.COMPLETED, ""),
        GroupMember(second.pk, "capture", Status.FAILED, "card declined"),
        GroupMember(
            third.pk, "refund", Status.CANCELLED, "cancelled by operator: no longer wanted"
        ),
    ]


@pytest.mark.django_db
def test_claim__hands_the_callback_its_results_with_the_row() -> None:
    group = PaymentJob.objects.enqueue_group([{"kind": "capture"}], then="payout")
    complete(group.members[0])
    (held,) = PaymentJob.objects.claim("w", ttl=60)
    assert held.pk == group.callback.pk
    assert Lease(held, ttl=60).group() == [
        GroupMember(group.members[0].pk, "capture", "completed", "")
    ]


@pytest.mark.django_db
def test_lease_group__of_a_job_that_is_no_callback_raises() -> None:
    job = PaymentJob.objects.enqueue("capture")
    with pytest.raises(LeaseError, match=f"job {job.pk} of kind 'capture' is no group's callback"):
        Lease(claim(job.pk), ttl=60).group()


@pytest.mark.django_db
def test_enqueue_group__members_may_wait_for_others_and_share_a_lock() -> None:
    before = PaymentJob.objects.enqueue("capture")
    group = PaymentJob.objects.enqueue_group(
        [
            {"kind": "refund", "after": [before]},
            {"kind": "notify", "lock": "L"},
            {"kind": "notify", "lock": "L"},
            {"kind": "notify", "payment_id": "p9"},
        ],
        then="payout",
        lock="L",
    )
    after, first, second, payment = group.members
    assert [row(job).status for job in group.members] == [
        "waiting",
        "pending",
        "waiting",
        "pending",
    ]
    assert (row(payment).lock, row(group.callback).lock) == ("payment:p9", "L")
    for job in (before, after, first, second, payment):
        complete(job)
    # Released with its lock free: it takes it.
    assert (row(group.callback).status, row(group.callback).lock_holder) == (Status.PENDING, "L")


@pytest.mark.django_db
def test_enqueue_group__a_callback_released_while_its_lock_is_held_waits_in_line() -> None:
    holder = PaymentJob.objects.enqueue("capture", lock="L")
    group = PaymentJob.objects.enqueue_group([{"kind": "refund"}], then="payout", lock="L")
    complete(group.members[0])
    assert (row(group.callback).status, row(group.callback).unmet) == (Status.WAITING, 0)
    complete(holder)
    assert (row(group.callback).status, row(group.callback).lock_holder) == (Status.PENDING, "L")


@pytest.mark.django_db
def test_enqueue_group__a_member_found_ended_by_its_key_counts_at_once() -> None:
    done = PaymentJob.objects.enqueue("capture", idempotency_key="cap-1")
    fail(done)
    group = PaymentJob.objects.enqueue_group(
        [{"kind": "capture", "idempotency_key": "cap-1"}], then="payout"
    )
    assert group.members[0].pk == done.pk
    callback = row(group.callback)
    assert (callback.status, callback.unmet) == (Status.PENDING, 0)
    assert callback.group_results == {
        str(done.pk): {
            "pk": done.pk,
            "kind": "capture",
            "status": "failed",
            "last_error": "declined",
        }
    }
    assert row(done).dependents is None  # ended: nothing to tell it


@pytest.mark.django_db
def test_enqueue_group__the_callbacks_key_returns_its_group_and_enqueues_nothing() -> None:
    group = PaymentJob.objects.enqueue_group(
        [{"kind": "capture"}, {"kind": "refund"}], then="payout", idempotency_key="g-1"
    )
    again = PaymentJob.objects.enqueue_group(
        [{"kind": "capture"}, {"kind": "refund"}], then="payout", idempotency_key="g-1"
    )
    assert again.callback.pk == group.callback.pk
    assert [job.pk for job in again.members] == [job.pk for job in group.members]
    assert PaymentJob.objects.count() == 3
    with pytest.raises(IdempotencyKeyReused, match="idempotency_key 'g-1'"):
        PaymentJob.objects.enqueue_group(
            [{"kind": "capture"}], then="payout", payload={"other": 1}, idempotency_key="g-1"
        )
    plain = PaymentJob.objects.enqueue("payout", idempotency_key="plain")
    with pytest.raises(
        InvalidArgument, match=f"names job {plain.pk}, which is not a group's callback"
    ):
        PaymentJob.objects.enqueue_group(
            [{"kind": "capture"}], then="payout", idempotency_key="plain"
        )
    assert PaymentJob.objects.count() == 4


@pytest.mark.django_db(transaction=True)
def test_aenqueue_group__enqueues_as_enqueue_group_does() -> None:
    @async_to_sync
    async def aenqueue(members: list[dict[str, Any]]) -> Any:
        return await PaymentJob.objects.aenqueue_group(members, "payout", {"batch": 1})

    group = aenqueue([{"kind": "capture"}, {"kind": "refund"}])
    assert row(group.callback).waits_for == [job.pk for job in group.members]
    assert (row(group.callback).status, row(group.callback).payload) == ("waiting", {"batch": 1})
    with pytest.raises(InvalidArgument, match="members is empty"):
        aenqueue([])


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("members", "options", "message"),
    [
        ([], {}, "members is empty: a group needs a member to wait for"),
        ({"kind": "capture"}, {}, "members must be a list of dicts of enqueue() arguments"),
        ("capture", {}, "members must be a list of dicts of enqueue() arguments, got 'capture'"),
        ([{"kind": "capture"}, 7], {}, "members[1]: expected a dict of enqueue() arguments"),
        ([{"payload": {}}], {}, "members[0]: expected a dict of enqueue() arguments with a kind"),
        ([{"kind": "capture"}, {"kind": ""}], {}, "members[1]: kind"),
        ([{"kind": "capture", "priority": "high"}], {}, "members[0]: priority"),
        ([{"kind": "capture", "after": [999_999]}], {}, "members[0]: after: no job 999999"),
        (
            [{"kind": "capture"}],
            {"after": [1]},
            "callback: a group's callback waits for its members",
        ),
        ([{"kind": "capture"}], {"max_attempts": 0}, "callback: max_attempts"),
        ([{"kind": "capture"}], {"payload": {1j}}, "callback: payload"),
        ([{"kind": "capture"}] * (MAX_GROUP_MEMBERS + 1), {}, "members has 501 jobs; at most 500"),
    ],
)
def test_enqueue_group__refuses_bad_input_and_writes_nothing(
    members: Any, options: dict[str, Any], message: str
) -> None:
    options = {"payload": None, **options}
    with pytest.raises(InvalidArgument) as caught:
        PaymentJob.objects.enqueue_group(members, "payout", **options)
    assert str(caught.value).startswith(message), str(caught.value)
    assert PaymentJob.objects.count() == 0


@pytest.mark.django_db
def test_enqueue_group__refuses_a_bad_callback_kind_and_writes_nothing() -> None:
    with pytest.raises(InvalidArgument, match="^callback: kind"):
        PaymentJob.objects.enqueue_group([{"kind": "capture"}], "")
    assert PaymentJob.objects.count() == 0


@pytest.mark.django_db(databases=["default", "other"])
def test_enqueue_group__a_member_of_another_database_is_refused() -> None:
    with pytest.raises(
        InvalidArgument,
        match=r"^members\[1\]: using='other', the group goes to 'default': a group's jobs share",
    ):
        PaymentJob.objects.enqueue_group(
            [{"kind": "capture"}, {"kind": "refund", "using": "other"}], then="payout"
        )
    elsewhere = PaymentJob.objects.enqueue("capture", using="other")
    with pytest.raises(InvalidArgument, match=r"^members\[0\]: after: job \d+ is on database"):
        PaymentJob.objects.enqueue_group([{"kind": "refund", "after": [elsewhere]}], then="payout")
    assert PaymentJob.objects.count() == 0
    group = PaymentJob.objects.enqueue_group(
        [{"kind": "capture", "using": "other"}], then="payout", using="other"
    )
    assert group.callback._state.db == "other"
    assert PaymentJob.objects.using("other").get(pk=group.callback.pk).unmet == 1


# ---- each way a member ends --------------------------------------------------------------------


def one_member(**member: Any) -> Any:
    return PaymentJob.objects.enqueue_group([{"kind": "capture", **member}], then="payout")


@pytest.mark.django_db
def test_fail__a_retried_member_has_not_ended_its_last_attempt_has() -> None:
    group = one_member(max_attempts=2)
    held = claim(group.members[0].pk)
    PaymentJob.objects.fail(held.pk, "w", held.lease_token, "timeout at the PSP", retry_in=0.001)
    assert (row(group.members[0]).status, row(group.callback).unmet) == (Status.PENDING, 1)
    held = claim(group.members[0].pk)
    PaymentJob.objects.fail(held.pk, "w", held.lease_token, "timeout at the PSP", retry_in=0.001)
    assert row(group.callback).status == Status.PENDING
    assert row(group.callback).group_results[str(held.pk)]["status"] == Status.FAILED


@pytest.mark.django_db
def test_time_out__a_member_out_of_attempts_ends_it() -> None:
    group = one_member(max_attempts=1)
    held = claim(group.members[0].pk)
    assert PaymentJob.objects.time_out(held.pk, "w", held.lease_token, retry_in=1, reason="5s") == (
        Status.FAILED
    )
    assert row(group.callback).status == Status.PENDING


@pytest.mark.django_db
def test_cancel__a_running_member_ends_when_its_holder_stops() -> None:
    group = one_member()
    held = claim(group.members[0].pk)
    assert PaymentJob.objects.filter(pk=held.pk).cancel() == 1
    # Stopping: its handler may still run; the callback waits for the end of its execution.
    assert (row(held).status, row(group.callback).status) == (Status.STOPPING, Status.WAITING)
    PaymentJob.objects.acknowledge_stops("w", [(held.pk, held.lease_token)])
    assert (row(held).status, row(group.callback).status) == (Status.CANCELLED, Status.PENDING)


@pytest.mark.django_db
def test_operators__mark_failed_and_resolve_review_end_members_under_review_does_not() -> None:
    group = PaymentJob.objects.enqueue_group(
        [{"kind": "capture"}, {"kind": "capture"}], then="payout"
    )
    first, second = group.members
    assert PaymentJob.objects.filter(pk=first.pk).mark_failed(reason="by hand") == 1
    PaymentJob.objects.filter(pk=second.pk).update(status=Status.REVIEW)
    assert row(group.callback).unmet == 1
    PaymentJob.objects.filter(pk=second.pk).resolve_review("retry")
    assert (row(second).status, row(group.callback).unmet) == (Status.PENDING, 1)
    PaymentJob.objects.filter(pk=second.pk).update(status=Status.REVIEW)
    PaymentJob.objects.filter(pk=second.pk).resolve_review("completed")
    callback = row(group.callback)
    assert (callback.status, callback.unmet) == (Status.PENDING, 0)
    assert [callback.group_results[str(job.pk)]["status"] for job in (first, second)] == [
        Status.FAILED,
        Status.COMPLETED,
    ]


@pytest.mark.django_db
def test_requeue__a_member_requeued_before_the_release_is_waited_for_again() -> None:
    group = PaymentJob.objects.enqueue_group(
        [{"kind": "capture"}, {"kind": "capture"}], then="payout"
    )
    first, second = group.members
    fail(first)
    assert row(group.callback).unmet == 1
    assert PaymentJob.objects.filter(pk=first.pk).requeue() == 1
    callback = row(group.callback)
    assert (callback.unmet, callback.group_results) == (2, {})
    complete(second)
    assert (row(group.callback).status, row(group.callback).unmet) == (Status.WAITING, 1)
    complete(first)
    callback = row(group.callback)
    assert (callback.status, callback.unmet) == (Status.PENDING, 0)
    assert callback.group_results[str(first.pk)]["status"] == Status.COMPLETED


@pytest.mark.django_db
def test_requeue__once_released_the_results_no_longer_change() -> None:
    group = one_member()
    fail(group.members[0])
    released = row(group.callback).group_results
    assert PaymentJob.objects.filter(pk=group.members[0].pk).requeue() == 1
    complete(group.members[0])
    callback = row(group.callback)
    assert (callback.status, callback.unmet, callback.group_results) == ("pending", 0, released)


@pytest.mark.django_db
def test_cancel__a_cancelled_callback_counts_on_and_requeued_runs_when_all_ended() -> None:
    group = PaymentJob.objects.enqueue_group(
        [{"kind": "capture"}, {"kind": "capture"}], then="payout"
    )
    assert PaymentJob.objects.filter(pk=group.callback.pk).cancel() == 1
    complete(group.members[0])
    assert (row(group.callback).status, row(group.callback).unmet) == (Status.CANCELLED, 1)
    assert PaymentJob.objects.filter(pk=group.callback.pk).requeue() == 1
    assert row(group.callback).status == Status.WAITING
    complete(group.members[1])
    assert row(group.callback).status == Status.PENDING


@pytest.mark.django_db
def test_complete_many__members_ending_in_one_batch_release_the_callback_once() -> None:
    group = three()
    held = [claim(job.pk) for job in group.members]
    won = PaymentJob.objects.complete_many("w", [(job.pk, job.lease_token) for job in held])
    assert len(won) == 3
    callback = row(group.callback)
    assert (callback.status, callback.unmet, len(callback.group_results)) == ("pending", 0, 3)


# ---- admin -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_admin__the_callback_and_its_members_show_the_group(admin_client: Any) -> None:
    group = PaymentJob.objects.enqueue_group(
        [{"kind": "capture"}, {"kind": "refund"}], then="payout"
    )
    first, second = group.members
    fail(first, "card declined")
    page = change_page(admin_client, group.callback)
    assert f"#{first.pk}</a> (Failed)" in page and f"#{second.pk}</a> (Pending)" in page
    assert "callback of 2 members, 1 not ended" in page
    assert f"#{first.pk}: Failed card declined" in page
    assert "held: a prerequisite failed" not in page  # a callback counts every end
    callback_url = reverse("admin:django_leases_paymentjob_change", args=[group.callback.pk])
    member_page = change_page(admin_client, second)
    assert f'member of the group of <a href="{callback_url}">#{group.callback.pk}</a>' in (
        member_page
    )


# ---- worker processes ---------------------------------------------------------------------------


def all_ended(jobs: list[PaymentJob]) -> bool:
    pks = [job.pk for job in jobs]
    ended = PaymentJob.objects.filter(pk__in=pks, status__in=["completed", "failed", "cancelled"])
    return ended.count() == len(pks)


def check_ran_once_after(group: Any, statuses: list[str]) -> None:
    """The callback's handler ran once, after every member ended, and read how each ended."""
    callback = row(group.callback)
    runs = list(LockRun.objects.filter(job_ref=callback.pk))
    assert len(runs) == 1, callback.pk
    assert (callback.status, callback.attempts) == (Status.COMPLETED, 1)
    members = [row(job) for job in group.members]
    assert runs[0].started_at >= max(job.completed_at for job in members), callback.pk
    assert [(m["pk"], m["status"]) for m in callback.result] == [
        (job.pk, status) for job, status in zip(members, statuses, strict=True)
    ]
    assert [job.status for job in members] == statuses


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__members_ending_at_once_release_their_callback_once(
    processes: Processes,
) -> None:
    groups = []
    for n in range(10):
        # Each pair's second member fails in every other group: a failure is an end too.
        second = {"kind": "permanent"} if n % 2 else {"kind": "locked_step"}
        members = [
            {"kind": "locked_step", "payload": {"seconds": 0.2}, "priority": 1},
            {**second, "payload": {"seconds": 0.2}, "priority": 1},
        ]
        groups.append(PaymentJob.objects.enqueue_group(members, then="group_callback"))
    # Two workers of one slot each: each takes one member of a pair (the members come first,
    # by priority), and the two end at about the same moment.
    for n in range(2):
        worker(processes, f"racer-{n}", "--concurrency", "1", "--ttl", "30", "--heartbeat", "5")

    wait_for(lambda: all_ended([group.callback for group in groups]), timeout=120)

    for n, group in enumerate(groups):
        check_ran_once_after(group, ["completed", "failed" if n % 2 else "completed"])
    owners = set(PaymentJob.objects.values_list("lease_owner", flat=True))
    assert owners == {"racer-0", "racer-1"}


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__a_worker_killed_mid_run_leaves_the_callback_to_run_once(
    processes: Processes,
) -> None:
    # Each member's first attempt runs long enough to be killed; its rerun returns at once.
    group = PaymentJob.objects.enqueue_group(
        [
            {"kind": "locked_step", "payload": {"durations": [60, 0]}},
            {"kind": "locked_step", "payload": {"durations": [60, 0]}},
            {"kind": "locked_step", "payload": {"seconds": 0}},
        ],
        then="group_callback",
    )
    victim = worker(processes, "victim", "--ttl", "2", "--heartbeat", "0.5", "--concurrency", "3")
    slow = [job.pk for job in group.members[:2]]
    wait_for(lambda: LockRun.objects.filter(job_ref__in=slow).count() == 2)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert row(group.callback).status == Status.WAITING

    worker(processes, "heir", "--ttl", "2", "--heartbeat", "0.5")
    wait_for(lambda: all_ended([group.callback]), timeout=60)

    check_ran_once_after(group, ["completed"] * 3)
    assert LockRun.objects.filter(job_ref__in=slow).count() == 4  # killed once, rerun once
    assert row(group.callback).lease_owner == "heir"
