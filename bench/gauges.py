"""Cost of one Prometheus scrape of the queue's gauges against the number of finished jobs.

The table is grown in steps (by default 0, 100k and 1M completed jobs with their ledger rows,
bulk-loaded as `table_size.py` does), beside a fixed live queue: pending jobs, processing jobs
with open attempts (a tenth of them running for an hour) and jobs under review. At each step
`stats.queue_gauges()` — the six queries behind `django_leases_jobs`, `_jobs_stuck`,
`_jobs_near_expiry`, `_jobs_under_review`, `_jobs_running_long` and
`_oldest_due_job_wait_seconds` — is timed `--scrapes` times. If every query stays within the
live rows' index ranges, the time stays flat as finished rows pile up.
"""

from __future__ import annotations

import argparse
import time
from datetime import timedelta
from typing import Any

from bench import _common as common
from bench.table_size import load_finished, settle


def seed_live(live: int) -> None:
    """Add `live` jobs: half pending, half processing under an hour's lease (with open
    attempts)."""
    from django_leases.models import PaymentJob

    manager = PaymentJob.objects
    common.seed_pending(live)
    for n, pk in enumerate(manager.values_list("pk", flat=True)[: live // 2]):
        manager.claim_job(pk, f"bench-live-{n % 8}", ttl=3600)


def add_live_argument(parser: argparse.ArgumentParser) -> None:
    """Add --live: the live jobs beside the finished ones."""
    parser.add_argument(
        "--live",
        type=common.positive_int,
        default=2000,
        help="live jobs beside them: half pending, half processing (default: %(default)r)",
    )


def measure_sizes(sizes: list[int], live: int, scrapes: int) -> list[dict[str, Any]]:
    """Grow the table through `sizes` finished jobs; at each size time `scrapes` scrapes."""
    from django.db import connection
    from django.db.models.functions import Now

    from django_leases import stats
    from django_leases.models import JobAttempt, PaymentJob
    from django_leases.status import JobStatus

    common.migrate()
    manager = PaymentJob.objects
    seed_live(live)
    open_attempts = JobAttempt.objects.filter(ended_at__isnull=True)
    long_ones = list(open_attempts.values_list("pk", flat=True)[: live // 20])
    JobAttempt.objects.filter(pk__in=long_ones).update(claimed_at=Now() - timedelta(hours=1))
    reviewed = list(manager.pending().values_list("pk", flat=True)[:10])
    manager.filter(pk__in=reviewed).update(status=JobStatus.REVIEW)
    loaded, steps = 0, []
    for size in sorted(sizes):
        common.note(f"  {connection.vendor}: loading {size - loaded} finished jobs ...")
        load_finished(size - loaded, churn=False)
        loaded = size
        settle(churn=False, index_cleanup=False)
        gauges = stats.queue_gauges(manager.all(), near_expiry=20)  # warm-up
        timings = []
        for _ in range(scrapes):
            start = time.perf_counter()
            gauges = stats.queue_gauges(manager.all(), near_expiry=20)
            timings.append((time.perf_counter() - start) * 1000)
        steps.append(
            {
                "size": size,
                "ms": timings,
                "live": sum(gauges.by_status_and_kind.values()),
                "running_long": gauges.running_long,
            }
        )
    return steps


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    headers = ["database", "finished rows", "live jobs", "running long"]
    headers += ["p50 ms", "p95 ms", "p99 ms", "max ms"]
    skipped: dict[str, str] = {}
    steps = common.each_database(
        args,
        "gauges",
        lambda db: common.measure_sizes_on(
            args, db, procs, "bench.gauges:measure_sizes", live=args.live, scrapes=args.scrapes
        ),
        skipped,
    )
    rows = [
        [
            vendor,
            f"{step['size']:,}",
            str(step["live"]),
            str(step["running_long"]),
            *common.latency_summary(step["ms"]),
        ]
        for vendor, step in steps
    ]
    common.print_table(
        f"stats.queue_gauges() (one scrape's six queries); {args.scrapes} scrapes per size",
        headers,
        rows,
    )
    common.print_skipped(skipped)


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    common.add_sizes_argument(parser)
    add_live_argument(parser)
    parser.add_argument(
        "--scrapes",
        type=common.positive_int,
        default=50,
        help="timed scrapes per size (default: %(default)r)",
    )
    common.add_common_arguments(parser, databases="postgresql,sqlite,mysql", timeout=3600)
    args = parser.parse_args(argv)
    return common.run_main(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
