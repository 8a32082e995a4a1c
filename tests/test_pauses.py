"""Pausing a kind: `pause_kind()` / `resume_kind()`, the claims that leave paused kinds out, the
worker that starts no job of a paused kind (claimed ahead or racing the pause), the commands and
the admin."""

import subprocess
import time
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.test import Client, override_settings
from django.urls import reverse

from django_leases.exceptions import InvalidArgument
from django_leases.lease import Lease
from django_leases.models import JobAttempt, KindEvent, PausedKind, PaymentJob
from django_leases.querysets.pauses import FRESH_CLAIM
from django_leases.schedules import enqueue_due
from django_leases.worker import LeaseWorker
from tests.test_batch_acks import claimed_ahead

from . import throttled
from .conftest import Processes, finish, read_until, wait_for
from .testapp.models import Charge
from .ticking import begin

Status = PaymentJob.Status
FAST = ("--poll-interval", "0.1")
JOBS = PaymentJob.objects


def outcomes(job: PaymentJob) -> list[tuple[str, str]]:
    rows = JobAttempt.objects.filter(job_ref=job.pk).order_by("token")
    return list(rows.values_list("owner", "outcome"))


def status(job: PaymentJob) -> str:
    return str(JOBS.values_list("status", flat=True).get(pk=job.pk))


def worker(processes: Processes, name: str, *args: str) -> subprocess.Popen[str]:
    return processes.manage("run_lease_worker", "--worker-id", name, *FAST, *args, "-v", "2")


# ---- the queryset functions ---------------------------------------------------------------


@pytest.mark.django_db
def test_pause_kind__writes_the_row_and_its_event_once() -> None:
    assert JOBS.pause_kind("noop", by="alice", reason="psp outage") is True
    assert JOBS.pause_kind("noop", by="bob") is False  # paused already: nothing written
    row = PausedKind.objects.get()
    assert (row.job_model, row.kind, row.paused_by, row.reason) == (
        "django_leases.paymentjob",
        "noop",
        "alice",
        "psp outage",
    )
    assert row.paused_at is not None
    assert JOBS.paused_kinds() == {"noop"}
    assert JOBS.resume_kind("noop", by="carol", reason="psp back") is True
    assert JOBS.resume_kind("noop", by="carol") is False
    assert not PausedKind.objects.exists()
    events = KindEvent.objects.order_by("id").values_list("kind", "action", "by", "reason")
    assert list(events) == [
        ("noop", "paused", "alice", "psp outage"),
        ("noop", "resumed", "carol", "psp back"),
    ]


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("kind", "by", "reason"),
    [
        ("no-such-kind", "alice", ""),
        ("noop", "", ""),
        ("noop", "alice", "x" * 1001),
        ("a b", "a", ""),
    ],
)
def test_pause_kind__refuses_bad_input_and_writes_nothing(kind: str, by: str, reason: str) -> None:
    with pytest.raises(InvalidArgument):
        JOBS.pause_kind(kind, by=by, reason=reason)
    with pytest.raises(InvalidArgument):
        JOBS.resume_kind(kind, by=by, reason=reason)
    assert not PausedKind.objects.exists() and not KindEvent.objects.exists()


@pytest.mark.django_db
def test_claim__leaves_paused_kinds_out_whatever_kinds_it_asks_for() -> None:
    paused = [JOBS.enqueue("noop", priority=9) for _ in range(3)]
    other = [JOBS.enqueue("sleep", {"seconds": 0}) for _ in range(2)]
    JOBS.pause_kind("noop", by="alice")
    assert JOBS.claim("w", ttl=60, limit=10, kinds=["noop"]) == []
    taken = JOBS.claim("w", ttl=60, limit=10)  # every kind
    assert sorted(job.pk for job in taken) == sorted(job.pk for job in other)
    assert all(status(job) == Status.PENDING for job in paused)
    won, more = JOBS.complete_and_claim("w", {job.pk: job.lease_token for job in taken}, ttl=60)
    assert len(won) == 2 and more == []
    JOBS.resume_kind("noop", by="alice")
    again = JOBS.claim("w", ttl=60, limit=10, kinds=["noop", "sleep"])
    assert sorted(job.pk for job in again) == sorted(job.pk for job in paused)


