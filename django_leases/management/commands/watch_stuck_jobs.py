"""`manage.py watch_stuck_jobs`: return expired leases to the pool, or hold them for review."""

import threading
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_leases.conf import leases_settings
from django_leases.exceptions import DatabaseMisconfigured
from django_leases.limits import BATCH_SIZE
from django_leases.management.commands._options import (
    OneLineErrorsMixin,
    add_database_argument,
    add_metrics_arguments,
    add_model_argument,
    configure_logging,
    metrics_endpoint,
    one_line,
    positive_seconds,
    prometheus_metrics,
    stop_signals,
    whole_number,
    worker_id,
)
from django_leases.watcher import Action, StuckWatcher
from django_leases.worker.heartbeat import default_worker_id


class Command(OneLineErrorsMixin, BaseCommand):
    help = (
        "Find jobs whose lease expired (or whose worker is known gone) and, per job kind's "
        "policy, return them to pending, hold them for review or fail them; then let reconcile "
        "hooks resolve jobs under review. Prints one line per job acted on and a summary. "
        "Runs until SIGTERM/SIGINT (exit 0 after the current pass; a second signal exits at once "
        "with status 128 + the signal number), or one pass with --once. "
        "Exit status 1: bad options; a database that refuses the connection settings (login, "
        "database name, options), is not migrated or has a session clock that is not UTC; or "
        "with --once a pass the database did not let run (without it, outages are waited out)."
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
        add_model_argument(parser)
        add_database_argument(parser)
        parser.add_argument(
            "--watcher-id",
            type=worker_id,
            default=None,
            help="name recorded in the ledger as who rescued (default: watcher:host:pid:random)",
        )
        add_metrics_arguments(parser, "the queue's gauges and the rescues per kind and action")

    def handle(
        self,
        *,
        interval: float | None,
        once: bool,
        batch_size: int,
        watcher_id: str | None,
        model: type[Any] | None,
        database: str | None,
        metrics_port: int | None,
        metrics_address: str,
        verbosity: int,
        **options: Any,
    ) -> None:
        if metrics_port is not None and once:
            raise CommandError(
                "--metrics-port needs a watcher that keeps running, not --once; from cron, "
                "route the view django_leases.metrics.queue_metrics instead"
            )
        # This command prints each job it acts on itself; the watcher's own per-job log lines
        # would repeat them, so they show from -v 2 on.
        configure_logging("django_leases.watcher", max(verbosity - 1, 0))
        watcher = StuckWatcher(
            model=model,
            using=database,
            watcher_id=watcher_id or f"watcher:{default_worker_id()}",
            batch_size=batch_size,
        )
        exporter = (
            None
            if metrics_port is None
            else prometheus_metrics().WatcherMetrics(model=watcher.model, using=watcher.using)
        )
        stop = threading.Event()

        def on_pass(actions: list[Action]) -> None:
            for action in actions:
                self.stdout.write(action.describe())
                if exporter is not None:
                    exporter.rescued(action.kind, action.action)
            if actions or once:
                self.stdout.write(self.style.SUCCESS(watcher.summary(actions)))

        failed: list[str] = []

        def on_outage(reason: str) -> None:
            if once:
                failed.append(reason)
            else:
                self.stderr.write(f"database unavailable: {one_line(reason)}; retrying next pass")

        registry = None if exporter is None else exporter.registry
        with metrics_endpoint(self, registry, metrics_port or 0, metrics_address):
            with stop_signals(stop.set):
                if not once:  # once SIGTERM stops it cleanly: a supervisor may send it at once
                    every = interval if interval is not None else leases_settings.WATCH_INTERVAL
                    self.stdout.write(
                        f"watcher starting watcher_id={watcher.watcher_id} interval={every:g}s "
                        f"model={watcher.model._meta.label} database={watcher.using}"
                    )
                try:
                    total = watcher.run(
                        interval=interval,
                        once=once,
                        stop=stop,
                        on_pass=on_pass,
                        on_outage=on_outage,
                    )
                except (ImproperlyConfigured, DatabaseMisconfigured) as exc:
                    raise CommandError(str(exc)) from None
        if failed:
            raise CommandError(f"database unavailable: {one_line(failed[0])}; the pass did not run")
        if not once:
            self.stdout.write(self.style.SUCCESS(f"watcher stopped: {total} job(s) acted on"))
