"""Claim cost against the number of finished jobs in the table.

The table is grown in steps (by default 0, 100k and 1M completed jobs, each with its attempt
ledger row, bulk-loaded in SQL), and at each step the same number of pending jobs is added and
claimed one claim() at a time. If the partial indexes do their work, the latency and, on
PostgreSQL, the buffers that `EXPLAIN (ANALYZE, BUFFERS)` reports for the claiming statement stay
flat as finished rows pile up. The claim statement's plan is printed once, at the largest size.

By default the finished rows are inserted as completed and the table is vacuumed as autovacuum
would (`--index-cleanup` forces the index cleanup that VACUUM skips on a big table with few dead
rows). `--churn` instead inserts them pending and takes them through processing
to completed with UPDATEs, as workers do, and measures before any vacuum: both partial indexes
still hold their dead entries (autovacuum is off for the table on PostgreSQL during the run, so
the state is reproducible).

`--waiting-behind LOCKS` grows a backlog instead: LOCKS jobs with a `lock` each hold it with a
live lease (processing), and the sizes are jobs waiting behind those busy locks (status
waiting, spread over the LOCKS locks). Waiting jobs are in no index a claim walks, so the
claim of the lock-free pending jobs should cost the same with 0 or 100k of them.

`--other-kind` grows a backlog of another kind instead: the sizes are due pending jobs of kind
"backlog", older than every `noop` job (so ahead of them in claim order), or with
`--other-kind expired` processing jobs of that kind whose lease expired long ago (what a kind
no worker serves leaves behind when no watcher runs); each claim is
`claim(kinds=KINDS)` (`--kinds`, default `noop`; `noop,capture` for a worker of several kinds).
A claim that had to walk past the backlog would grow with it; the ratio to the empty table is
printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from bench import _common as common
from tests.rows import copy_sql, series

LOADER = "bench-loader"
CHUNK = 100_000
LONG_AGO = "'2000-01-01 00:00:00'"


# ---- Django side -----------------------------------------------------------------------------


def load_finished(count: int, churn: bool) -> None:
    """Add `count` finished jobs and their ledger rows, in chunks of CHUNK rows.

    Each is a copy of one job (and its ledger row) that went through enqueue(), claim_job() and
    complete(), so every column holds what the app itself writes.
    """
    from django.db import connection, transaction

    from django_leases.models import JobAttempt, PaymentJob

    manager = PaymentJob.objects
    template = manager.claim_job(manager.enqueue("noop").pk, LOADER, ttl=60)
    if template is None:
        raise RuntimeError("could not claim the template job")
    manager.complete(template.pk, LOADER, template.lease_token)
    attempt = JobAttempt.objects.get(job_ref=template.pk)
    status = "'pending'" if churn else "'completed'"
    job_values = {"status": status, "lease_owner": f"'{LOADER}'", "run_at": LONG_AGO}
    job_values |= {"lease_until": LONG_AGO, "created_at": LONG_AGO, "completed_at": LONG_AGO}
    for first in range(0, count, CHUNK):
        prefix, source = series(connection.vendor, min(CHUNK, count - first))
        with transaction.atomic():
            last = manager.order_by("-pk").values_list("pk", flat=True).first() or 0
            common.execute(
                f"{prefix} {copy_sql(PaymentJob, source, 't.id = %s', job_values)}",
                [template.pk],
            )
            if churn:
                # As claim() and complete() do: each step leaves the row version that the
                # previous status's partial index points to behind, dead.
                for step in ("processing", "completed"):
                    common.execute(
                        f"UPDATE {common.JOB_TABLE} SET status = %s "
                        f"WHERE lease_owner = %s AND id > %s",
                        [step, LOADER, last],
                    )
            common.execute(
                copy_sql(
                    JobAttempt,
                    f"{common.JOB_TABLE} j",
                    "t.id = %s AND j.lease_owner = %s AND j.id > %s",
                    {"job_id": "j.id", "job_ref": "j.id"},
                ),
                [attempt.pk, LOADER, last],
            )
    attempt.delete()
    manager.filter(pk=template.pk).delete()


def hold_locks(locks: int) -> None:
    """Make `locks` jobs hold a lock each ("bench:0", ...) with a live lease of an hour."""
    from django_leases.models import PaymentJob

    manager = PaymentJob.objects
    for i in range(locks):
        job = manager.enqueue("noop", lock=f"bench:{i}")
        if manager.claim_job(job.pk, LOADER, ttl=3600) is None:
            raise RuntimeError(f"could not claim the holder of lock bench:{i}")


def load_copies(template: Any, count: int, values: dict[str, str], after: str = "") -> None:
    """Add `count` copies of the job `template` with `values` (column -> SQL) replaced, in
    chunks of CHUNK rows; run `after` (an UPDATE taking the first new id) on each chunk."""
    from django.db import connection, transaction

    from django_leases.models import PaymentJob

    manager = PaymentJob.objects
    for first in range(0, count, CHUNK):
        prefix, source = series(connection.vendor, min(CHUNK, count - first))
        with transaction.atomic():
            last = manager.order_by("-pk").values_list("pk", flat=True).first() or 0
            common.execute(
                f"{prefix} {copy_sql(PaymentJob, source, 't.id = %s', values)}", [template.pk]
            )
            if after:
                common.execute(after, [last])
    manager.filter(pk=template.pk).delete()


def load_waiting(count: int, locks: int) -> None:
    """Add `count` jobs waiting behind the `locks` busy locks."""
    from django.db import connection

    from django_leases.models import PaymentJob

    template = PaymentJob.objects.enqueue("noop", lock="bench:0")
    if template.status != PaymentJob.Status.WAITING:
        raise RuntimeError("the template job should wait behind bench:0")
    spread = (
        f"CONCAT('bench:', id %% {locks})"
        if connection.vendor == "mysql"
        else (f"'bench:' || (id %% {locks})")
    )
    lock = connection.ops.quote_name("lock")
    after = f"UPDATE {common.JOB_TABLE} SET {lock} = {spread} WHERE id > %s"
    values = {"lease_owner": f"'{LOADER}'", "created_at": LONG_AGO}
    load_copies(template, count, values, after)


def load_backlog(count: int, state: str) -> None:
    """Add `count` jobs of kind "backlog" ahead of every `noop` job in claim order: due pending
    jobs (`state` "due"), or processing jobs whose lease expired long ago ("expired")."""
    from django_leases.models import PaymentJob

    template = PaymentJob.objects.enqueue("backlog")
    values = {"lease_owner": f"'{LOADER}'", "run_at": LONG_AGO, "created_at": LONG_AGO}
    if state == "expired":
        values |= {"status": "'processing'", "lease_until": LONG_AGO, "attempts": "1"}
    load_copies(template, count, values)


def settle(churn: bool, index_cleanup: bool, vacuum: bool = False) -> None:
    """Refresh statistics; also VACUUM on PostgreSQL unless the dead rows are the point (`churn`
    without `vacuum`).

    A plain VACUUM, like autovacuum, skips index cleanup when the dead rows sit on under 2% of
    the heap's pages (PostgreSQL 14+), which leaves their entries in the partial indexes, unless
    the table says `vacuum_index_cleanup = on` (django_leases' migration 0002 does);
    `index_cleanup` forces it.
    """
    from django.db import connection

    tables = (common.JOB_TABLE, common.LEDGER_TABLE)
    options = "ANALYZE, INDEX_CLEANUP ON" if index_cleanup else "ANALYZE"
    if connection.vendor == "postgresql" and (vacuum or not churn):
        for table in tables:
            common.execute(f"VACUUM ({options}) {table}")
    else:
        common.analyze(*tables)


def capture_claim_sql(
    owner: str, ttl: float, kinds: list[str] | None, limit: int = 1, takeover: bool = True
) -> list[tuple[str, Any]]:
    """Run one claim() of up to `limit` jobs (not `takeover`: due jobs only, as a worker's
    claims between its takeovers) and return the statements it sent (SQL and parameters)."""
    from django.db import connection

    from django_leases.models import PaymentJob

    statements: list[tuple[str, Any]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        # As sent: a list, or a dict for the named parameters of the statements in sql/.
        statements.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        jobs = PaymentJob.objects.claim(owner, ttl=ttl, kinds=kinds, limit=limit, takeover=takeover)
    for job in jobs:
        PaymentJob.objects.complete(job.pk, owner, job.lease_token)
    return statements


def explain_claim(
    owner: str, ttl: float, kinds: list[str] | None, limit: int = 1, takeover: bool = True
) -> dict[str, Any]:
    """EXPLAIN the statement of claim() (of up to `limit` jobs) that picks the jobs, on this
    database's terms.

    PostgreSQL: EXPLAIN (ANALYZE, BUFFERS) of the claiming UPDATE (the EXECUTE of its prepared
    statement, as a worker runs it), rolled back. MariaDB: ANALYZE of each SELECT (the rows
    they really read; `_explain_mariadb()`). SQLite: EXPLAIN QUERY PLAN of the claiming UPDATE.
    """
    import json

    from django.db import connection, transaction

    vendor = connection.vendor
    statements = capture_claim_sql(owner, ttl, kinds, limit, takeover)
    if vendor == "postgresql":
        # The claim's EXECUTE, as the worker runs it: the statement is prepared in this session
        # (its generic plan, after the timed claims). Inside a transaction it is sent whole.
        executes = [s for s in statements if s[0].startswith("EXECUTE")]
        sql, params = (executes or [s for s in statements if "SKIP LOCKED" in s[0]])[0]
        prefixes = ["EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ", "EXPLAIN (ANALYZE, BUFFERS) "]
    elif vendor == "mysql":
        return _explain_mariadb(statements)
    else:
        sql, params = [s for s in statements if s[0].lstrip().startswith("UPDATE")][-1]
        prefixes = ["", "EXPLAIN QUERY PLAN "]
    outputs = []
    for prefix in prefixes:
        if not prefix:
            outputs.append(None)
            continue
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(prefix + sql, params)
            outputs.append(cursor.fetchall())
            transaction.set_rollback(True)
    result: dict[str, Any] = {
        "sql": sql,
        "plan": "\n".join(" ".join(map(str, r)) for r in outputs[1]),
    }
    if vendor == "postgresql":
        plan = outputs[0][0][0]
        plan = plan if isinstance(plan, list) else json.loads(plan)
        top = plan[0]["Plan"]
        result["buffers"] = _pg_buffers(top)
        for cte in ("expired", "due"):
            result[f"{cte}_buffers"] = _pg_buffers(_pg_node(top, f"CTE {cte}") or {})
        result["exec_ms"] = plan[0]["Execution Time"]
    return result


def _explain_mariadb(statements: list[tuple[str, Any]]) -> dict[str, Any]:
    """ANALYZE every SELECT of the job table the claim sent (expired leases, due jobs; for
    several kinds the candidate reads and the locks by id; the read-back), each rolled back:
    the rows they really read, summed, and the plan of the one that read the most."""
    import json

    from django.db import connection, transaction

    from django_leases.models import PaymentJob

    table = PaymentJob._meta.db_table
    selects = [
        (sql, params)
        for sql, params in statements
        if sql.lstrip("( ").startswith("SELECT") and f"FROM `{table}`" in sql
    ]
    most: dict[str, Any] = {}
    total = 0.0
    for sql, params in selects:
        outputs = []
        for prefix in ("ANALYZE FORMAT=JSON ", "ANALYZE "):
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(prefix + sql, params)
                outputs.append(cursor.fetchall())
                transaction.set_rollback(True)
        rows = _mariadb_rows(json.loads(outputs[0][0][0]))
        total += rows
        if not most or rows > most["rows"]:
            plan = "\n".join(" ".join(map(str, r)) for r in outputs[1])
            most = {"rows": rows, "sql": sql, "plan": plan}
    return {"sql": most["sql"], "plan": most["plan"], "rows_read": total}


def _pg_node(node: dict[str, Any], subplan: str) -> dict[str, Any] | None:
    """Return the plan node named `subplan` (e.g. "CTE due") below `node`."""
    if node.get("Subplan Name") == subplan:
        return node
    for child in node.get("Plans", []):
        found = _pg_node(child, subplan)
        if found:
            return found
    return None


def _pg_buffers(node: dict[str, Any]) -> int:
    return node.get("Shared Hit Blocks", 0) + node.get("Shared Read Blocks", 0)


def _mariadb_rows(node: Any) -> float:
    """Sum the rows MariaDB's ANALYZE says each table access really read (r_rows x r_loops)."""
    if isinstance(node, dict):
        own = node.get("r_rows", 0) * node.get("r_loops", 1) if "table_name" in node else 0
        return own + sum(_mariadb_rows(v) for v in node.values())
    if isinstance(node, list):
        return sum(_mariadb_rows(v) for v in node)
    return 0


def measure_sizes(
    sizes: list[int],
    pending: int,
    claims: int,
    warmup: int,
    ttl: float,
    churn: bool,
    index_cleanup: bool,
    waiting_behind: int = 0,
    other_kind: str = "",
    kinds: list[str] | None = None,
    vacuum: bool = False,
) -> list[dict[str, Any]]:
    """Grow the table through `sizes` finished jobs (or jobs waiting behind `waiting_behind`
    busy locks, or due jobs of another kind); at each size time `claims` claims of `kinds`."""
    from django.db import connection

    from django_leases.models import JobAttempt, PaymentJob

    common.migrate()
    if connection.vendor == "postgresql" and churn:
        common.execute(f"ALTER TABLE {common.JOB_TABLE} SET (autovacuum_enabled = false)")
    owner = common.owner_name("size")
    loaded, steps = 0, []
    if waiting_behind:
        hold_locks(waiting_behind)
    for size in sorted(sizes):
        # Drop the jobs of the previous step, so only the loaded finished rows remain.
        JobAttempt.objects.exclude(owner=LOADER).delete()
        PaymentJob.objects.exclude(lease_owner=LOADER).delete()
        common.note(f"  {connection.vendor}: loading {size - loaded} finished jobs ...")
        if waiting_behind:
            load_waiting(size - loaded, waiting_behind)
        elif other_kind:
            load_backlog(size - loaded, other_kind)
        else:
            load_finished(size - loaded, churn)
        loaded = size
        common.seed_pending(pending)
        settle(churn, index_cleanup, vacuum)
        # Once on the settled table, once after the timed claims left their dead versions.
        fresh = explain_claim(owner, ttl, kinds).get("buffers")
        common.claim_timings(warmup, limit=1, ttl=ttl, owner=owner, kinds=kinds)
        timed = common.claim_timings(claims, limit=1, ttl=ttl, owner=owner, kinds=kinds)
        explained = explain_claim(owner, ttl, kinds)
        steps.append({"size": size, **timed, **explained, "fresh_buffers": fresh})
    return steps


# ---- orchestration ---------------------------------------------------------------------------


def measure(
    args: argparse.Namespace, db: common.BenchDB, procs: common.Processes
) -> list[tuple[str, dict[str, Any]]]:
    """Run `measure_sizes` on `db`; return (vendor, step) pairs."""
    return common.measure_sizes_on(
        args,
        db,
        procs,
        "bench.table_size:measure_sizes",
        pending=args.claims + args.warmup + 10 + args.pending,
        claims=args.claims,
        warmup=args.warmup,
        ttl=args.ttl,
        churn=args.churn,
        index_cleanup=args.index_cleanup,
        waiting_behind=args.waiting_behind,
        other_kind=args.other_kind,
        kinds=args.kinds.split(",") if args.kinds else None,
        vacuum=args.vacuum,
    )


def run(args: argparse.Namespace, procs: common.Processes) -> None:
    rows_are = "finished rows"
    if args.waiting_behind:
        rows_are = f"waiting behind {args.waiting_behind} locks"
    if args.other_kind:
        rows_are = f"{args.other_kind} jobs of another kind"
    headers = ["database", rows_are, "p50 ms", "p95 ms", "p99 ms", "max ms", "empty"]
    headers += ["buffers 1st", "buffers", "expired CTE", "due CTE", "explain ms", "rows read"]
    headers += ["p50 vs smallest"]
    skipped: dict[str, str] = {}
    steps = common.each_database(args, "size", lambda db: measure(args, db, procs), skipped)
    empty: dict[str, float] = {}
    for vendor, step in steps:  # the smallest size of each database comes first
        empty.setdefault(vendor, statistics.median(step["ms"]))
    rows = [
        [
            vendor,
            f"{step['size']:,}",
            *common.latency_summary(step["ms"]),
            str(step["empty"]),
            str(step.get("fresh_buffers") or "-"),
            str(step.get("buffers", "-")),
            str(step.get("expired_buffers", "-")),
            str(step.get("due_buffers", "-")),
            f"{step['exec_ms']:.2f}" if "exec_ms" in step else "-",
            f"{step['rows_read']:.0f}" if "rows_read" in step else "-",
            f"{statistics.median(step['ms']) / empty[vendor]:.2f}x",
        ]
        for vendor, step in steps
    ]
    plans = dict(steps)  # the last, largest size of each database wins
    state = "churned, not vacuumed" if args.churn else "inserted completed, vacuumed or analyzed"
    state = "churned, then VACUUM" if args.churn and args.vacuum else state
    if args.waiting_behind:
        state = f"jobs waiting behind {args.waiting_behind} busy locks"
    if args.other_kind:
        state = f"{args.other_kind} jobs of kind backlog ahead of them; kinds={args.kinds}"
    state += ", INDEX_CLEANUP ON" if args.index_cleanup and not args.churn else ""
    common.print_table(
        f"claim(limit=1) against {rows_are} ({state}); {args.claims} timed claims per size",
        headers,
        rows,
    )
    common.print_skipped(skipped)
    print(
        "\nbuffers: shared buffers (hit + read) of the claiming UPDATE in EXPLAIN (ANALYZE, "
        "BUFFERS) on PostgreSQL after the timed claims, of which the CTEs looking for expired "
        "leases and due jobs read 'expired CTE' and 'due CTE'; 'buffers 1st': the same before "
        "any claim at that size; explain ms: its execution time.\nrows read: "
        "rows MariaDB's ANALYZE says the claim's SELECTs read, summed (the statement and plan "
        "printed below are those of the one that read the most)."
    )
    for vendor, step in plans.items():
        print(f"\n{vendor}: the claim statement at {step['size']:,} {rows_are}:")
        print(" ".join(step["sql"].split()))
        print(f"\n{vendor}: its plan:\n{step['plan']}")


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(__doc__)
    common.add_sizes_argument(parser)
    parser.add_argument(
        "--claims",
        type=common.positive_int,
        default=300,
        help="timed claims per size (default: %(default)r)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=20,
        help="untimed claims per size first (default: %(default)r)",
    )
    parser.add_argument(
        "--pending",
        type=int,
        default=1000,
        help="pending jobs left in the table beyond those claimed (default: %(default)r)",
    )
    parser.add_argument(
        "--churn",
        action="store_true",
        help="finish the loaded rows by UPDATEs and measure before any vacuum (see above)",
    )
    parser.add_argument(
        "--vacuum",
        action="store_true",
        help="with --churn: a plain VACUUM ANALYZE after loading, as autovacuum runs it "
        "(PostgreSQL)",
    )
    parser.add_argument(
        "--index-cleanup",
        action="store_true",
        help="VACUUM (INDEX_CLEANUP ON) instead of a plain VACUUM between sizes (PostgreSQL)",
    )
    parser.add_argument(
        "--other-kind",
        nargs="?",
        const="due",
        default="",
        choices=["due", "expired"],
        help="grow jobs of another kind ahead in claim order instead of finished jobs: due "
        "pending jobs (the default) or processing jobs with expired leases",
    )
    parser.add_argument(
        "--kinds",
        default="",
        help="comma-separated kinds each claim asks for (default: every kind; noop with "
        "--other-kind)",
    )
    parser.add_argument(
        "--waiting-behind",
        type=int,
        default=0,
        metavar="LOCKS",
        help="grow jobs waiting behind LOCKS busy locks instead of finished jobs (default: off)",
    )
    common.add_common_arguments(parser, databases="postgresql", timeout=1800)
    args = parser.parse_args(argv)
    if args.other_kind and not args.kinds:
        args.kinds = "noop"
    return common.run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
