"""`LeaseBackend`: Django Tasks enqueued as leased jobs and run by the lease worker."""

import logging
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import django
import pytest
from django.db.models.functions import Now
from django.test import override_settings
from django.utils import timezone

from django_leases.backends import LeaseBackend
from django_leases.exceptions import PayloadTooLarge, TaskFailed
from django_leases.models import JobAttempt, PaymentJob
from django_leases.worker import LeaseWorker
from tests.testapp.models import Charge, PayoutAttempt, PayoutJob
from tests.testapp.tasks import (
    UNSTORABLE,
    add,
    async_charge,
    async_explode,
    explode,
    leak_card,
    send_receipt,
    slow_first,
    unstorable,
    which_attempt,
)

from .conftest import Processes, subprocess_env, wait_for

if django.VERSION >= (6, 0):
    from django.tasks import TaskResultStatus, task_backends
    from django.tasks.exceptions import TaskResultDoesNotExist
else:
    from django_tasks import TaskResultStatus, task_backends
    from django_tasks.exceptions import TaskResultDoesNotExist

pytestmark = pytest.mark.django_db(transaction=True)


def drain() -> None:
    LeaseWorker(worker_id="task-worker", burst=True, ttl=30, heartbeat=5, poll_interval=0.05).run()


def test_lease_backend__task_runs_on_the_worker_and_returns_its_value() -> None:
    result = add.enqueue(2, 3)
    assert result.status == TaskResultStatus.READY
    job = PaymentJob.objects.get(pk=int(result.id))
    assert (job.kind, job.payload["args"], job.max_attempts) == ("tasks.default", [2, 3], 2)

    drain()
    result.refresh()

    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 5
    assert result.worker_ids == ["task-worker"]
    assert result.started_at is not None and result.finished_at is not None
    assert list(JobAttempt.objects.values_list("outcome", flat=True)) == ["completed"]


CARD = "4111111111111111"


