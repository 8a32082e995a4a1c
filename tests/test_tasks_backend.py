"""`LeaseBackend`: Django Tasks enqueued as leased jobs and run by the lease worker."""

import subprocess
import sys
from datetime import timedelta

import django
import pytest
from django.db.models.functions import Now
from django.utils import timezone

from django_leases.models import JobAttempt, PaymentJob
from django_leases.worker import LeaseWorker
from tests.testapp.tasks import add, explode, send_receipt, which_attempt

from .conftest import Processes, subprocess_env

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


def test_lease_backend__queue_and_priority_map_to_kind_and_priority() -> None:
    result = send_receipt.enqueue("ada@example.com")
    job = PaymentJob.objects.get(pk=int(result.id))
    assert (job.kind, job.priority) == ("tasks.emails", 10)
    drain()
    assert task_backends["default"].get_result(result.id).return_value == {
        "sent_to": "ada@example.com"
    }


def test_lease_backend__failing_task_is_retried_then_failed_with_errors() -> None:
    result = explode.enqueue()
    drain()
    result.refresh()
    assert result.status == TaskResultStatus.READY, "retry scheduled after the first failure"
    assert [e.exception_class_path for e in result.errors] == ["ValueError"]

    PaymentJob.objects.filter(pk=int(result.id)).update(run_at=Now())
    drain()
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert len(result.errors) == 2 and result.errors[-1].traceback == "nope"
    assert result.attempts == 2


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
