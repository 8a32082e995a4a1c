"""`manage.py pause_kind KIND`: no worker starts a job of KIND until `resume_kind KIND`."""

from typing import Any

from django_leases.management.commands._pausing import KindCommand
from django_leases.querysets import LeaseQuerySet


class Command(KindCommand):
    help = (
        "Pause a job kind on the job table (--model): from the moment this command returns, no "
        "worker on any host starts a job of it; jobs running now finish, enqueueing and "
        "schedules go on, and the jobs wait, pending, until resume_kind. Pausing a paused kind "
        "changes nothing and says so. Recorded as a kind event with --by and --reason. "
        "Exit status 1: a kind no handler is registered for, bad options, a database that is "
        "down or not migrated (one line saying which)."
    )
    verb = "paused"
    unchanged = "paused already"

    def change(self, jobs: LeaseQuerySet[Any], kind: str, *, by: str, reason: str) -> bool:
        return jobs.pause_kind(kind, by=by, reason=reason)
