"""`manage.py resume_kind KIND`: workers start the jobs of a paused KIND again."""

from typing import Any

from django_leases.management.commands._pausing import KindCommand
from django_leases.querysets import LeaseQuerySet


class Command(KindCommand):
    help = (
        "Resume a paused job kind on the job table (--model): workers start its jobs again. "
        "Resuming a kind that is not paused changes nothing and says so. Recorded as a kind "
        "event with --by and --reason. Exit status 1: a kind no handler is registered for, bad "
        "options, a database that is down or not migrated (one line saying which)."
    )
    verb = "resumed"
    unchanged = "not paused"

    def change(self, jobs: LeaseQuerySet[Any], kind: str, *, by: str, reason: str) -> bool:
        return jobs.resume_kind(kind, by=by, reason=reason)