@pytest.mark.django_db(transaction=True)
def test_claim__leaves_a_paused_throttled_kind_out() -> None:
    throttled.register()
    try:
        capped = JOBS.enqueue(throttled.CAPPED)
        free = JOBS.enqueue("noop")
        JOBS.pause_kind(throttled.CAPPED, by="alice")
        assert [job.pk for job in JOBS.claim("w", ttl=60, limit=5)] == [free.pk]
        assert JOBS.claim("w", ttl=60, limit=5, kinds=[throttled.CAPPED]) == []
        JOBS.resume_kind(throttled.CAPPED, by="alice")
        assert [job.pk for job in JOBS.claim("w", ttl=60, limit=5)] == [capped.pk]
    finally:
        throttled.unregister()


# ---- the worker ---------------------------------------------------------------------------


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__runs_the_other_kinds_only_until_the_kind_is_resumed(
    processes: Processes,
) -> None:
    JOBS.pause_kind("noop", by="alice")
    paused = [JOBS.enqueue("noop") for _ in range(3)]
    others = [JOBS.enqueue("sleep", {"seconds": 0}) for _ in range(3)]
    proc = worker(processes, "w", "--burst", "--concurrency", "2")
    out = finish(proc)
    # --burst: exits 0 once only jobs of paused kinds are left.
    assert proc.returncode == 0, out
    assert [status(job) for job in others] == [Status.COMPLETED] * 3
    assert [(status(job), outcomes(job)) for job in paused] == [(Status.PENDING, [])] * 3

    JOBS.resume_kind("noop", by="alice")
    proc = worker(processes, "w", "--burst", "--concurrency", "2")
    out = finish(proc)
    assert proc.returncode == 0, out
    assert [status(job) for job in paused] == [Status.COMPLETED] * 3


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__a_job_running_when_the_pause_lands_finishes(processes: Processes) -> None:
    running = JOBS.enqueue("sleep", {"seconds": 2})
    proc = worker(processes, "w", "--concurrency", "1")
    read_until(proc, f"started job_id={running.pk} ")
    JOBS.pause_kind("sleep", by="alice")
    behind = JOBS.enqueue("sleep", {"seconds": 0})
    wait_for(lambda: status(running) == Status.COMPLETED)
    time.sleep(0.5)  # a few poll intervals: the worker would have claimed `behind` by now
    assert status(behind) == Status.PENDING and outcomes(behind) == []
    JOBS.resume_kind("sleep", by="alice")
    wait_for(lambda: status(behind) == Status.COMPLETED)
    proc.terminate()
    out = finish(proc)
    assert proc.returncode == 0, out
    assert outcomes(running) == [("w", "completed")]


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__a_job_claimed_ahead_of_the_pause_is_not_started(processes: Processes) -> None:
    # a and c run 3 s on the two slots; d waits, claimed ahead, when the pause commits.
    proc, jobs = claimed_ahead(processes, "ahead")
    JOBS.pause_kind("sleep_batch", by="alice")
    out = finish(proc)
    assert proc.returncode == 0, out
    for job in jobs[:3]:
        assert outcomes(job) == [("ahead", "completed")], out
    ahead = jobs[3]
    assert outcomes(ahead) == [("ahead", "released")], out
    assert status(ahead) == Status.PENDING
    assert f" started job_id={ahead.pk} " not in out  # its handler never ran
    assert f"kind paused kind=sleep_batch job_id={ahead.pk}: not started" in out


@pytest.mark.django_db(transaction=True)
def test_worker__a_claim_that_raced_the_pause_is_given_back_unstarted() -> None:
    """The claim read the paused kinds before the pause committed: the slot reads them again
    as it starts the job, gives it back unstarted and runs nothing."""
    lease_worker = LeaseWorker(worker_id="racer", kinds=["atomic_batch"], ttl=60, heartbeat=5)
    job = JOBS.enqueue("atomic_batch")
    sent = time.monotonic()  # the claim's statement, sent before the pause committed
    (claimed,) = JOBS.claim("racer", ttl=60)
    JOBS.pause_kind("atomic_batch", by="alice")
    lease_worker._pool.hand_out([Lease(claimed, ttl=60, renewed_at=sent)])
    lease = lease_worker._pool.next_ready()
    assert lease is not None
    assert lease_worker._attempts.execute(lease) is None
    assert not Charge.objects.exists()  # the handler never ran
    assert outcomes(job) == [("racer", "released")]
    assert status(job) == Status.PENDING
    assert lease_worker.stats.released == 1


# ---- the commands -------------------------------------------------------------------------


