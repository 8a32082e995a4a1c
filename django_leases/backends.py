"""`LeaseBackend`: Django's Tasks framework on top of the lease table.

On Django 6.x it uses `django.tasks`; on Django 5.2 the `django-tasks` backport. Tasks are
rows of the job table (`DJANGO_LEASES["JOB_MODEL"]`, `PaymentJob` by default) of kind
`tasks.<queue_name>` and run on `run_lease_worker` with every guarantee of a job: one owner at
a time, heartbeats, fencing, the attempt ledger.

It follows Django's Tasks semantics: a task that raises ends FAILED at once, unless OPTIONS
ask for retries; a worker that dies or loses its lease is not the task failing, and the task
runs again once the lease expires.

    TASKS = {"default": {"BACKEND": "django_leases.backends.LeaseBackend",
                         "QUEUES": ["default"], "OPTIONS": {"RETRIES": 0, "MAX_ATTEMPTS": 5}}}
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import django
from django.apps import apps
from django.core.checks import CheckMessage, Error, Warning
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from django_leases.conf import leases_settings
from django_leases.exceptions import (
    InvalidArgument,
    InvalidPayload,
    InvalidTaskJob,
    LeaseLost,
    TaskFailed,
)
from django_leases.limits import (
    KIND_LENGTH,
    MAX_ATTEMPTS,
    check_json,
    check_json_size,
    check_kind,
    shown,
)
from django_leases.querysets import LeaseQuerySet
from django_leases.redaction import describe
from django_leases.status import AttemptOutcome, JobStatus
from django_leases.tables import leased_jobs

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
    JobStatus.PENDING: TaskResultStatus.READY,
    JobStatus.WAITING: TaskResultStatus.READY,
    JobStatus.PROCESSING: TaskResultStatus.RUNNING,
    JobStatus.REVIEW: TaskResultStatus.RUNNING,
    JobStatus.COMPLETED: TaskResultStatus.SUCCESSFUL,
    JobStatus.FAILED: TaskResultStatus.FAILED,
    JobStatus.CANCELLED: TaskResultStatus.FAILED,
}
OPTIONS = ("RETRIES", "MAX_ATTEMPTS")


def task_kind(queue_name: str) -> str:
    """Return the job kind that carries the tasks of `queue_name`."""
    return f"{TASK_KIND_PREFIX}{queue_name}"


def queue_problem(queue: Any) -> str | None:
    """Return why `queue` cannot carry tasks (its job kind is no kind `enqueue()` takes), or
    None."""
    if not isinstance(queue, str):
        return f"a queue name must be a string, got {shown(queue)}"
    try:
        check_kind(task_kind(queue), "its job kind")
    except InvalidArgument as exc:
        return str(exc)
    return None


def exception_class_path(error_class: str) -> str:
    """Return the importable path of a ledger's error class ("ValueError" is a builtin)."""
    return error_class if "." in error_class else f"builtins.{error_class}"


