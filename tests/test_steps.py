"""Resumable steps, `lease.step()`: recorded once under the fencing token, skipped on a later
attempt, their writes committed with their record; then with real worker processes."""

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import connection, transaction
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.urls import reverse

from django_leases.exceptions import InvalidArgument, LeaseError, LeaseLost, PayloadTooLarge
from django_leases.lease import Lease, step_key
from django_leases.models import JobAttempt, JobStep, PaymentJob
from django_leases.watcher import StuckWatcher
from tests.testapp.jobs import STEPS
from tests.testapp.models import Charge, PayoutJob

from .conftest import ON_SQLITE, Processes, read_until, subprocess_env, wait_for

# On SQLite a step's transaction (IMMEDIATE, as the system check W003 asks) holds the database's
# write lock from its start: no other connection can take the job over while the step runs, so
# the fence there is that lock, and a takeover in the middle of a step cannot be staged.
NO_TAKEOVER_MID_STEP = pytest.mark.skipif(
    ON_SQLITE,
    reason="SQLite: a step's transaction holds the write lock; nobody takes over meanwhile",
)

Status = PaymentJob.Status


def claimed(owner: str = "w1", kind: str = "capture") -> Lease:
    job = PaymentJob.objects.enqueue(kind)
    (got,) = PaymentJob.objects.claim(owner, ttl=60, kinds=[kind])
    assert got.pk == job.pk
    return Lease(got, ttl=60)


def take_over(lease: Lease, owner: str = "w2") -> Lease:
    """Expire the lease by the database clock and let `owner` claim the job."""
    PaymentJob.objects.filter(pk=lease.pk).update(lease_until=Now() - timedelta(seconds=1))
    (job,) = PaymentJob.objects.claim(owner, ttl=60, kinds=[lease.job.kind])
    assert job.pk == lease.pk and job.lease_token > lease.token
    return Lease(job, ttl=60)


def steps_of(pk: int) -> list[tuple[str, Any, int, int]]:
    rows = JobStep.objects.filter(job_ref=pk).order_by("id")
    return list(rows.values_list("name", "result", "token", "attempt"))


def checkpoint_of(pk: int) -> str:
    return str(PaymentJob.objects.values_list("checkpoint", flat=True).get(pk=pk))


class Calls:
    """A step function that counts its calls and writes a Charge in the step's transaction."""

    def __init__(self, result: Any = None) -> None:
        self.calls = 0
        self.result = {"charge": "ch_1"} if result is None else result

    def __call__(self, lease: Lease) -> Any:
        self.calls += 1
        Charge.objects.create(job_ref=lease.pk, token=lease.token, owner=lease.owner)
        return self.result


# ---- one process ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_step__runs_once_and_a_later_attempt_gets_its_recorded_result() -> None:
    first = claimed()
    authorize = Calls({"auth": "a_1", "amounts": (10, 20)})
    assert first.step("authorize", authorize, first) == {"auth": "a_1", "amounts": [10, 20]}
    assert authorize.calls == 1
    assert steps_of(first.pk) == [
        ("authorize", {"auth": "a_1", "amounts": [10, 20]}, first.token, 1)
    ]
    # The same attempt asking again gets the record too.
    assert first.step("authorize", authorize, first)["auth"] == "a_1"
    second = take_over(first)
    again = Calls()
    assert second.step("authorize", again, second) == {"auth": "a_1", "amounts": [10, 20]}
    assert (authorize.calls, again.calls) == (1, 0)
    assert Charge.objects.filter(job_ref=first.pk).count() == 1
    capture = Calls({"capture": "c_1"})
    assert second.step("capture", capture, second) == {"capture": "c_1"}
    assert [(name, token, attempt) for name, _, token, attempt in steps_of(first.pk)] == [
        ("authorize", first.token, 1),
        ("capture", second.token, 2),
    ]


