"""`manage.py run_lease_worker`: run jobs from the table until stopped."""

import argparse
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_leases.checks import heartbeat_judged_by_worker
from django_leases.conf import leases_settings
from django_leases.exceptions import DatabaseMisconfigured, WorkerIdTaken
from django_leases.handlers import registered_kinds
from django_leases.limits import (
    ACK_BATCH_SIZE,
    CONCURRENCY,
    MAX_JOBS,
    MIN_HEARTBEAT,
    MIN_POLL_INTERVAL,
    MIN_TTL,
    PROCESSES,
)
from django_leases.management.commands._options import (
    OneLineErrorsMixin,
    add_database_argument,
    add_metrics_arguments,
    add_model_argument,
    configure_logging,
    job_kind,
    metrics_endpoint,
    non_negative_seconds,
    positive_seconds,
    prometheus_metrics,
    seconds_from,
    stop_signals,
    whole_number,
    worker_id,
)
from django_leases.management.commands._processes import supervise
from django_leases.supervisor import Link
from django_leases.worker import LeaseWorker

# The worker stopped itself and wants a fresh process (documented in --help).
EXIT_RESTART = 3


class Command(OneLineErrorsMixin, BaseCommand):
    help = (
        "Claim jobs of the job table (DJANGO_LEASES['JOB_MODEL'], or --model) and run their "
        "handlers, heartbeating every lease it holds. "
        "The first SIGTERM/SIGINT stops claiming, lets running jobs finish within the grace "
        "period, releases unstarted ones and exits 0; a second one exits at once with status "
        "128 + the signal number (130 for SIGINT, 143 for SIGTERM), leaving leases to expire. "
        "Exit status 1: bad options or settings; a database that refuses the connection "
        "settings (login, database name, options), is not migrated or has a session clock "
        "that is not UTC (a database that is down is waited for); "
        "or another live worker process running under "
        "the same --worker-id. Exit status 3: the worker stopped itself for its supervisor to "
        "restart it (more handler threads still running past their kind's timeout than "
        "--concurrency). "
        "With --processes N it supervises N worker processes (one starts again when it "
        "exits) and exits 0 once they stopped after a SIGTERM/SIGINT (or, with --burst, "
        "found nothing left), 1 if one of them exited 1."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--ttl",
            type=seconds_from(MIN_TTL),
            default=None,
            help="lease length in seconds of kinds without a ttl= of their own "
            f"(default: DJANGO_LEASES['TTL'], {leases_settings.TTL})",
        )
        parser.add_argument(
            "--heartbeat",
            type=seconds_from(MIN_HEARTBEAT),
            default=None,
            help="seconds between lease renewals; shorter than --ttl "
            f"(default: DJANGO_LEASES['HEARTBEAT'], {leases_settings.HEARTBEAT})",
        )
        parser.add_argument(
            "--concurrency",
            type=whole_number(CONCURRENCY),
            default=None,
            help="jobs run at once, one thread each "
            f"(default: DJANGO_LEASES['CONCURRENCY'], {leases_settings.CONCURRENCY})",
        )
        parser.add_argument(
            "--kind",
            action="extend",
            nargs="+",
            type=job_kind,
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
            type=whole_number(MAX_JOBS),
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
            type=seconds_from(MIN_POLL_INTERVAL),
            default=None,
            help="seconds between polls when idle, jittered "
            f"(default: DJANGO_LEASES['POLL_INTERVAL'], {leases_settings.POLL_INTERVAL})",
        )
        add_model_argument(parser)
        add_database_argument(parser)
        parser.add_argument(
            "--grace-period",
            type=non_negative_seconds,
            default=None,
            help="seconds running jobs get to finish after SIGTERM "
            f"(default: DJANGO_LEASES['GRACE_PERIOD'], {leases_settings.GRACE_PERIOD})",
        )
        parser.add_argument(
            "--ack-batch-size",
            type=whole_number(ACK_BATCH_SIZE),
            default=None,
            help='completions of ack="batch" kinds written in one statement at most '
            f"(default: DJANGO_LEASES['ACK_BATCH_SIZE'], {leases_settings.ACK_BATCH_SIZE})",
        )
        parser.add_argument(
            "--ack-flush-interval",
            type=positive_seconds,
            default=None,
            help='seconds a completion of an ack="batch" kind waits at most for its batch '
            f"(default: DJANGO_LEASES['ACK_FLUSH_INTERVAL'], {leases_settings.ACK_FLUSH_INTERVAL})",
        )
        parser.add_argument(
            "--processes",
            type=whole_number(PROCESSES),
            default=None,
            metavar="N",
            help="run N worker processes of these options under this one, which starts a "
            "process again when it dies, passes SIGTERM/SIGINT on, and holds the host's only "
            "LISTEN connection, handing each enqueue to one idle process (on PostgreSQL); "
            "--worker-id ID names them ID-1, ID-2, ... (numbered by start), --metrics-port P "
            "serves them on P, P+1, ... (default: one process, no supervisor)",
        )
        # The socket of a worker process started by `--processes` (the supervisor's link).
        parser.add_argument("--supervisor-fd", type=int, default=None, help=argparse.SUPPRESS)
        add_metrics_arguments(parser, "this process's counters and histograms per job kind")

    def check(self, *args: Any, **kwargs: Any) -> None:
        # The worker compares its own --heartbeat with the kinds it serves (a one-line error).
        with heartbeat_judged_by_worker():
            super().check(*args, **kwargs)

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
        ack_batch_size: int | None,
        ack_flush_interval: float | None,
        model: type[Any] | None,
        database: str | None,
        metrics_port: int | None,
        metrics_address: str,
        processes: int | None,
        supervisor_fd: int | None,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging("django_leases.worker", verbosity)
        link = None if supervisor_fd is None else Link(supervisor_fd)
        recorder = (
            None
            if metrics_port is None or processes is not None
            else prometheus_metrics().WorkerMetrics(
                model=model, using=database, kinds=kinds or registered_kinds()
            )
        )
        try:
            worker = LeaseWorker(
                model=model,
                using=database,
                ttl=ttl,
                heartbeat=heartbeat,
                concurrency=concurrency,
                kinds=kinds,
                burst=burst,
                max_jobs=max_jobs,
                worker_id=worker_id,
                poll_interval=poll_interval,
                grace_period=grace_period,
                ack_batch_size=ack_batch_size,
                ack_flush_interval=ack_flush_interval,
                recorder=recorder,
                wakeups=link,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if processes is not None:
            if metrics_port is not None:
                prometheus_metrics()  # the extra's absence said once, not by every process
            given = {
                "ttl": ttl,
                "heartbeat": heartbeat,
                "concurrency": concurrency,
                "kinds": kinds,
                "burst": burst,
                "max_jobs": max_jobs,
                "worker_id": worker_id,
                "poll_interval": poll_interval,
                "grace_period": grace_period,
                "ack_batch_size": ack_batch_size,
                "ack_flush_interval": ack_flush_interval,
                "model": model,
                "database": database,
                "metrics_port": metrics_port,
                "metrics_address": metrics_address,
                "verbosity": verbosity,
                **options,
            }
            supervise(worker, processes, given)
            self.stdout.write(self.style.SUCCESS(f"{processes} worker processes stopped"))
            return
        if link is not None:
            link.start(worker.stop)
        registry = None if recorder is None else recorder.registry
        with metrics_endpoint(self, registry, metrics_port or 0, metrics_address):
            with stop_signals(worker.stop):
                try:
                    stats = worker.run()
                except (WorkerIdTaken, DatabaseMisconfigured) as exc:
                    raise CommandError(str(exc)) from None
        if worker.failure is not None:
            raise CommandError(
                f"worker {worker.worker_id} stopped itself: {worker.failure} ({stats.summary()})",
                returncode=EXIT_RESTART,
            )
        self.stdout.write(
            self.style.SUCCESS(f"worker {worker.worker_id} stopped: {stats.summary()}")
        )