@pytest.mark.django_db
def test_pause_kind__commands_say_what_they_did_in_one_line(capsys: Any) -> None:
    call_command("pause_kind", "noop", "--reason", "psp outage", "--by", "oncall")
    call_command("pause_kind", "noop")
    call_command("resume_kind", "noop", "--by", "oncall")
    call_command("resume_kind", "noop")
    lines = capsys.readouterr().out.splitlines()
    where = "of django_leases.paymentjob on database 'default'"
    assert lines == [
        f"paused kind 'noop' {where}",
        f"kind 'noop' {where} is paused already: nothing done",
        f"resumed kind 'noop' {where}",
        f"kind 'noop' {where} is not paused: nothing done",
    ]
    assert list(KindEvent.objects.order_by("id").values_list("action", "by", "reason")) == [
        ("paused", "oncall", "psp outage"),
        ("resumed", "oncall", ""),
    ]


@pytest.mark.django_db
def test_pause_kind__refuses_a_kind_without_a_handler() -> None:
    for command in ("pause_kind", "resume_kind"):
        with pytest.raises(CommandError, match="no handler is registered for kind 'nope'"):
            call_command(command, "nope")
    assert not PausedKind.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_pause_kind__exits_non_zero_with_one_line(processes: Processes) -> None:
    proc = processes.manage("pause_kind", "nope")
    out = finish(proc)
    assert proc.returncode == 1
    assert out.strip().splitlines() == ["CommandError: no handler is registered for kind 'nope'"]


# ---- the admin ----------------------------------------------------------------------------

CHANGELIST = "admin:django_leases_pausedkind_changelist"
ADD = "admin:django_leases_pausedkind_add"


@pytest.mark.django_db
def test_admin__pauses_and_resumes_a_kind_recording_who_and_why(admin_client: Client) -> None:
    response = admin_client.post(reverse(ADD), {"kind": "noop", "reason": "psp outage"})
    assert response.status_code == 302, response.content.decode()
    row = PausedKind.objects.get()
    assert (row.kind, row.paused_by, row.reason) == ("noop", "admin", "psp outage")
    page = admin_client.get(reverse(CHANGELIST)).content.decode()
    assert "noop" in page and "psp outage" in page
    admin_client.post(reverse(CHANGELIST), {"action": "resume", "_selected_action": [row.pk]})
    assert not PausedKind.objects.exists()
    assert list(KindEvent.objects.order_by("id").values_list("action", "by", "reason")) == [
        ("paused", "admin", "psp outage"),
        ("resumed", "admin", ""),
    ]


@pytest.mark.django_db
def test_admin__pausing_needs_its_own_permission(client: Client, django_user_model: Any) -> None:
    viewer = django_user_model.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_pausedkind"))
    client.force_login(viewer)
    JOBS.pause_kind("sleep", by="alice")
    response = client.get(reverse(CHANGELIST))
    assert response.status_code == 200
    assert response.context["action_form"] is None  # no resume action offered
    assert reverse(ADD) not in response.content.decode()
    assert client.post(reverse(ADD), {"kind": "noop"}).status_code == 403
    row = PausedKind.objects.get()
    client.post(reverse(CHANGELIST), {"action": "resume", "_selected_action": [row.pk]})
    assert list(PausedKind.objects.values_list("kind", flat=True)) == ["sleep"]
    assert KindEvent.objects.count() == 1

    viewer.user_permissions.add(Permission.objects.get(codename="pause_kind"))
    assert client.post(reverse(ADD), {"kind": "noop"}).status_code == 302
    assert sorted(PausedKind.objects.values_list("kind", flat=True)) == ["noop", "sleep"]


# ---- schedules ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_pause_kind__schedules_go_on_enqueueing_its_jobs() -> None:
    JOBS.pause_kind("noop", by="alice")
    with override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": {"kind": "noop", "every": 10**7}}}):
        begin()
        [job] = enqueue_due()
    assert (job.kind, status(job)) == ("noop", Status.PENDING)
    assert JOBS.claim("w", ttl=60) == []
    JOBS.resume_kind("noop", by="alice")
    assert [claimed.pk for claimed in JOBS.claim("w", ttl=60)] == [job.pk]


@pytest.mark.django_db(transaction=True)
def test_worker__a_job_claimed_after_the_pause_returned_is_never_of_the_kind() -> None:
    """The start reads nothing for a fresh claim: `pause_kind()` returns FRESH_CLAIM seconds
    after its commit, so a claim sent after it returned saw the pause and left the kind out."""
    JOBS.enqueue("atomic_batch")
    started = time.monotonic()
    JOBS.pause_kind("atomic_batch", by="alice")
    assert time.monotonic() - started >= FRESH_CLAIM
    assert JOBS.claim("racer", ttl=60, kinds=["atomic_batch"]) == []