@pytest.mark.django_db
def test_step__marks_its_start_in_the_checkpoint_and_its_record_clears_it() -> None:
    lease = claimed()
    seen = []

    def capture() -> str:
        seen.append((checkpoint_of(lease.pk), JobAttempt.objects.get(job_ref=lease.pk).checkpoint))
        return "ok"

    lease.step("capture", capture)
    assert seen == [("step:capture", "step:capture")]
    assert checkpoint_of(lease.pk) == ""
    assert JobAttempt.objects.get(job_ref=lease.pk).checkpoint == ""
    # A checkpoint the handler set itself stays: the job passed its own risky point.
    lease.checkpoint("psp_called")
    lease.step("notify", capture)
    assert seen[-1] == ("psp_called", "psp_called")
    assert checkpoint_of(lease.pk) == "psp_called"
    assert JobAttempt.objects.get(job_ref=lease.pk).checkpoint == "psp_called"


@pytest.mark.django_db
def test_step__a_holder_that_lost_its_lease_neither_skips_nor_records() -> None:
    first = claimed()
    first.step("authorize", Calls(), first)
    second = take_over(first)
    stale = Lease(first.job, ttl=60)  # the first holder, unaware of the takeover
    not_run = Calls()
    with pytest.raises(LeaseLost):
        stale.step("authorize", not_run, stale)
    with pytest.raises(LeaseLost):
        Lease(first.job, ttl=60).step("capture", not_run, stale)
    assert not_run.calls == 0
    assert [name for name, *_ in steps_of(first.pk)] == ["authorize"]
    assert checkpoint_of(first.pk) == ""
    attempt = JobAttempt.objects.get(job_ref=first.pk, token=first.token)
    assert attempt.fenced_at is not None
    assert second.step("capture", Calls(), second) == {"charge": "ch_1"}


@NO_TAKEOVER_MID_STEP
@pytest.mark.django_db(transaction=True)
def test_step__its_writes_roll_back_with_its_record_when_the_lease_is_taken_meanwhile() -> None:
    lease = claimed()
    taken: list[Lease] = []

    def capture() -> str:
        # Another worker takes the job over while the provider answers (its own connection).
        thread = threading.Thread(target=lambda: (taken.append(take_over(lease)), close()))
        thread.start()
        thread.join()
        Charge.objects.create(job_ref=lease.pk, token=lease.token, owner="stale")
        return "captured"

    with pytest.raises(LeaseLost):
        lease.step("capture", capture)
    assert lease.lost
    assert not Charge.objects.filter(job_ref=lease.pk).exists()
    assert steps_of(lease.pk) == []
    # The step is still to be done, under the new token, with the marker the start left.
    (owner,) = taken
    assert checkpoint_of(lease.pk) == "step:capture"
    assert owner.step("capture", lambda: "captured again") == "captured again"
    assert steps_of(lease.pk) == [("capture", "captured again", owner.token, 2)]
    assert checkpoint_of(lease.pk) == ""


def close() -> None:
    connection.close()


@pytest.mark.django_db
def test_step_key__is_the_same_on_every_attempt_and_differs_per_job_and_step() -> None:
    first = claimed()
    second = take_over(first)
    other = claimed("w3", kind="refund")
    assert first.step_key("capture") == second.step_key("capture")
    assert first.step_key("capture") == step_key(PaymentJob.objects.get(pk=first.pk), "capture")
    assert first.step_key("capture") == f"django_leases.paymentjob:{first.pk}:capture"
    keys = {first.step_key("capture"), first.step_key("refund"), other.step_key("capture")}
    assert len(keys) == 3


def not_json() -> Any:
    return {"when": object()}


