"""`manage.py prune_jobs`: delete finished jobs past their retention, in bounded batches."""

import logging
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import Count

from django_leases.checks.databases import database_clock_problems
from django_leases.conf import leases_settings
from django_leases.limits import BATCH_SIZE
from django_leases.management.commands._options import (
    OneLineErrorsMixin,
    add_database_argument,
    add_model_argument,
    configure_logging,
    one_line_database_errors,
    positive_seconds,
    whole_number,
)
from django_leases.outages import check_tables
from django_leases.querysets import LeaseQuerySet, PrunedBatch
from django_leases.tables import leased_jobs, queue_history, queue_models, registered_workers

logger = logging.getLogger("django_leases.prune")


class Command(OneLineErrorsMixin, BaseCommand):
    help = (
        "Delete finished jobs (completed, failed, cancelled) of the job table (--model) whose "
        "completed_at, by the "
        "database clock, is older than DJANGO_LEASES['RETENTION'] for their status, in batches "
        "of PRUNE_BATCH_SIZE, one transaction each. Their attempt ledger is deleted with them, "
        "or kept (detached) when PRUNE_LEDGER is False. Pending, processing and under-review "
        "jobs are never touched. Registry rows of workers stopped or unseen for longer than "
        "WORKER_RETENTION are deleted too, and the queue history's minutes older than 8 days. "
        "Safe while workers run; meant for cron. -v 2 logs "
        "each batch. "
        "Exit status 1: bad options; a database that is down or read-only, refuses the "
        "connection settings (login, database name, options), is not migrated, or whose "
        "session clock is not UTC "
        "(one line saying which)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
        )
        parser.add_argument(
            "--batch-size",
            type=whole_number(BATCH_SIZE),
            default=None,
            help="jobs deleted per statement and transaction "
            f"(default: DJANGO_LEASES['PRUNE_BATCH_SIZE'], {leases_settings.PRUNE_BATCH_SIZE})",
        )
        add_model_argument(parser)
        add_database_argument(parser)
        parser.add_argument(
            "--older-than",
            type=positive_seconds,
            default=None,
            metavar="S",
            help="prune jobs finished more than S seconds ago, whatever their status's retention "
            "(only statuses that DJANGO_LEASES['RETENTION'] lists are pruned)",
        )

    def handle(
        self,
        *,
        dry_run: bool,
        batch_size: int | None,
        older_than: float | None,
        model: type[Any] | None,
        database: str | None,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging("django_leases.prune", verbosity)
        retention = dict(leases_settings.RETENTION)
        if older_than is not None:
            retention = dict.fromkeys(retention, older_than)
        jobs = leased_jobs(model, database)
        with one_line_database_errors(jobs.db):
            check_tables(jobs.db, queue_models(jobs.model))
            # Ages are compared with the database's NOW(), as the worker and the watcher compare
            # leases: a session clock off UTC would prune (or count) jobs early by its offset.
            problems = database_clock_problems(jobs.db)
            if problems:
                raise CommandError(problems[0])
            self._prune(jobs, retention, dry_run=dry_run, batch_size=batch_size)

    def _prune(
        self,
        jobs: LeaseQuerySet[Any],
        retention: dict[str, float],
        *,
        dry_run: bool,
        batch_size: int | None,
    ) -> None:
        workers = registered_workers(jobs.db)
        history = queue_history(jobs.db)
        if dry_run:
            counts = dict(
                jobs.prunable(retention).order_by().values_list("status").annotate(n=Count("pk"))
            )
            ledger = "kept" if not leases_settings.PRUNE_LEDGER else "deleted"
            self.stdout.write(
                f"would prune {sum(counts.values())} job(s): {self._per_status(retention, counts)}"
                f"; their attempt ledger would be {ledger}; "
                f"{workers.long_gone().count()} worker registry row(s) would be pruned; "
                f"{history.prunable(jobs.model).count()} history row(s) would be pruned"
            )
            return
        started = time.monotonic()
        attempts: list[int] = []

        def on_batch(batch: PrunedBatch) -> None:
            attempts.append(batch.attempts)
            logger.debug(
                "pruned batch status=%s jobs=%s ledger_rows=%s ledger=%s",
                batch.status,
                batch.jobs,
                batch.attempts,
                "kept" if batch.keep_ledger else "deleted",
            )

        deleted = jobs.prune(retention, batch_size=batch_size, on_batch=on_batch)
        ledger = "kept (detached)" if not leases_settings.PRUNE_LEDGER else "deleted"
        self.stdout.write(
            self.style.SUCCESS(
                f"pruned {sum(deleted.values())} job(s) in {len(attempts)} batch(es) and "
                f"{time.monotonic() - started:.1f}s: {self._per_status(retention, deleted)}; "
                f"{sum(attempts)} attempt ledger row(s) {ledger}; "
                f"{workers.prune()} worker registry row(s) pruned; "
                f"{history.prune(jobs.model)} history row(s) pruned"
            )
        )

    @staticmethod
    def _per_status(retention: dict[str, float], counts: dict[str, int]) -> str:
        return ", ".join(
            f"{status} {counts.get(status, 0)} (older than {duration(age)})"
            for status, age in retention.items()
        )


def duration(seconds: float) -> str:
    """Return "30 days", "1 hour" or "90s"."""
    for unit, name in ((86400, "day"), (3600, "hour"), (60, "minute")):
        if seconds >= unit and seconds % unit == 0:
            count = seconds / unit
            return f"{count:g} {name}{'' if count == 1 else 's'}"
    return f"{seconds:g}s"
