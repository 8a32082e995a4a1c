"""Job handlers of django-leases itself: the tasks of Django's Tasks framework.

Registered only for the queues of backends configured as `LeaseBackend` in `settings.TASKS`,
so a worker claims task jobs only where they exist.
"""

from importlib.util import find_spec

import django
from django.conf import settings

BACKEND_PATH = "django_leases.backends.LeaseBackend"


def lease_task_queues() -> set[str]:
    """Return the queue names of every `LeaseBackend` in `settings.TASKS`."""
    queues: set[str] = set()
    for config in getattr(settings, "TASKS", {}).values():
        if config.get("BACKEND") == BACKEND_PATH:
            queues.update(config.get("QUEUES") or ["default"])
    return queues


def tasks_framework_missing() -> bool:
    """Return whether there is no Tasks framework: Django 5.2 without the django-tasks backport."""
    return django.VERSION < (6, 0) and find_spec("django_tasks") is None


# Without the framework, importing the backend would fail at startup, before the system check
# that says what to install (django_leases.E018) could run.
if lease_task_queues() and not tasks_framework_missing():
    from django_leases.backends import queue_problem, run_task, task_kind
    from django_leases.handlers import job_handler

    # A queue name no kind can carry is left to the backend's check (django_leases.E015):
    # refused here, it would fail django.setup() for every command, `check` included.
    for queue in sorted(q for q in lease_task_queues() if queue_problem(q) is None):
        job_handler(task_kind(queue))(run_task)
