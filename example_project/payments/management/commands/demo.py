"""`manage.py demo`: the payment demo end to end (the work is in `payments/demo.py`)."""

import argparse
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

import environ
from django.core.management.base import BaseCommand, CommandError, CommandParser
from rich.console import Console

from django_leases.management.commands._options import OneLineErrorsMixin, positive_seconds
from example_project.payments.demo import (
    MANAGE_PY,
    DatabaseUnreachableError,
    Demo,
    Interrupted,
    Options,
    render,
)


def count(low: int, high: int) -> Any:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{value!r} must be from {low} to {high}")
        return number

    return parse


def database_url(value: str) -> str:
    if urlsplit(value).scheme not in environ.Env.DB_SCHEMES:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a database URL (e.g. postgres://user@host:5432/name)"
        )
    return value


class Command(OneLineErrorsMixin, BaseCommand):
    help = (
        "Run the payment demo: migrate, add payments and their jobs, start worker processes and "
        "a stuck watcher, SIGKILL one worker mid-job and freeze another past its leases, show "
        "the jobs settle, then audit the fake PSP for double charges. Exit status: 0 all settled "
        "and no double charge; 1 bad options; 2 double charges (or payments the PSP never "
        "charged); 3 jobs left unsettled after --timeout, a recorded step run again, or a "
        "dependent started before its capture; 130/143 interrupted by SIGINT/SIGTERM "
        "(every worker and watcher is stopped first)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--jobs",
            type=count(1, 5000),
            default=300,
            help="jobs; a capture and its refund may share a payment (%(default)r)",
        )
        parser.add_argument(
            "--workers",
            type=count(1, 16),
            default=3,
            help="run_lease_worker processes, 3 slots each (%(default)r)",
        )
        parser.add_argument(
            "--database-url",
            type=database_url,
            default=None,
            help="run on this database instead of DATABASE_URL or the SQLite file; it is "
            "migrated, and passed to every worker and watcher",
        )
        parser.add_argument(
            "--timeout",
            type=positive_seconds,
            default=300.0,
            help="seconds to wait for every job to settle (%(default)r)",
        )

    def handle(
        self,
        *,
        jobs: int,
        workers: int,
        database_url: str | None,
        timeout: float,
        **options: Any,
    ) -> None:
        if database_url and os.environ.get("DATABASE_URL") != database_url:
            # Settings read DATABASE_URL once, at start-up: start again with it.
            os.environ["DATABASE_URL"] = database_url
            argv = ["demo", "--jobs", str(jobs), "--workers", str(workers)]
            argv += ["--timeout", str(timeout), "--database-url", database_url]
            os.execv(sys.executable, [sys.executable, str(MANAGE_PY), *argv])  # noqa: S606
        console = Console()
        demo = Demo(Options(jobs=jobs, workers=workers, timeout=timeout), console)
        previous = self._install_signal_handlers(demo)
        try:
            report = demo.run()
        except DatabaseUnreachableError as exc:
            raise CommandError(str(exc).replace("\n", " ")) from None
        except Interrupted as exc:
            self.stderr.write(f"interrupted by {exc}: every worker and watcher was stopped")
            sys.exit(128 + exc.signum)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        render(report, console, database_url)
        if report.problems:
            raise CommandError("; ".join(report.problems), returncode=report.exit_code)

    def _install_signal_handlers(self, demo: Demo) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            demo.interrupt(signum)

        previous: dict[int, Any] = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.getsignal(signum)
            signal.signal(signum, on_signal)
        return previous
