"""The cost of a dependency: statements and time of the holder's `complete()` of a job that
another job waits on (`enqueue(after=...)`, which it releases), against a job nobody waits on.

    DATABASE_URL=postgres://.../db python bench/dependencies.py [--jobs N] [--runs R]

DATABASE_URL names a database of yours (default: a SQLite file in a temporary directory); the
script migrates it with the test settings and leaves its rows there. Each run enqueues `--jobs`
plain jobs and `--jobs` prerequisites (each with one dependent), claims them all, then times
their completions one by one; it prints the median and 90th percentile per completion and the
statements each one sent. A second line does the same for the last prerequisite of a dependent
waiting on two (the one that releases it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("DATABASE_URL", f"sqlite:///{tmp}/bench.sqlite3")
        os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
        sys.path.insert(0, str(ROOT))
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        for _ in range(args.runs):
            measure(args.jobs)


def completions(jobs: list[Any]) -> tuple[list[float], int]:
    """Claim `jobs`, then complete each; return the seconds of each completion and the
    statements they sent in all."""
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext

    from django_leases.models import PaymentJob

    reset_queries()
    held = [PaymentJob.objects.claim_job(job.pk, "bench", ttl=600) for job in jobs]
    seconds = []
    with CaptureQueriesContext(connection) as queries:
        for job in held:
            if job is None:
                raise SystemExit("a job of the bench was not claimable")
            started = time.perf_counter()
            PaymentJob.objects.complete(job.pk, "bench", job.lease_token)
            seconds.append(time.perf_counter() - started)
    return seconds, len(queries)


def measure(count: int) -> None:
    from django.db import connection

    from django_leases.models import PaymentJob

    plain = [PaymentJob.objects.enqueue("bench.plain") for _ in range(count)]
    awaited = [PaymentJob.objects.enqueue("bench.awaited") for _ in range(count)]
    for job in awaited:
        PaymentJob.objects.enqueue("bench.dependent", after=[job])
    firsts = [PaymentJob.objects.enqueue("bench.first") for _ in range(count)]
    lasts = [PaymentJob.objects.enqueue("bench.last") for _ in range(count)]
    for first, last in zip(firsts, lasts, strict=True):
        PaymentJob.objects.enqueue("bench.dependent", after=[first, last])
    completions(firsts)
    vendor = connection.vendor
    measured = (("no dependents", plain), ("one dependent", awaited), ("last of two", lasts))
    for name, jobs in measured:
        seconds, statements = completions(jobs)
        median = statistics.median(seconds) * 1000
        p90 = statistics.quantiles(seconds, n=10)[-1] * 1000
        print(
            f"{vendor:10} {name:14} complete(): median {median:.2f} ms, p90 {p90:.2f} ms, "
            f"{statements / len(jobs):.1f} statements",
            flush=True,
        )
    released = PaymentJob.objects.filter(kind="bench.dependent", status="pending").count()
    if released != 2 * count:
        raise SystemExit(f"{released} dependents released, not {2 * count}")
    PaymentJob.objects.filter(kind__startswith="bench.").delete()


if __name__ == "__main__":
    main()