class LeaseBackend(BaseTaskBackend):
    """Store tasks as leased jobs; `run_lease_worker` runs them.

    OPTIONS:
        RETRIES: how many times a task that raised runs again (with the worker's exponential
            backoff) before it ends FAILED; default 0, Django's semantics.
        MAX_ATTEMPTS: acquisitions a task job gets in all, re-runs after a worker crash or a
            lost lease included; default `DJANGO_LEASES["MAX_ATTEMPTS"]`. Above RETRIES.
    """

    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.retries: int = self.options.get("RETRIES", 0)
        self.max_attempts: int = self.options.get("MAX_ATTEMPTS", leases_settings.MAX_ATTEMPTS)

    def check(self, **kwargs: Any) -> list[CheckMessage]:
        """Report OPTIONS this backend cannot run with."""
        messages = list(super().check(**kwargs))
        low, high = MAX_ATTEMPTS
        retries, attempts = self.retries, self.max_attempts
        whole = {
            key: isinstance(value, int) and not isinstance(value, bool)
            for key, value in (("RETRIES", retries), ("MAX_ATTEMPTS", attempts))
        }
        if not whole["MAX_ATTEMPTS"] or not low <= attempts <= high:
            problem = f"MAX_ATTEMPTS must be a whole number from {low} to {high}, got {attempts!r}"
        elif not whole["RETRIES"] or not 0 <= retries < attempts:
            problem = (
                f"RETRIES must be a whole number from 0 to MAX_ATTEMPTS - 1 ({attempts - 1}), "
                f"got {retries!r}"
            )
        else:
            problem = ""
        if problem:
            messages.append(
                Error(
                    f"TASKS[{self.alias!r}]['OPTIONS']: {problem}.",
                    hint="RETRIES counts runs after the task raised; MAX_ATTEMPTS counts every "
                    "acquisition, re-runs after a worker crash included.",
                    id="django_leases.E014",
                )
            )
        messages.extend(
            Error(
                f"TASKS[{self.alias!r}]['QUEUES'] has {shown(queue)}, which cannot carry tasks: "
                f"{why}.",
                hint=f"Its tasks are jobs of kind '{TASK_KIND_PREFIX}<queue>': a queue name of 1 "
                f"to {KIND_LENGTH - len(TASK_KIND_PREFIX)} characters, without whitespace, "
                "control characters or lone surrogates. No worker runs a queue named so.",
                id="django_leases.E015",
            )
            for queue in sorted(self.queues, key=repr)
            if (why := queue_problem(queue))
        )
        messages.extend(
            Warning(
                f"TASKS[{self.alias!r}]['OPTIONS'] has an unknown key {key!r}; it is ignored.",
                hint=f"Known keys: {', '.join(OPTIONS)}.",
                id="django_leases.W004",
            )
            for key in sorted(set(self.options) - set(OPTIONS))
        )
        return messages

    @staticmethod
    def _jobs() -> LeaseQuerySet[Any]:
        return leased_jobs()

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
            _, task = resolve_task(job)
        except (ValueError, jobs.model.DoesNotExist, InvalidTaskJob):
            raise TaskResultDoesNotExist(result_id) from None
        return self._result(job, task)

    def _result(self, job: Any, task: Any) -> TaskResult:
        attempts = attempt_rows(job) if job.pk else []
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
            # The ledger keeps an error's class and (redacted) message, never its stack: the
            # traceback is its last line, as `traceback.format_exception_only()` writes it.
            errors=[
                TaskError(
                    exception_class_path=exception_class_path(a.error_class),
                    traceback=f"{a.error_class}: {a.error_message}\n",
                )
                for a in attempts
                if a.error_class
            ],
            worker_ids=[a.owner for a in attempts],
        )
        object.__setattr__(result, "_return_value", job.result)
        return result

    def _raised_before(self, job: Any) -> int:
        """Count the earlier attempts of `job` in which the task raised (the ledger is exact)."""
        return sum(row.outcome == AttemptOutcome.RETRIED for row in attempt_rows(job))


def attempt_rows(job: Any) -> list[Any]:
    """Return the ledger rows of `job`, read where the job was, oldest first."""
    return leased_jobs(type(job), job._state.db).attempt_rows(job.pk)


def in_installed_app(module: str) -> bool:
    """Whether `module` lies inside the package of an installed app."""
    return any(
        module == config.name or module.startswith(f"{config.name}.")
        for config in apps.get_app_configs()
    )


