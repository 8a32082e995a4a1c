"""Time of the admin's queue overview and job changelist against the number of finished jobs.

The table is grown in steps (by default 0, 100k and 1M completed jobs with their ledger rows,
bulk-loaded as `table_size.py` does), beside a fixed live queue of pending and processing jobs.
At each step a logged-in superuser (Django's test client, every middleware included) loads the
overview, the unfiltered changelist and the changelist filtered on `status=completed`, each
`--loads` times, twice: with the default `ADMIN_EXACT_COUNT_LIMIT` (exact counts up to it, the
database's estimate or "more than" beyond) and with the limit at its maximum, where every count
is exact as before the limit existed. The counting queries are also timed on their own: the
overview's per-status counts as they were (one GROUP BY over the whole table) and as they are
(`stats.status_tallies()`), the changelist's as it was (`COUNT(*)`) and as it is (the paginator's
`stats.tally()`). Beside each page's times: the p50 of its SQL time alone (the database's share,
from the captured queries; the rest is Python: the session, the rendering), its number of
queries, and what it showed. The live overview's fragment (`overview/live/`, what the page
fetches every few seconds) is timed as a page of its own. Last, at each size, the watcher's
aggregation of one closed minute into the queue history (`aggregate_minute()`, then the
minute's rows written once) with `--minute-jobs` jobs finished in that minute.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from bench import _common as common
from bench.gauges import add_live_argument, seed_live
from bench.table_size import load_finished, settle

PAGES = {
    "overview": ("admin:django_leases_paymentjob_overview", {}),
    "overview fragment": ("admin:django_leases_paymentjob_overview_live", {}),
    "overview fragment ?span=week": (
        "admin:django_leases_paymentjob_overview_live",
        {"span": "week"},
    ),
    "changelist": ("admin:django_leases_paymentjob_changelist", {}),
    "changelist ?status=completed": (
        "admin:django_leases_paymentjob_changelist",
        {"status": "completed"},
    ),
}


def timed(call: Callable[[], Any], loads: int) -> tuple[list[float], Any]:
    """Call `call` once to warm up, then `loads` times; return the times in ms and the last
    result."""
    result = call()
    timings = []
    for _ in range(loads):
        start = time.perf_counter()
        result = call()
        timings.append((time.perf_counter() - start) * 1000)
    return timings, result


def count_queries(jobs: Any, limit: int) -> dict[str, Callable[[], Any]]:
    """The counting queries of the two pages, as they were and as they are."""
    from django.db.models import Count

    from django_leases import stats

    return {
        "per-status GROUP BY (before)": lambda: dict(
            jobs.order_by().values_list("status").annotate(n=Count("*"))
        ),
        "status_tallies() (after)": lambda: stats.status_tallies(jobs, limit),
        "COUNT(*) of the table (before)": jobs.count,
        "tally() of the table (after)": lambda: stats.tally(jobs, limit, jobs.estimated_count),
    }


def page_timings(
    client: Any, url: str, params: dict[str, str], loads: int
) -> tuple[list[float], list[float], int, Any]:
    """Load `url` once to warm up, then `loads` times; return the times in ms, the time of
    their SQL alone in ms, the queries of the last load and the last response."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    sql_ms: list[float] = []
    counts: list[int] = []

    def load() -> Any:
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url, params)
        sql_ms.append(sum(float(q["time"]) for q in queries) * 1000)
        counts.append(len(queries))
        return response

    ms, response = timed(load, loads)
    return ms, sql_ms[1:], counts[-1], response


def busy_minute(count: int) -> Any:
    """Make `count` of the loaded finished jobs (and their ledger rows) finish in the minute
    that began three minutes ago, by the database clock, as if they ran then: due at its start,
    claimed 0-10 s later, run for up to 30 s; a tenth failed. Return the minute's start."""
    from datetime import timedelta

    from django.db.models import F
    from django.db.models.functions import Mod

    from django_leases.models import JobAttempt, PaymentJob
    from django_leases.querysets.base import database_now

    now = database_now(PaymentJob.objects.db)
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=3)
    second = timedelta(seconds=1)
    pks = list(
        PaymentJob.objects.filter(status="completed")
        .order_by("-pk")
        .values_list("pk", flat=True)[:count]
    )
    jobs = PaymentJob.objects.filter(pk__in=pks)
    jobs.update(run_at=start, completed_at=start + 40 * second + Mod(F("id"), 19) * second)
    jobs.filter(id__in=pks[::10]).update(status="failed")
    JobAttempt.objects.filter(job_ref__in=pks).update(
        claimed_at=start + Mod(F("job_ref"), 11) * second,
        ended_at=start + 40 * second + Mod(F("job_ref"), 19) * second,
    )
    return start