def test_lease_backend__a_failed_task_is_logged_without_its_raw_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The framework logs a failed task with the exception being handled: never the raw one,
    whose text and chained driver error quote the card (PostgreSQL, MariaDB)."""
    result = leak_card.enqueue(CARD)
    with caplog.at_level(logging.INFO):
        drain()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["django.db.utils.IntegrityError"]
    (failed,) = [r for r in caplog.records if r.getMessage().endswith("state=FAILED")]
    assert failed.exc_info is not None and failed.exc_info[0] is TaskFailed
    assert str(failed.exc_info[1]).startswith("django.db.utils.IntegrityError: ")
    assert CARD not in caplog.text, caplog.text


@override_settings(DJANGO_LEASES={"JOB_MODEL": "testapp.PayoutJob"})
def test_lease_backend__tasks_are_rows_of_the_job_model_setting() -> None:
    result = explode.enqueue()
    assert PayoutJob.objects.get(pk=int(result.id)).kind == "tasks.default"
    assert PaymentJob.objects.count() == 0

    drain()
    result.refresh()

    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"]
    assert result.worker_ids == ["task-worker"]
    assert list(PayoutAttempt.objects.values_list("outcome", flat=True)) == ["failed"]
    assert JobAttempt.objects.count() == 0


def test_lease_backend__queue_and_priority_map_to_kind_and_priority() -> None:
    result = send_receipt.enqueue("ada@example.com")
    job = PaymentJob.objects.get(pk=int(result.id))
    assert (job.kind, job.priority) == ("tasks.emails", 10)
    drain()
    assert task_backends["default"].get_result(result.id).return_value == {
        "sent_to": "ada@example.com"
    }


def ledger(result_id: str) -> list[tuple[str, str, str]]:
    return list(
        JobAttempt.objects.filter(job_ref=int(result_id))
        .order_by("token")
        .values_list("outcome", "error_class", "error_message")
    )


def test_lease_backend__raising_task_fails_at_once_with_its_error() -> None:
    result = explode.enqueue()
    drain()
    result.refresh()

    assert result.status == TaskResultStatus.FAILED
    (error,) = result.errors
    assert error.exception_class_path == "builtins.ValueError"
    assert error.exception_class is ValueError
    assert error.traceback == "ValueError: nope\n"
    assert result.attempts == 1 and result.finished_at is not None
    assert ledger(result.id) == [("failed", "ValueError", "nope")]
    job = PaymentJob.objects.get(pk=int(result.id))
    assert (job.status, job.last_error) == ("failed", "ValueError: nope")


RETRYING = {
    "default": {
        "BACKEND": "django_leases.backends.LeaseBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"RETRIES": 1, "MAX_ATTEMPTS": 3},
    }
}


@override_settings(TASKS=RETRYING)
def test_lease_backend__retries_option_runs_a_raising_task_again() -> None:
    result = explode.enqueue()
    assert PaymentJob.objects.get(pk=int(result.id)).max_attempts == 3
    drain()
    result.refresh()
    assert result.status == TaskResultStatus.READY, "one retry scheduled, with backoff"
    assert ledger(result.id) == [("retried", "ValueError", "nope")]

    PaymentJob.objects.filter(pk=int(result.id)).update(run_at=Now())
    drain()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in result.errors] == ["builtins.ValueError"] * 2
    assert ledger(result.id) == [
        ("retried", "ValueError", "nope"),
        ("failed", "ValueError", "nope"),
    ]
    assert result.attempts == 2, "the third acquisition is left for crashes, never used"


def test_lease_backend__options_are_checked() -> None:
    def ids(**options: object) -> list[str]:
        backend = LeaseBackend("x", {"QUEUES": ["default"], "OPTIONS": options})
        return [message.id for message in backend.check()]

    assert ids() == []
    assert ids(RETRIES=2, MAX_ATTEMPTS=3) == []
    assert ids(RETRIES=3, MAX_ATTEMPTS=3) == ["django_leases.E014"]
    assert ids(RETRIES=-1) == ["django_leases.E014"]
    assert ids(RETRIES="1") == ["django_leases.E014"]
    assert ids(MAX_ATTEMPTS=0) == ["django_leases.E014"]
    assert ids(MAX_ATTEMPTS=2**31) == ["django_leases.E014"]
    assert ids(MAX_ATTEMPT=3) == ["django_leases.W004"]


BAD_QUEUES = ["q" * 95, "pay\x00ments", "pay\ud800", 7]


@pytest.mark.parametrize("queue", ["q" * 94, "emails", "ünïcode"])
def test_lease_backend__queue_names_a_kind_can_carry_pass(queue: str) -> None:
    assert list(LeaseBackend("x", {"QUEUES": [queue]}).check()) == []


@pytest.mark.parametrize("queue", BAD_QUEUES)
def test_lease_backend__queue_name_no_kind_can_carry_is_an_error(queue: object) -> None:
    (message,) = LeaseBackend("x", {"QUEUES": ["default", queue]}).check()
    assert message.id == "django_leases.E015"
    assert message.msg.startswith("TASKS['x']['QUEUES'] has ")
    assert "1 to 94 characters" in message.hint


def test_lease_backend__bad_queue_names_are_a_check_not_a_crash_at_setup(
    processes: Processes, tmp_path: Path
) -> None:
    """Every command sets Django up first: a queue name must not fail that, `check` included."""
    (tmp_path / "bad_queues.py").write_text(
        "from tests.settings import *  # noqa: F403\n"
        "TASKS = {'default': {'BACKEND': 'django_leases.backends.LeaseBackend', "
        f"'QUEUES': {['default', *BAD_QUEUES]!r}}}}}\n"
    )
    env = subprocess_env(
        DJANGO_SETTINGS_MODULE="bad_queues",
        PYTHONPATH=os.pathsep.join([str(tmp_path), subprocess_env()["PYTHONPATH"]]),
    )
    proc = processes.manage("check", env=env)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out
    assert out.count("django_leases.E015") == len(BAD_QUEUES), out
    proc = processes.manage(
        "shell",
        "-c",
        "from django_leases.handlers import registered_kinds as k; print(k())",
        env=env,
    )
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "'tasks.default'" in out and "tasks.q" not in out and "tasks.pay" not in out, out


@pytest.mark.parametrize("kind", [*UNSTORABLE, "object"])
def test_lease_backend__result_that_cannot_be_stored_fails_once(kind: str) -> None:
    result = unstorable.enqueue(kind)
    drain()
    result.refresh()

    assert result.status == TaskResultStatus.FAILED
    (error,) = result.errors
    assert error.exception_class_path == "django_leases.exceptions.InvalidPayload"
    assert "the return value of task tests.testapp.tasks.unstorable" in error.traceback
    assert [outcome for outcome, _, _ in ledger(result.id)] == ["failed"]
    job = PaymentJob.objects.get(pk=int(result.id))
    assert (job.attempts, job.max_attempts, job.result) == (1, 2, None)


def test_lease_backend__arguments_over_max_payload_bytes_raise_and_enqueue_nothing() -> None:
    with override_settings(DJANGO_LEASES={"MAX_PAYLOAD_BYTES": 200}):
        with pytest.raises(PayloadTooLarge, match=r"more than MAX_PAYLOAD_BYTES \(200\)"):
            add.enqueue("x" * 200, "y")
        result = add.enqueue("x", "y")
    assert PaymentJob.objects.count() == 1
    drain()
    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, "xy")


CRAFTED = [
    {"task": "os.system"},
    {"task": "subprocess.run"},
    {"task": "django_leases.backends.run_task"},
    {"task": "tests.testapp.jobs.noop"},
    {"task": "tests.testapp.tasks.not_a_task"},
    {"task": "tests.testapp.tasks.no_such_name"},
    {"task": "tests.testapp.no_such_module.add"},
    {"task": ["tests.testapp.tasks.add"]},
    {"backend": "nope"},
    {"args": "rm -rf /"},
]


@pytest.mark.parametrize("crafted", CRAFTED, ids=str)
def test_run_task__crafted_payload_fails_the_job_without_calling_anything(
    crafted: dict[str, object], tmp_path: Path
) -> None:
    marker = tmp_path / "called"
    payload = {
        "task": "tests.testapp.tasks.add",
        "args": [f"touch {marker}"],
        "kwargs": {},
        "backend": "default",
        **crafted,
    }
    # Written straight into the table, as anyone with write access to it could.
    job = PaymentJob.objects.enqueue("tasks.default", payload)
    drain()

    job.refresh_from_db()
    assert job.status == "failed" and job.attempts == 1
    assert job.last_error.startswith("django_leases.exceptions.InvalidTaskJob: "), job.last_error
    assert not marker.exists()
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(str(job.pk))


def test_lease_backend__run_after_defers_and_context_counts_attempts() -> None:
    later = add.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(1, 1)
    now = which_attempt.enqueue()
    drain()
    assert task_backends["default"].get_result(later.id).status == TaskResultStatus.READY
    assert task_backends["default"].get_result(now.id).return_value == 1


def test_lease_backend__unknown_result_id() -> None:
    backend = task_backends["default"]
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result("999999")
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result("not-a-number")
    job = PaymentJob.objects.enqueue("noop")
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result(str(job.pk))


@pytest.mark.concurrency
def test_lease_backend__runs_on_run_lease_worker(processes: Processes) -> None:
    result = add.enqueue(20, 22)
    proc = processes.manage("run_lease_worker", "--burst", "--kind", "tasks.default")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, 42)


@pytest.mark.concurrency
def test_lease_backend__raising_task_is_failed_by_a_burst_worker(processes: Processes) -> None:
    result = explode.enqueue()
    proc = processes.manage("run_lease_worker", "--burst", "--kind", "tasks.default")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    result.refresh()
    assert result.status == TaskResultStatus.FAILED, out
    assert [e.exception_class for e in result.errors] == [ValueError]


@pytest.mark.concurrency
def test_lease_backend__worker_killed_mid_task_runs_it_again(processes: Processes) -> None:
    result = slow_first.enqueue(600)
    proc = processes.manage(
        "run_lease_worker", "--kind", "tasks.default", "--ttl", "2", "--heartbeat", "0.5"
    )
    wait_for(lambda: PaymentJob.objects.filter(pk=int(result.id), status="processing").exists())
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)

    # The dead worker's lease runs out; the next worker takes the task over and runs it again.
    wait_for(lambda: PaymentJob.objects.expired().filter(pk=int(result.id)).exists(), timeout=60)
    drain()
    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, 2)
    assert result.errors == []
    assert [outcome for outcome, _, _ in ledger(result.id)] == ["lease_lost", "completed"]


@pytest.mark.concurrency
def test_lease_backend__async_tasks_run_awaited_on_run_lease_worker(processes: Processes) -> None:
    assert task_backends["default"].supports_async_task
    charged = async_charge.enqueue(7)
    exploded = async_explode.enqueue()
    proc = processes.manage("run_lease_worker", "--burst", "--kind", "tasks.default")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    charged.refresh()
    assert charged.status == TaskResultStatus.SUCCESSFUL, out
    assert list(Charge.objects.values_list("pk", "job_ref")) == [(charged.return_value, 7)]
    exploded.refresh()
    assert exploded.status == TaskResultStatus.FAILED
    assert [e.exception_class for e in exploded.errors] == [ValueError]


@pytest.mark.skipif(django.VERSION >= (6, 0), reason="Django 6 has the framework: nothing to miss")
def test_lease_backend__import_without_the_backport_names_the_extra() -> None:
    hide_the_backport = "sys.modules['django_tasks'] = None"
    proc = subprocess.run(
        [sys.executable, "-c", f"import sys; {hide_the_backport}; import django_leases.backends"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert proc.returncode == 1
    last_line = proc.stderr.strip().splitlines()[-1]
    assert last_line.startswith("django.core.exceptions.ImproperlyConfigured: ")
    assert 'pip install "django-leases[tasks]"' in last_line
