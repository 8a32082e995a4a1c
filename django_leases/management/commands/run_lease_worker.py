"""`manage.py run_lease_worker`: run jobs from the table until stopped."""

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_leases.conf import leases_settings
from django_leases.management.commands._options import (
    OneLineErrorsMixin,
    configure_logging,
    non_negative_seconds,
    positive_int,
    positive_seconds,
    stop_signals,
    worker_id,
)
from django_leases.worker import LeaseWorker


class Command(OneLineErrorsMixin, BaseCommand):
    help = (
        "Claim payment jobs and run their handlers, heartbeating every lease it holds. "
        "The first SIGTERM/SIGINT stops claiming, lets running jobs finish within the grace "
        "period, releases unstarted ones and exits 0; a second one exits at once with status "
        "128 + the signal number (130 for SIGINT, 143 for SIGTERM), leaving leases to expire. "
        "Exit status 1: bad options or settings."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--ttl",
            type=positive_seconds,
            default=None,
            help=f"lease length in seconds (default: DJANGO_LEASES['TTL'], {leases_settings.TTL})",
        )
        parser.add_argument(
            "--heartbeat",
            type=positive_seconds,
            default=None,
            help="seconds between lease renewals; shorter than --ttl "
            f"(default: DJANGO_LEASES['HEARTBEAT'], {leases_settings.HEARTBEAT})",
        )
        parser.add_argument(
            "--concurrency",
            type=positive_int,
            default=None,
            help="jobs run at once, one thread each "
            f"(default: DJANGO_LEASES['CONCURRENCY'], {leases_settings.CONCURRENCY})",
        )
        parser.add_argument(
            "--kind",
            action="extend",
            nargs="+",
            dest="kinds",
            metavar="K",
            default=None,
            help="claim only these job kinds: '--kind a b', '--kind a --kind b' or both "
            "(default: every registered kind)",
        )
        parser.add_argument(
            "--burst",
            action="store_true",
            help="exit 0 once no claimable job is left",
        )
        parser.add_argument(
            "--max-jobs",
            type=positive_int,
            default=None,
            help="exit after running this many jobs",
        )
        parser.add_argument(
            "--worker-id",
            type=worker_id,
            default=None,
            help="lease owner name (default: host:pid:random)",
        )
        parser.add_argument(
            "--poll-interval",
            type=positive_seconds,
            default=None,
            help="seconds between polls when idle, jittered "
            f"(default: DJANGO_LEASES['POLL_INTERVAL'], {leases_settings.POLL_INTERVAL})",
        )
        parser.add_argument(
            "--grace-period",
            type=non_negative_seconds,
            default=None,
            help="seconds running jobs get to finish after SIGTERM "
            f"(default: DJANGO_LEASES['GRACE_PERIOD'], {leases_settings.GRACE_PERIOD})",
        )

    def handle(
        self,
        *,
        ttl: float | None,
        heartbeat: float | None,
        concurrency: int | None,
        kinds: list[str] | None,
        burst: bool,
        max_jobs: int | None,
        worker_id: str | None,
        poll_interval: float | None,
        grace_period: float | None,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging("django_leases.worker", verbosity)
        try:
            worker = LeaseWorker(
                ttl=ttl,
                heartbeat=heartbeat,
                concurrency=concurrency,
                kinds=kinds,
                burst=burst,
                max_jobs=max_jobs,
                worker_id=worker_id,
                poll_interval=poll_interval,
                grace_period=grace_period,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        with stop_signals(worker.stop):
            stats = worker.run()
        self.stdout.write(
            self.style.SUCCESS(f"worker {worker.worker_id} stopped: {stats.summary()}")
        )
