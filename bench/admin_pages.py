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
from the captured queries; the rest is Python: the session, the rendering), and what it showed.
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
) -> tuple[list[float], list[float], Any]:
    """Load `url` once to warm up, then `loads` times; return the times in ms, the time of
    their SQL alone in ms, and the last response."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    sql_ms: list[float] = []

    def load() -> Any:
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url, params)
        sql_ms.append(sum(float(q["time"]) for q in queries) * 1000)
        return response

    ms, response = timed(load, loads)
    return ms, sql_ms[1:], response


def measure_sizes(sizes: list[int], live: int, loads: int) -> list[dict[str, Any]]:
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
                    ms, sql_ms, response = page_timings(client, reverse(name), params, loads)
                    if response.status_code != 200:
                        raise RuntimeError(f"{page}: HTTP {response.status_code}")
                    context = response.context
                    if page == "overview":
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
                            "shown": shown,
                        }
                    )
        for what, call in count_queries(manager.all(), default_limit).items():
            ms, _ = timed(call, loads)
            steps.append(
                {"size": size, "what": what, "limit": "", "ms": ms, "sql_ms": ms, "shown": ""}
            )
    return steps


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    headers = ["database", "finished rows", "what", "limit", "p50 ms", "p95 ms", "p99 ms"]
    headers += ["max ms", "SQL p50 ms", "shown"]
    skipped: dict[str, str] = {}
    steps = common.each_database(
        args,
        "admin_pages",
        lambda db: common.measure_sizes_on(
            args, db, procs, "bench.admin_pages:measure_sizes", live=args.live, loads=args.loads
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
    common.add_common_arguments(parser, databases="postgresql,sqlite,mysql", timeout=3600)
    args = parser.parse_args(argv)
    return common.run_main(run, args)


if __name__ == "__main__":
    raise SystemExit(main())