@pytest.mark.django_db
@override_settings(DJANGO_LEASES={"MAX_PAYLOAD_BYTES": 100})
@pytest.mark.parametrize(
    ("name", "fn", "error", "message"),
    [
        ("", None, InvalidArgument, "step name must be a string of 1 to 64"),
        ("x" * 65, None, InvalidArgument, "step name must be a string of 1 to 64"),
        (7, None, InvalidArgument, "step name must be a string"),
        ("a\x00b", None, InvalidArgument, "step name contains"),
        ("capture", "not callable", InvalidArgument, "fn must be a plain function"),
        ("capture", "coroutine", InvalidArgument, "fn must be a plain function"),
        ("capture", "result", InvalidArgument, "result of step 'capture'"),
        ("capture", "nan", InvalidArgument, "result of step 'capture'"),
        ("capture", "large", PayloadTooLarge, "more than MAX_PAYLOAD_BYTES"),
    ],
)
def test_step__bad_input_is_refused_and_records_nothing(
    name: Any, fn: Any, error: type[Exception], message: str
) -> None:
    lease = claimed()

    async def coroutine() -> None:
        return None

    def returning(value: Any) -> Any:
        Charge.objects.create(job_ref=lease.pk, token=lease.token, owner="step")
        return value

    functions = {
        None: lambda: "ok",
        "not callable": "ok",
        "coroutine": coroutine,
        "result": lambda: returning({"when": object()}),
        "nan": lambda: returning([float("nan")]),
        "large": lambda: returning("x" * 200),
    }
    with pytest.raises(error, match=message):
        lease.step(name, functions[fn])
    assert steps_of(lease.pk) == []
    assert not Charge.objects.exists(), "the step's writes must roll back"
    # A refused name or function wrote nothing; a refused result came after the step started.
    assert checkpoint_of(lease.pk) == ("step:capture" if fn in ("result", "nan", "large") else "")
    assert PaymentJob.objects.get(pk=lease.pk).status == Status.PROCESSING


@pytest.mark.django_db
def test_step__a_name_reused_with_another_function_in_one_attempt_is_refused() -> None:
    lease = claimed()
    authorize = Calls()
    lease.step("authorize", authorize, lease)
    with pytest.raises(InvalidArgument, match="step 'authorize' already ran in this attempt"):
        lease.step("authorize", lambda: "other")
    assert [name for name, *_ in steps_of(lease.pk)] == ["authorize"]
    assert authorize.calls == 1


@pytest.mark.django_db
def test_step__on_a_job_table_without_a_step_record_is_refused_and_writes_nothing() -> None:
    job = PayoutJob.objects.enqueue("payout.send", recipient="acct-1")
    (got,) = PayoutJob.objects.claim("w1", ttl=60)
    with pytest.raises(LeaseError, match="has no step record"):
        Lease(got, ttl=60).step("send", lambda: "sent")
    assert PayoutJob.objects.get(pk=job.pk).checkpoint == ""


@pytest.mark.django_db(transaction=True)
def test_step__refused_inside_another_atomic_block() -> None:
    lease = claimed()
    with pytest.raises(LeaseError, match="cannot run inside another atomic block"):
        with transaction.atomic():
            lease.step("capture", lambda: "ok")
    assert steps_of(lease.pk) == []


@pytest.mark.django_db(transaction=True)
def test_astep__records_through_the_same_statements() -> None:
    lease = claimed()
    authorize = Calls()

    async def handler() -> Any:
        first = await lease.astep("authorize", authorize, lease)
        return first, await lease.astep("authorize", authorize, lease)

    assert async_to_sync(handler)() == ({"charge": "ch_1"}, {"charge": "ch_1"})
    assert authorize.calls == 1
    assert [name for name, *_ in steps_of(lease.pk)] == ["authorize"]


@pytest.mark.django_db
def test_watcher__reviews_a_step_that_started_and_not_one_that_was_recorded() -> None:
    # A kind without a reconcile hook: the watcher's review is left for an operator.
    with override_settings(DJANGO_LEASES={"STUCK_POLICY_BY_KIND": {"settle": "review"}}):
        started = claimed(kind="settle")
        started.step("authorize", Calls(), started)
        started.heartbeat()  # the next step's start needs a live lease

        def crash() -> None:
            raise SystemExit("the worker died after the provider answered")

        with pytest.raises(SystemExit):
            started.step("capture", crash)
        between = claimed("w3", kind="settle")
        between.step("authorize", Calls(), between)
        PaymentJob.objects.update(lease_until=Now() - timedelta(seconds=1))
        actions = {action.pk: action for action in StuckWatcher(watcher_id="wx").run_once()}
    assert PaymentJob.objects.get(pk=started.pk).status == Status.REVIEW
    assert "after checkpoint 'step:capture'" in actions[started.pk].reason
    # Between two steps nothing is in doubt: retried, and the recorded step is skipped.
    assert PaymentJob.objects.get(pk=between.pk).status == Status.PENDING


