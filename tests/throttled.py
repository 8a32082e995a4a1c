"""Throttled kinds for the tests, and a worker that runs them: `python -m tests.throttled
--worker-id w1 ...` (the options of `run_lease_worker`).

Registered only by `register()` (the worker here, or a test's fixture), never on import: a
throttled kind in the registry makes every claim of all kinds (`kinds=None`) in that process
take its gate.
"""

import os
import sys
import time
from typing import Any

import django

CAPPED, CAPPED_LIMIT = "capped", 2
# Limited, with a run-time limit and without, run by `tests.testapp.jobs.spanned` (which records
# its runs).
SPANNED, SPANNED_UNTIMED, SPANNED_LIMIT = "capped_spanned", "capped_spanned_untimed", 2
RATED, RATED_RATE = "rated", (3, 1.0)


def capped(job: Any, lease: Any) -> None:
    """Run as long as the payload says (per attempt), or until the lease is lost."""
    from tests.testapp.jobs import duration

    deadline = time.monotonic() + duration(job, lease)
    while time.monotonic() < deadline and not lease.lost:
        time.sleep(0.02)


def rated(job: Any, lease: Any) -> None:
    return None


def register() -> None:
    from django_leases import job_handler

    job_handler(CAPPED, limit=CAPPED_LIMIT)(capped)
    job_handler(RATED, rate=RATED_RATE)(rated)


def register_spanned() -> None:
    """Register the limited kinds whose handlers record their runs (the worker here only)."""
    from django_leases import job_handler
    from tests.testapp.jobs import spanned

    job_handler(SPANNED, limit=SPANNED_LIMIT, timeout=1)(spanned)
    job_handler(SPANNED_UNTIMED, limit=SPANNED_LIMIT)(spanned)


def unregister() -> None:
    from django_leases.handlers import unregister

    unregister(CAPPED)
    unregister(RATED)


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    django.setup()
    from django.core.management import call_command

    register()
    register_spanned()
    call_command("run_lease_worker", *sys.argv[1:])


if __name__ == "__main__":
    main()
