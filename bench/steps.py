"""The cost of a resumable step: statements and time of one `lease.step()` against the same work
in a plain transaction, and of a recorded step skipped on a later attempt.

    DATABASE_URL=postgres://.../db python -m bench.steps [--steps N]

DATABASE_URL names a database of yours (default: a SQLite file in a temporary directory); the
script migrates it with the test settings and leaves its rows there. Each case runs `--steps`
times in this process (one connection, no worker), each step's function inserting one row:

- plain: `with transaction.atomic(): fn()`, the work without a step;
- step: `lease.step(name, fn)`, run and recorded (a job claimed for each 10 steps);
- skipped: the same steps asked again by the job's next holder, answered from the record.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from datetime import timedelta

from bench._common import in_this_process

PER_JOB = 10


def timed(call: Callable[[], object]) -> tuple[float, int]:
    """Seconds and statements of one call."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        started = time.perf_counter()
        call()
        elapsed = time.perf_counter() - started
    return elapsed, len(queries)


def report(case: str, runs: list[tuple[float, int]]) -> None:
    times = sorted(seconds * 1e6 for seconds, _ in runs)
    statements = statistics.median(count for _, count in runs)
    print(
        f"{case:8} median {statistics.median(times):8.0f} us  "
        f"p90 {times[int(len(times) * 0.9)]:8.0f} us  statements {statements:g}"
    )


def measure(steps: int) -> None:
    from django.db import connection, transaction
    from django.db.models.functions import Now

    from django_leases.lease import Lease
    from django_leases.models import PaymentJob
    from tests.testapp.models import Charge

    def work(pk: int) -> str:
        Charge.objects.create(job_ref=pk, token=0, owner="bench")
        return "ok"

    jobs = max(1, steps // PER_JOB)
    plain = [timed(lambda: transaction.atomic()(work)(0)) for _ in range(steps)]
    leases = []
    stepped = []
    for _ in range(jobs):
        PaymentJob.objects.enqueue("bench_steps", lock="")
        (claimed,) = PaymentJob.objects.claim("bench-1", ttl=600, kinds=["bench_steps"])
        lease = Lease(claimed, ttl=600)
        leases.append(lease)
        for number in range(PER_JOB):
            name = f"s{number}"
            stepped.append(timed(lambda lease=lease, name=name: lease.step(name, work, lease.pk)))
    skipped = []
    for lease in leases:
        PaymentJob.objects.filter(pk=lease.pk).update(lease_until=Now() - timedelta(seconds=1))
        (again,) = PaymentJob.objects.claim("bench-2", ttl=600, kinds=["bench_steps"])
        later = Lease(again, ttl=600)
        for number in range(PER_JOB):
            name = f"s{number}"
            skipped.append(timed(lambda later=later, name=name: later.step(name, work, 0)))
    print(f"{connection.vendor}: {steps} steps, {jobs} jobs")
    report("plain", plain)
    report("step", stepped)
    report("skipped", skipped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()
    in_this_process(lambda: measure(args.steps))


if __name__ == "__main__":
    main()