@pytest.mark.django_db
def test_admin__the_job_page_shows_its_recorded_steps(admin_client: Client) -> None:
    lease = claimed()
    lease.step("authorize", lambda: {"auth": "a_77"})
    url = reverse("admin:django_leases_paymentjob_change", args=[lease.pk])
    response = admin_client.get(url)
    *_, steps = response.context["inline_admin_formsets"]
    assert [(f.original.name, f.original.result) for f in steps] == [
        ("authorize", {"auth": "a_77"})
    ]
    html = response.content.decode()
    assert "recorded steps" in html.lower() and "a_77" in html
    # A job without recorded steps has no steps inline (and its page no query more).
    other = claimed("w3", kind="refund")
    url = reverse("admin:django_leases_paymentjob_change", args=[other.pk])
    formsets = admin_client.get(url).context["inline_admin_formsets"]
    assert JobStep not in [formset.formset.model for formset in formsets]


@pytest.mark.django_db
def test_prune__takes_the_steps_with_the_ledger_or_keeps_them_detached() -> None:
    kept, gone = claimed(), claimed("w3", kind="refund")
    for lease in (kept, gone):
        lease.step("authorize", lambda: "ok")
        lease.complete()
    PaymentJob.objects.update(completed_at=Now() - timedelta(hours=1))
    PaymentJob.objects.filter(pk=kept.pk).prune(retention={"completed": 60}, keep_ledger=True)
    assert list(JobStep.objects.filter(job_ref=kept.pk).values_list("job_id", flat=True)) == [None]
    PaymentJob.objects.filter(pk=gone.pk).prune(retention={"completed": 60}, keep_ledger=False)
    assert not JobStep.objects.filter(job_ref=gone.pk).exists()
    assert not PaymentJob.objects.exists()


# ---- worker processes -------------------------------------------------------------------------


def worker(processes: Processes, name: str, **settings: Any) -> subprocess.Popen[str]:
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(settings)) if settings else None
    return processes.manage(
        "run_lease_worker",
        "--worker-id",
        name,
        "--poll-interval",
        "0.1",
        "--ttl",
        "2",
        "--heartbeat",
        "0.4",
        "-v",
        "2",
        env=env,
    )


