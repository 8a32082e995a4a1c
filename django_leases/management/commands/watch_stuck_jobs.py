"""`manage.py watch_stuck_jobs`: return expired leases to the pool, or hold them for review."""

import random
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import InterfaceError, OperationalError, close_old_connections

from django_leases.checks import database_clock_problems
from django_leases.conf import leases_settings
from django_leases.limits import BATCH_SIZE
from django_leases.management.commands._options import (
    OneLineErrorsMixin,
    configure_logging,
    positive_seconds,
    stop_signals,
    whole_number,
    worker_id,
)
from django_leases.redaction import error_text
from django_leases.watcher import StuckWatcher
from django_leases.worker import default_worker_id


class Command(OneLineErrorsMixin, BaseCommand):
    help = (
        "Find jobs whose lease expired (or whose worker is known gone) and, per job kind's "
        "policy, return them to pending, hold them for review or fail them; then let reconcile "
        "hooks resolve jobs under review. Prints one line per job acted on and a summary. "
        "Runs until SIGTERM/SIGINT (exit 0 after the current pass; a second signal exits at once "
        "with status 128 + the signal number), or one pass with --once. "
        "Exit status 1: bad options, or a database session clock that is not UTC."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--interval",
            type=positive_seconds,
            default=None,
            help="seconds between passes, jittered "
            f"(default: DJANGO_LEASES['WATCH_INTERVAL'], {leases_settings.WATCH_INTERVAL})",
        )
        parser.add_argument("--once", action="store_true", help="run one pass and exit (for cron)")
        parser.add_argument(
            "--batch-size",
            type=whole_number(BATCH_SIZE),
            default=500,
            help="jobs handled per pass and kind of action (default: %(default)r)",
        )
        parser.add_argument(
            "--watcher-id",
            type=worker_id,
            default=None,
            help="name recorded in the ledger as who rescued (default: watcher:host:pid:random)",
        )

    def handle(
        self,
        *,
        interval: float | None,
        once: bool,
        batch_size: int,
        watcher_id: str | None,
        verbosity: int,
        **options: Any,
    ) -> None:
        # This command prints each job it acts on itself; the watcher's own per-job log lines
        # would repeat them, so they show from -v 2 on.
        configure_logging("django_leases.watcher", max(verbosity - 1, 0))
        watcher = StuckWatcher(
            watcher_id=watcher_id or f"watcher:{default_worker_id()}", batch_size=batch_size
        )
        problems = database_clock_problems(watcher.using)
        if problems:
            raise CommandError(problems[0])
        every = interval if interval is not None else leases_settings.WATCH_INTERVAL
        stop = threading.Event()
        total = 0
        with stop_signals(stop.set):
            while True:
                close_old_connections()
                try:
                    actions = watcher.run_once()
                except (OperationalError, InterfaceError) as exc:
                    reason = error_text(exc)
                    self.stderr.write(f"database unavailable: {reason}; retrying next pass")
                    actions = []
                for action in actions:
                    self.stdout.write(action.describe())
                total += len(actions)
                if once:
                    self.stdout.write(self.style.SUCCESS(watcher.summary(actions)))
                    return
                if actions:
                    self.stdout.write(self.style.SUCCESS(watcher.summary(actions)))
                # Jitter keeps several watchers from scanning in lockstep.
                if stop.wait(every * random.uniform(0.8, 1.2)):  # noqa: S311
                    break
        self.stdout.write(self.style.SUCCESS(f"watcher stopped: {total} job(s) acted on"))