def aggregation_timings(count: int, loads: int) -> list[dict[str, Any]]:
    """Time the watcher's aggregation of a minute in which `count` jobs finished."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from django_leases.models import PaymentJob
    from django_leases.querysets.history import aggregate_minute
    from django_leases.tables import queue_history

    start = busy_minute(count)
    jobs = PaymentJob.objects.all()
    ms, kinds = timed(lambda: aggregate_minute(jobs, start, depth=True), loads)
    with CaptureQueriesContext(connection) as queries:
        aggregate_minute(jobs, start, depth=True)
    history = queue_history(jobs.db)
    history.filter(minute=start).delete()
    written, _ = timed(lambda: history.record_minute(jobs, start, kinds, depth=True), 1)
    shown = ", ".join(f"{kind}: {row.completed}+{row.failed}" for kind, row in kinds.items())
    return [
        {
            "what": f"aggregate_minute() of {count:,} jobs",
            "ms": ms,
            "sql_ms": ms,
            "queries": len(queries),
            "shown": shown,
        },
        # The first write (the warm-up) wrote the minute; the timed one finds it written.
        {
            "what": "record_minute(), minute written",
            "ms": written,
            "sql_ms": written,
            "queries": 0,
            "shown": "",
        },
    ]


def measure_sizes(
    sizes: list[int], live: int, loads: int, minute_jobs: int
) -> list[dict[str, Any]]:
    """Grow the table through `sizes` finished jobs; at each size time the pages and counts."""
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client, override_settings
    from django.test.utils import setup_test_environment
    from django.urls import reverse

    from django_leases.conf import DEFAULTS
    from django_leases.limits import EXACT_COUNT_LIMIT
    from django_leases.models import PaymentJob

    setup_test_environment()  # the test client's host, "testserver", is allowed
    common.migrate()
    user = get_user_model().objects.create_superuser("bench", "bench@example.com", "bench")
    client = Client()
    client.force_login(user)
    manager = PaymentJob.objects
    seed_live(live)
    default_limit = DEFAULTS["ADMIN_EXACT_COUNT_LIMIT"]
    limits = {"default": default_limit, "all exact": EXACT_COUNT_LIMIT[1]}
    loaded, steps = 0, []
    for size in sorted(sizes):
        common.note(f"  {connection.vendor}: loading {size - loaded} finished jobs ...")
        load_finished(size - loaded, churn=False)
        loaded = size
        settle(churn=False, index_cleanup=False)
        for label, limit in limits.items():
            with override_settings(DJANGO_LEASES={"ADMIN_EXACT_COUNT_LIMIT": limit}):
                for page, (name, params) in PAGES.items():
                    ms, sql_ms, queries, response = page_timings(
                        client, reverse(name), params, loads
                    )
                    if response.status_code != 200:
                        raise RuntimeError(f"{page}: HTTP {response.status_code}")
                    context = response.context
                    if page.startswith("overview"):
                        tally = context["overview"].by_status["completed"]
                    else:
                        tally = context["cl"].paginator.tally
                    shown = f"{tally.n:,} ({tally.how})"
                    steps.append(
                        {
                            "size": size,
                            "what": f"{page} page",
                            "limit": label,
                            "ms": ms,
                            "sql_ms": sql_ms,
                            "queries": queries,
                            "shown": shown,
                        }
                    )
        for what, call in count_queries(manager.all(), default_limit).items():
            ms, _ = timed(call, loads)
            steps.append(
                {
                    "size": size,
                    "what": what,
                    "limit": "",
                    "ms": ms,
                    "sql_ms": ms,
                    "queries": 1,
                    "shown": "",
                }
            )
        if size >= minute_jobs:
            for step in aggregation_timings(minute_jobs, loads):
                steps.append({"size": size, "limit": "", **step})
    return steps


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    headers = ["database", "finished rows", "what", "limit", "p50 ms", "p95 ms", "p99 ms"]
    headers += ["max ms", "SQL p50 ms", "queries", "shown"]
    skipped: dict[str, str] = {}
    steps = common.each_database(
        args,
        "admin_pages",
        lambda db: common.measure_sizes_on(
            args,
            db,
            procs,
            "bench.admin_pages:measure_sizes",
            live=args.live,
            loads=args.loads,
            minute_jobs=args.minute_jobs,
        ),
        skipped,
    )
    rows = [
        [
            vendor,
            f"{step['size']:,}",
            step["what"],
            step["limit"],
            *common.latency_summary(step["ms"]),
            f"{common.percentile(step['sql_ms'], 50):.2f}",
            step["queries"],
            step["shown"],
        ]
        for vendor, step in steps
    ]
    common.print_table(
        f"admin pages and their counts; {args.loads} loads each per size", headers, rows
    )
    common.print_skipped(skipped)


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    common.add_sizes_argument(parser)
    add_live_argument(parser)
    parser.add_argument(
        "--loads",
        type=common.positive_int,
        default=20,
        help="timed loads of each page and query per size (default: %(default)r)",
    )
    parser.add_argument(
        "--minute-jobs",
        type=common.positive_int,
        default=6000,
        help="jobs finished in the minute the history's aggregation is timed on, taken from "
        "the loaded ones (100/s; default: %(default)r)",
    )
    common.add_common_arguments(parser, databases="postgresql,sqlite,mysql", timeout=3600)
    args = parser.parse_args(argv)
    return common.run_main(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
