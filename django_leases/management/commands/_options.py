"""Argument types shared by the management commands: each raises a one-line error."""

import argparse
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType, ModuleType
from typing import Any, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DatabaseError, connections

from django_leases.exceptions import DatabaseMisconfigured, InvalidArgument
from django_leases.limits import (
    PORT,
    ZERO_OR_MORE_SECONDS,
    check_kind,
    duration_range,
    in_duration_range,
)
from django_leases.outages import is_outage, misconfiguration, one_line
from django_leases.redaction import error_text
from django_leases.tables import job_model

WORKER_ID = re.compile(r"^[\w.:@/-]{1,255}$")


def _seconds(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None


def seconds_from(minimum: float) -> Callable[[str], float]:
    """Return an argparse type that parses seconds in `limits.duration_range(minimum)`."""

    def parse(value: str) -> float:
        seconds = _seconds(value)
        if not in_duration_range(seconds, minimum):
            raise argparse.ArgumentTypeError(f"{value!r} must be {duration_range(minimum)}")
        return seconds

    parse.__name__ = "seconds"  # argparse names the type in its own messages
    return parse


positive_seconds = seconds_from(0.0)
"""Parse seconds: a positive number up to `limits.MAX_DURATION`, fractions allowed ("0.5")."""


def non_negative_seconds(value: str) -> float:
    """Parse seconds that may be zero (e.g. a grace period)."""
    seconds = _seconds(value)
    if seconds != 0 and not in_duration_range(seconds):
        raise argparse.ArgumentTypeError(f"{value!r} must be {ZERO_OR_MORE_SECONDS}")
    return seconds


def job_kind(value: str) -> str:
    """Parse a job kind (`--kind`), as `enqueue()` checks it."""
    try:
        return check_kind(value)
    except InvalidArgument as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def whole_number(bounds: tuple[int, int]) -> Callable[[str], int]:
    """Return an argparse type that parses a whole number within `bounds` (see `limits`)."""
    low, high = bounds

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"{value!r} must be from {low} to {high}")
        return number

    parse.__name__ = "whole number"  # argparse names the type in its own messages
    return parse


def worker_id(value: str) -> str:
    if not WORKER_ID.match(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a valid worker id (1-255 letters, digits or . _ : @ / -)"
        )
    return value


def job_model_label(value: str) -> type[Any]:
    """Parse `--model app_label.ModelName`: an installed concrete `AbstractLeasedJob` model."""
    try:
        return job_model(value)
    except ImproperlyConfigured as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_model_argument(parser: CommandParser) -> None:
    parser.add_argument(
        "--model",
        type=job_model_label,
        default=None,
        metavar="APP_LABEL.MODEL",
        help="the job table to work on (default: DJANGO_LEASES['JOB_MODEL'])",
    )


def database_alias(value: str) -> str:
    """argparse type: an alias of DATABASES."""
    if value not in connections.settings:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a database of DATABASES ({', '.join(connections.settings)})"
        )
    return value


def add_database_argument(parser: CommandParser) -> None:
    parser.add_argument(
        "--database",
        type=database_alias,
        default=None,
        metavar="ALIAS",
        help="the database whose queue to work on (default: where the routers send writes of "
        "the job model, else 'default')",
    )


@contextmanager
def one_line_database_errors(alias: str) -> Iterator[None]:
    """Report a database error of the block as one line (exit 1): what to fix for a
    configuration error, "database unavailable" for an outage. For commands that run once."""
    try:
        yield
    except DatabaseMisconfigured as exc:
        raise CommandError(str(exc)) from None
    except DatabaseError as exc:
        message = misconfiguration(exc, alias)
        if message is None and not is_outage(exc, alias):
            raise
        raise CommandError(
            message or f"database unavailable: {one_line(error_text(exc))}"
        ) from None


def configure_logging(logger_name: str, verbosity: int) -> None:
    """Map --verbosity 0/1/2+ to WARNING/INFO/DEBUG on the django_leases loggers."""
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbosity, logging.DEBUG)
    logger = logging.getLogger("django_leases")
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logger.addHandler(handler)
    logging.getLogger(logger_name).setLevel(level)


