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
    from django_leases.backends import run_task, task_kind
    from django_leases.handlers import job_handler

    for queue in sorted(lease_task_queues()):
        job_handler(task_kind(queue))(run_task)