def resolve_task(job: Any) -> tuple[LeaseBackend, Any]:
    """Return the `LeaseBackend` and the `Task` a task job names, or raise `InvalidTaskJob`.

    The payload is data anyone with write access to the table could have crafted, so the
    stored path must lead to a real `Task` object (never any other callable) that: lives in a
    module of an installed app (nothing outside INSTALLED_APPS is ever imported for it), has
    that very path as its `module_path`, and is run by the backend the job names, which must be
    a `LeaseBackend` serving the job's queue.
    """
    payload = job.payload if isinstance(job.payload, dict) else {}
    alias, path = payload.get("backend"), payload.get("task")
    queue = job.kind.removeprefix(TASK_KIND_PREFIX)
    if not isinstance(alias, str) or alias not in task_backends.settings:
        raise InvalidTaskJob(f"job {job.pk}: {alias!r} is not a configured task backend")
    backend = task_backends[alias]
    if not isinstance(backend, LeaseBackend) or queue not in backend.queues:
        raise InvalidTaskJob(
            f"job {job.pk}: task backend {alias!r} is not a LeaseBackend serving queue {queue!r}"
        )
    if not isinstance(payload.get("args"), list) or not isinstance(payload.get("kwargs"), dict):
        raise InvalidTaskJob(f"job {job.pk}: the payload has no list of args and dict of kwargs")
    module = path.rpartition(".")[0] if isinstance(path, str) else ""
    if not isinstance(path, str) or not module or not in_installed_app(module):
        raise InvalidTaskJob(f"job {job.pk}: {path!r} is not in a module of an installed app")
    try:
        found = import_string(path)
    except ImportError:
        found = None
    if not isinstance(found, backend.task_class) or found.module_path != path:
        raise InvalidTaskJob(f"job {job.pk}: {path!r} is not a task")
    return backend, found.using(priority=job.priority, queue_name=queue, backend=alias)


def run_task(job: Any, lease: Any) -> None:
    """The job handler of every `tasks.<queue>` kind: call the task, store what it returns.

    A task that raises fails the job at once, its error in the ledger; with the backend's
    RETRIES option it is raised to the worker instead, which retries it with backoff. A job
    that names no task of a `LeaseBackend`, or whose task returns a value that cannot be
    stored, fails at once and never runs again for it.
    """
    try:
        backend, task = resolve_task(job)
    except InvalidTaskJob as exc:
        lease.fail(exc, permanent=True)
        return
    result = backend._result(job, task)
    object.__setattr__(result, "status", TaskResultStatus.RUNNING)
    task_started.send(type(backend), task_result=result)
    args, kwargs = job.payload["args"], job.payload["kwargs"]
    error: Exception | None = None
    try:
        if task.takes_context:
            value = task.call(TaskContext(task_result=result), *args, **kwargs)
        else:
            value = task.call(*args, **kwargs)
    except LeaseLost:
        raise  # the worker fences this holder out; the task runs again elsewhere
    except Exception as exc:
        if lease.lost or backend._raised_before(job) < backend.retries:
            raise  # the worker fences out, or retries with backoff
        error = exc
    else:
        try:
            value = normalize_json(value)
            check_json(value, f"the return value of task {task.module_path}")
            check_json_size(
                value,
                f"the return value of task {task.module_path}",
                leases_settings.MAX_PAYLOAD_BYTES,
            )
        except (TypeError, ValueError, RecursionError) as exc:
            # A value that cannot be stored fails the task once: running it again returns the
            # same.
            error = (
                exc
                if isinstance(exc, InvalidPayload)
                else InvalidPayload(
                    f"the return value of task {task.module_path} is not JSON: {exc}"
                )
            )
    # Announced outside the except blocks: the framework's receiver would log the exception
    # being handled, raw (see _finish()).
    if error is not None:
        _finish(backend, result, partial(lease.fail, error, permanent=True), error=error)
        return
    object.__setattr__(result, "_return_value", value)
    _finish(backend, result, partial(lease.complete, result=value))


def _finish(
    backend: LeaseBackend,
    result: TaskResult,
    write: Callable[[], object],
    *,
    error: BaseException | None = None,
) -> None:
    """Write the task's outcome through its lease, then announce it with `task_finished`.

    For a failure, the framework's receiver logs the exception being handled (for error
    monitoring): `TaskFailed`, with what REDACT_ERRORS keeps of `error`, never `error` itself.
    """
    write()
    if error is None:
        object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
        task_finished.send(type(backend), task_result=result)
        return
    object.__setattr__(result, "status", TaskResultStatus.FAILED)
    try:
        raise TaskFailed(describe(error))
    except TaskFailed:
        task_finished.send(type(backend), task_result=result)
