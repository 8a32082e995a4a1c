"""`LeaseBackend`: Django's Tasks framework on top of the lease table.

On Django 6.x it uses `django.tasks`; on Django 5.2 the `django-tasks` backport. Tasks are
`PaymentJob` rows of kind `tasks.<queue_name>` and run on `run_lease_worker` with every
guarantee of a job: one owner at a time, heartbeats, fencing, the attempt ledger.

    TASKS = {"default": {"BACKEND": "django_leases.backends.LeaseBackend",
                         "QUEUES": ["default"], "OPTIONS": {"MAX_ATTEMPTS": 1}}}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import django
from django.core.exceptions import ImproperlyConfigured
from django.db import router
from django.utils.module_loading import import_string

from django_leases.conf import leases_settings
from django_leases.exceptions import PermanentError

if TYPE_CHECKING or django.VERSION >= (6, 0):
    from django.tasks import task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskContext, TaskError, TaskResult, TaskResultStatus
    from django.tasks.exceptions import TaskResultDoesNotExist
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
else:  # Django 5.2 with the django-tasks backport, which has the same API
    try:
        from django_tasks import task_backends
    except ModuleNotFoundError as exc:
        # As Django reports a missing database driver: the fix, not a bare module name.
        raise ImproperlyConfigured(
            f"django_leases.backends needs Django 6 or the django-tasks backport, and Django "
            f'{django.get_version()} has no backport installed: pip install "django-leases[tasks]"'
        ) from exc
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import TaskContext, TaskError, TaskResult, TaskResultStatus
    from django_tasks.exceptions import TaskResultDoesNotExist
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

TASK_KIND_PREFIX = "tasks."
STATUSES = {
    "pending": TaskResultStatus.READY,
    "processing": TaskResultStatus.RUNNING,
    "review": TaskResultStatus.RUNNING,
    "completed": TaskResultStatus.SUCCESSFUL,
    "failed": TaskResultStatus.FAILED,
    "cancelled": TaskResultStatus.FAILED,
}


def task_kind(queue_name: str) -> str:
    """Return the job kind that carries the tasks of `queue_name`."""
    return f"{TASK_KIND_PREFIX}{queue_name}"


class LeaseBackend(BaseTaskBackend):
    """Store tasks as leased jobs; `run_lease_worker` runs them."""

    supports_defer = True
    supports_async_task = False
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.max_attempts: int = self.options.get("MAX_ATTEMPTS", leases_settings.MAX_ATTEMPTS)

    @staticmethod
    def _jobs() -> Any:
        from django_leases.models import PaymentJob

        return PaymentJob._default_manager.db_manager(router.db_for_write(PaymentJob))

    def enqueue(self, task: Any, args: Any, kwargs: Any) -> TaskResult:
        self.validate_task(task)
        payload = {
            "task": task.module_path,
            "args": normalize_json(args),
            "kwargs": normalize_json(kwargs),
            "backend": self.alias,
        }
        job = self._jobs().enqueue(
            task_kind(task.queue_name),
            payload,
            run_at=task.run_after,
            priority=task.priority,
            max_attempts=self.max_attempts,
        )
        result = self._result(job, task)
        task_enqueued.send(type(self), task_result=result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        jobs = self._jobs()
        try:
            job = jobs.get(pk=int(result_id), kind__startswith=TASK_KIND_PREFIX)
        except (ValueError, jobs.model.DoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        task = import_string(job.payload["task"]).using(
            priority=job.priority,
            queue_name=job.kind.removeprefix(TASK_KIND_PREFIX),
            backend=self.alias,
        )
        return self._result(job, task)

    def _result(self, job: Any, task: Any) -> TaskResult:
        attempts = list(job.attempt_log.order_by("token")) if job.pk else []
        result: TaskResult = TaskResult(
            task=task,
            id=str(job.pk),
            status=STATUSES[job.status],
            enqueued_at=job.created_at,
            started_at=attempts[0].claimed_at if attempts else None,
            finished_at=job.completed_at,
            last_attempted_at=attempts[-1].claimed_at if attempts else None,
            args=job.payload["args"],
            kwargs=job.payload["kwargs"],
            backend=self.alias,
            errors=[
                TaskError(exception_class_path=a.error_class, traceback=a.error_message)
                for a in attempts
                if a.error_class
            ],
            worker_ids=[a.owner for a in attempts],
        )
        object.__setattr__(result, "_return_value", job.result)
        return result


def run_task(job: Any, lease: Any) -> None:
    """The job handler of every `tasks.<queue>` kind: call the task, store what it returns.

    An exception propagates to the worker, which retries the job with backoff until its
    `max_attempts` (the backend's MAX_ATTEMPTS option), then marks it failed.
    """
    backend = task_backends[job.payload["backend"]]
    if not isinstance(backend, LeaseBackend):
        raise PermanentError(f"task backend {backend.alias!r} is not a LeaseBackend")
    task = import_string(job.payload["task"]).using(
        priority=job.priority,
        queue_name=job.kind.removeprefix(TASK_KIND_PREFIX),
        backend=backend.alias,
    )
    result = backend._result(job, task)
    object.__setattr__(result, "status", TaskResultStatus.RUNNING)
    task_started.send(type(backend), task_result=result)
    args, kwargs = job.payload["args"], job.payload["kwargs"]
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
    except Exception:
        object.__setattr__(result, "status", TaskResultStatus.FAILED)
        task_finished.send(type(backend), task_result=result)
        raise
    value = normalize_json(value)
    lease.complete(result=value)
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "_return_value", value)
    task_finished.send(type(backend), task_result=result)