class OneLineErrorsMixin:
    """Report bad command-line options as one line on stderr and exit 1, without the usage;
    run the system checks without connecting, so that the command itself tells an outage
    (waited out) from a configuration error (one line)."""

    def get_check_kwargs(self, options: Any) -> Any:
        # Django 6 runs the checks against every database when given none, which on MariaDB/
        # MySQL connects (to tell one from the other) and fails with a traceback before the
        # command starts. `manage.py check --database` still runs them.
        return {**super().get_check_kwargs(options), "databases": []}  # type: ignore[misc]

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser: CommandParser = super().create_parser(prog_name, subcommand, **kwargs)  # type: ignore[misc]

        def error(message: str) -> NoReturn:
            if not parser.called_from_command_line:
                raise CommandError(f"Error: {message}")
            sys.stderr.write(f"CommandError: {subcommand}: {message}\n")
            sys.exit(1)

        parser.error = error  # type: ignore[method-assign]
        return parser


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_signals(
    stop: Callable[[], None], at_second: Callable[[int], None] | None = None
) -> Iterator[None]:
    """Call `stop` on the first SIGTERM/SIGINT; exit at once with 128 + signum on a second,
    after `at_second(signum)` (in the handler: it must take no lock).

    Installed only on the main thread; the previous handlers are restored on exit. `stop` runs
    on a thread of its own, woken through `signal.set_wakeup_fd()`, never in the handler: a
    handler runs on the main thread between two of its bytecodes, maybe while it holds a lock
    that `stop` takes (the worker's loop clears and waits on the Event that `stop` sets), and
    then `stop` waited for that thread forever: SIGTERM hung the worker until SIGKILL.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if received:
            if at_second is not None:
                at_second(signum)
            os._exit(128 + signum)  # second signal: leave at once; leases expire
        received.append(signum)

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)

    def relay() -> None:
        # The signal numbers the C-level handler wrote; b"" once the context is left.
        while numbers := os.read(wake_read, 64):
            if any(number in STOP_SIGNALS for number in numbers):
                stop()
                return

    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    for signum in previous:
        signal.signal(signum, on_signal)
    previous_fd = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    relay_thread = threading.Thread(target=relay, name="stop-signals", daemon=True)
    relay_thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.close(wake_write)
        relay_thread.join()
        os.close(wake_read)


def add_metrics_arguments(parser: CommandParser, what: str) -> None:
    """Add --metrics-port and --metrics-address, which serve `what` to Prometheus."""
    parser.add_argument(
        "--metrics-port",
        type=whole_number(PORT),
        default=None,
        metavar="PORT",
        help=f"serve {what} to Prometheus at http://ADDRESS:PORT/metrics; 0 picks a free port "
        'and prints it (needs the extra: pip install "django-leases[prometheus]")',
    )
    parser.add_argument(
        "--metrics-address",
        metavar="ADDRESS",
        # The endpoint has no authentication: only this host reaches it unless told otherwise.
        default="127.0.0.1",
        help="address the metrics endpoint listens on (default: %(default)r, this host only; "
        "0.0.0.0 for every interface)",
    )


def prometheus_metrics() -> ModuleType:
    """Return `django_leases.metrics`; without prometheus_client, a one-line `CommandError`."""
    try:
        # Imported here: prometheus_client is an optional extra, needed only for --metrics-port.
        from django_leases import metrics
    except ImportError as exc:
        if not (exc.name or "").startswith("prometheus_client"):
            raise
        raise CommandError(
            '--metrics-port needs prometheus_client: pip install "django-leases[prometheus]"'
        ) from None
    return metrics


@contextmanager
def metrics_endpoint(
    command: BaseCommand, registry: object | None, port: int, address: str
) -> Iterator[None]:
    """Serve `registry` (a prometheus_client `CollectorRegistry`) while the block runs, and
    print where; without one, do nothing."""
    if registry is None:
        yield
        return
    try:
        endpoint = prometheus_metrics().Endpoint(registry, port, address)
    except OSError as exc:
        raise CommandError(
            f"--metrics-port: cannot listen on {address}:{port}: {exc.strerror or exc}"
        ) from None
    command.stdout.write(f"metrics at http://{address}:{endpoint.port}/metrics")
    try:
        yield
    finally:
        endpoint.close()
