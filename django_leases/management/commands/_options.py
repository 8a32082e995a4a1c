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
from types import FrameType
from typing import Any, NoReturn

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError, CommandParser

from django_leases.limits import MAX_DURATION
from django_leases.querysets import job_model

WORKER_ID = re.compile(r"^[\w.:@/-]{1,255}$")


def positive_seconds(value: str) -> float:
    """Parse seconds: a positive number up to `limits.MAX_DURATION`, fractions allowed ("0.5")."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not 0 < seconds <= MAX_DURATION:  # NaN fails too
        raise argparse.ArgumentTypeError(
            f"{value!r} must be a positive number of seconds up to {MAX_DURATION} (100 years)"
        )
    return seconds


def non_negative_seconds(value: str) -> float:
    """Parse seconds that may be zero (e.g. a grace period)."""
    try:
        if float(value) == 0:
            return 0.0
    except ValueError:
        pass
    return positive_seconds(value)


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
    """Report bad command-line options as one line on stderr and exit 1, without the usage."""

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser: CommandParser = super().create_parser(prog_name, subcommand, **kwargs)  # type: ignore[misc]

        def error(message: str) -> NoReturn:
            if not parser.called_from_command_line:
                raise CommandError(f"Error: {message}")
            sys.stderr.write(f"CommandError: {subcommand}: {message}\n")
            sys.exit(1)

        parser.error = error  # type: ignore[method-assign]
        return parser


@contextmanager
def stop_signals(stop: Callable[[], None]) -> Iterator[None]:
    """Call `stop` on the first SIGTERM/SIGINT; exit at once with 128 + signum on a second.

    Installed only on the main thread; the previous handlers are restored on exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if received:
            os._exit(128 + signum)  # second signal: leave at once; leases expire
        received.append(signum)
        stop()

    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    for signum in previous:
        signal.signal(signum, on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
