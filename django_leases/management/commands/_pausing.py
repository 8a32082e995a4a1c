"""What `pause_kind` and `resume_kind` share: their options and their one line of output."""

import socket
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_leases.exceptions import InvalidArgument
from django_leases.management.commands._options import (
    OneLineErrorsMixin,
    add_database_argument,
    add_model_argument,
    job_kind,
    one_line_database_errors,
)
from django_leases.outages import check_tables
from django_leases.querysets import LeaseQuerySet
from django_leases.tables import leased_jobs, queue_models


class KindCommand(OneLineErrorsMixin, BaseCommand):
    """Pause or resume one kind of a job table (`LeaseQuerySet.pause_kind()`, `resume_kind()`)."""

    verb = ""
    """"paused" or "resumed": what the command does, as its output says it."""
    unchanged = ""
    """What its output says when the kind was so already ("paused already", "not paused")."""

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("kind", type=job_kind, help="the job kind (a registered handler's)")
        parser.add_argument(
            "--reason", default="", help="why, recorded with the kind's event (default: none)"
        )
        parser.add_argument(
            "--by",
            default=None,
            help="who, recorded with the kind's event (default: 'manage.py on HOSTNAME')",
        )
        add_model_argument(parser)
        add_database_argument(parser)

    def handle(
        self,
        *,
        kind: str,
        reason: str,
        by: str | None,
        model: type[Any] | None,
        database: str | None,
        **options: Any,
    ) -> None:
        jobs = leased_jobs(model, database)
        where = f"{jobs.model._meta.label_lower} on database {jobs.db!r}"
        with one_line_database_errors(jobs.db):
            check_tables(jobs.db, queue_models(jobs.model))
            try:
                changed = self.change(
                    jobs, kind, by=by or f"manage.py on {socket.gethostname()}", reason=reason
                )
            except InvalidArgument as exc:
                raise CommandError(str(exc)) from None
        if changed:
            self.stdout.write(self.style.SUCCESS(f"{self.verb} kind {kind!r} of {where}"))
        else:
            self.stdout.write(f"kind {kind!r} of {where} is {self.unchanged}: nothing done")

    def change(self, jobs: LeaseQuerySet[Any], kind: str, *, by: str, reason: str) -> bool:
        raise NotImplementedError
