"""The cost of a group: statements and time of the holder's `complete()` (and permanent
`fail()`) of a member of a group (`enqueue_group()`), which writes its end into the callback,
against a job in no group.

    DATABASE_URL=postgres://.../db python -m bench.groups [--groups N] [--size M] [--runs R]

DATABASE_URL names a database of yours (default: a SQLite file in a temporary directory); the
script migrates it with the test settings and deletes its bench kinds at the end. Each run
enqueues `--groups` groups of `--size` members and as many plain jobs, claims them, then times
their completions one by one (the members in order: the last of each group releases its
callback); it prints the median and 90th percentile per completion and the statements each one
sent, for plain jobs, members that are not the last, and the last members; then the same for a
permanent failure.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench._common import in_this_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=30)
    parser.add_argument("--size", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    def runs() -> None:
        for _ in range(args.runs):
            for ending in ("complete", "fail"):
                measure(args.groups, args.size, ending)

    in_this_process(runs)


def timed(jobs: list[Any], end: Callable[[Any], object]) -> tuple[list[float], int]:
    """End each of the claimed `jobs` with `end`; return the seconds of each and the
    statements they sent in all."""
    from django.db import connection, reset_queries
    from django.test.utils import CaptureQueriesContext

    reset_queries()  # the log keeps 9,000 statements: counted from empty
    seconds = []
    with CaptureQueriesContext(connection) as queries:
        for job in jobs:
            started = time.perf_counter()
            end(job)
            seconds.append(time.perf_counter() - started)
    return seconds, len(queries)


def measure(groups: int, size: int, ending: str) -> None:
    from django.db import connection

    from django_leases.models import PaymentJob

    def end(job: Any) -> object:
        if ending == "complete":
            return PaymentJob.objects.complete(job.pk, "bench", job.lease_token)
        return PaymentJob.objects.fail(job.pk, "bench", job.lease_token, "no", permanent=True)

    plain = [PaymentJob.objects.enqueue("bench.plain") for _ in range(groups * size)]
    members: list[list[Any]] = []
    for _ in range(groups):
        group = PaymentJob.objects.enqueue_group([{"kind": "bench.member"}] * size, "bench.then")
        members.append(group.members)

    def claimed(jobs: list[Any]) -> list[Any]:
        return [PaymentJob.objects.claim_job(job.pk, "bench", ttl=600) for job in jobs]

    held_plain = claimed(plain)
    held_members = [claimed(jobs) for jobs in members]
    timings = {
        "no group": timed(held_plain, end),
        "member": timed([job for jobs in held_members for job in jobs[:-1]], end),
        "last member": timed([jobs[-1] for jobs in held_members], end),
    }
    for name, (seconds, statements) in timings.items():
        median = statistics.median(seconds) * 1000
        p90 = statistics.quantiles(seconds, n=10)[-1] * 1000
        print(
            f"{connection.vendor:10} {ending:8} {name:11} median {median:.2f} ms, "
            f"p90 {p90:.2f} ms, {statements / len(seconds):.1f} statements",
            flush=True,
        )
    released = PaymentJob.objects.filter(kind="bench.then", status="pending").count()
    if released != groups:
        raise SystemExit(f"{released} callbacks released, not {groups}")
    PaymentJob.objects.filter(kind__startswith="bench.").delete()


if __name__ == "__main__":
    main()