@pytest.fixture
def log(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "provider.log"


def provider_calls(log: Path) -> list[tuple[str, str, int]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [(name, key, int(token)) for name, key, token in (line.split() for line in lines)]


def fresh(job: PaymentJob) -> PaymentJob:
    return PaymentJob.objects.get(pk=job.pk)


def token_of(job: PaymentJob, attempt: int) -> int:
    return int(JobAttempt.objects.get(job_ref=job.pk, attempt=attempt).token)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("killed_after", [1, 2, 3])
def test_worker__sigkill_after_a_recorded_step_resumes_after_it(
    processes: Processes, log: Path, killed_after: int
) -> None:
    # The worker is killed after step N committed (after the last one: before the job's
    # completion); the next attempt runs steps N+1.. only, and never 1..N again.
    done, left = STEPS[:killed_after], STEPS[killed_after:]
    job = PaymentJob.objects.enqueue(
        "stepped", {"log": str(log), "pause_after": done[-1], "seconds": 60}
    )
    victim = worker(processes, "victim")
    wait_for(lambda: JobStep.objects.filter(job_ref=job.pk, name=done[-1]).exists())
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    assert fresh(job).status == Status.PROCESSING

    worker(processes, "rescuer")
    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=60)
    first, second = token_of(job, 1), token_of(job, 2)
    token = dict.fromkeys(done, first) | dict.fromkeys(left, second)
    key = f"django_leases.paymentjob:{job.pk}"
    assert provider_calls(log) == [(name, f"{key}:{name}", token[name]) for name in STEPS]
    assert [(name, token, attempt) for name, _, token, attempt in steps_of(job.pk)] == [
        (name, token[name], 1 if name in done else 2) for name in STEPS
    ]
    recorded = {name: result for name, result, *_ in steps_of(job.pk)}
    assert recorded[done[-1]] == {"step": done[-1], "key": f"{key}:{done[-1]}", "token": first}
    charges = Charge.objects.filter(job_ref=job.pk).order_by("id")
    assert list(charges.values_list("owner", "token")) == [(name, token[name]) for name in STEPS]
    lost, rerun = JobAttempt.objects.filter(job_ref=job.pk).order_by("attempt")
    assert (lost.outcome, rerun.owner, rerun.outcome) == ("lease_lost", "rescuer", "completed")


@NO_TAKEOVER_MID_STEP
@pytest.mark.slow
@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__a_holder_paused_in_a_step_past_its_lease_cannot_record_it(
    processes: Processes, log: Path
) -> None:
    job = PaymentJob.objects.enqueue(
        "stepped", {"log": str(log), "pause_in": "capture", "seconds": 4}
    )
    zombie = worker(processes, "zombie")
    # Paused after the provider answered the capture, before the step's record.
    wait_for(lambda: [call[0] for call in provider_calls(log)] == ["authorize", "capture"])
    os.killpg(zombie.pid, signal.SIGSTOP)
    wait_for(lambda: PaymentJob.objects.expired().filter(pk=job.pk).exists())

    worker(processes, "owner")
    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=60)
    os.killpg(zombie.pid, signal.SIGCONT)
    # The zombie wakes up in the step, and its record is refused.
    read_until(zombie, f"fenced out job_id={job.pk} ", "the step is not recorded")
    assert JobAttempt.objects.get(job_ref=job.pk, attempt=1).fenced_at is not None
    first, second = token_of(job, 1), token_of(job, 2)
    key = f"django_leases.paymentjob:{job.pk}:capture"
    # The provider saw the capture twice, with one key: its idempotency answers the second.
    assert provider_calls(log) == [
        ("authorize", f"django_leases.paymentjob:{job.pk}:authorize", first),
        ("capture", key, first),
        ("capture", key, second),
        ("notify", f"django_leases.paymentjob:{job.pk}:notify", second),
    ]
    assert [(name, token) for name, _, token, _ in steps_of(job.pk)] == [
        ("authorize", first),
        ("capture", second),
        ("notify", second),
    ]
    # The zombie's capture write rolled back with its refused record.
    charges = Charge.objects.filter(job_ref=job.pk).order_by("id")
    assert list(charges.values_list("owner", "token")) == [
        ("authorize", first),
        ("capture", second),
        ("notify", second),
    ]
    assert zombie.poll() is None, "the zombie must keep running, not crash"


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__a_crash_inside_a_step_of_a_review_kind_is_held_for_review(
    processes: Processes, log: Path
) -> None:
    review = {"STUCK_POLICY_BY_KIND": {"stepped": "review"}}
    job = PaymentJob.objects.enqueue(
        "stepped", {"log": str(log), "pause_in": "capture", "seconds": 60}
    )
    victim = worker(processes, "victim", **review)
    wait_for(lambda: [call[0] for call in provider_calls(log)] == ["authorize", "capture"])
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    wait_for(lambda: PaymentJob.objects.expired().filter(pk=job.pk).exists())
    with override_settings(DJANGO_LEASES=review):
        (action,) = StuckWatcher(watcher_id="wx").run_once()
    assert action.pk == job.pk and "step:capture" in action.reason
    job = fresh(job)
    assert (job.status, job.checkpoint) == (Status.REVIEW, "step:capture")
    assert [name for name, *_ in steps_of(job.pk)] == ["authorize"]
    assert not Charge.objects.filter(job_ref=job.pk, owner="capture").exists()
