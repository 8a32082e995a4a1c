"""No-op tasks of the peer queues, each defined only when its library is installed.

procrastinate discovers this module in every installed app; django-tasks and django-q2 import
the functions by their dotted path. The pgqueuer entrypoint is in bench/pgq.py (no Django).
"""

from importlib.util import find_spec


def noop_q() -> None:
    """Do nothing (django-q2 runs plain functions by dotted path)."""


if find_spec("procrastinate"):
    from procrastinate.contrib.django import app as procrastinate_app

    @procrastinate_app.task(name="bench.noop")
    def noop_procrastinate() -> None:
        """Do nothing."""


if find_spec("django_tasks_db"):
    if find_spec("django.tasks"):
        from django.tasks import task
    else:
        from django_tasks import task

    @task()
    def noop_task() -> None:
        """Do nothing."""
