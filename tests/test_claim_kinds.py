"""A claim of given kinds: claim order across the kinds, other kinds' backlog left alone and not
walked, at most `limit` rows locked, exactly once under a race."""

import json
import random
import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models.functions import Now

from django_leases.models import PaymentJob
from django_leases.sql.postgresql import CANDIDATE_SLACK

from .conftest import ON_SQLITE, Processes
from .rows import copy_row
from .test_concurrency import run_claimers

SERVED = ["capture", "refund"]
BACKLOG = "webhook"


def enqueue_mix(seed: int, per_kind: int) -> None:
    """Enqueue `per_kind` jobs of each served kind and of the backlog kind, with mixed priorities
    and run_at (some in the future), the backlog's ahead of the others in claim order."""
    rng = random.Random(seed)
    for _ in range(per_kind):
        for kind in [*SERVED, BACKLOG]:
            ahead = kind == BACKLOG
            job = PaymentJob.objects.enqueue(kind, priority=9 if ahead else rng.choice([0, 1, 5]))
            minutes = -600 if ahead else rng.choice([-30, -20, -20, -10, 60])
            PaymentJob.objects.filter(pk=job.pk).update(run_at=Now() + timedelta(minutes=minutes))


def claim_order(kinds: list[str]) -> list[int]:
    """The due jobs of `kinds` in the order the specification gives: priority, run_at, id."""
    due = PaymentJob.objects.due().filter(kind__in=kinds)
    return list(due.order_by("-priority", "run_at", "pk").values_list("pk", flat=True))


@pytest.mark.django_db
@pytest.mark.parametrize(("kinds", "limit"), [(SERVED, 3), (SERVED[:1], 2), (SERVED, 1)])
def test_claim__keeps_claim_order_across_kinds_behind_a_backlog(
    kinds: list[str], limit: int
) -> None:
    # More due jobs of each kind than one claim of several kinds reads per kind.
    enqueue_mix(seed=limit, per_kind=2 * CANDIDATE_SLACK)
    expected = claim_order(kinds)
    assert all(len(claim_order([kind])) > limit + CANDIDATE_SLACK for kind in kinds)
    claimed: list[int] = []
    while batch := PaymentJob.objects.claim("w", ttl=60, limit=limit, kinds=kinds):
        assert len(batch) <= limit
        claimed.extend(job.pk for job in batch)
    assert claimed == expected
    assert not PaymentJob.objects.exclude(kind__in=kinds).filter(status="processing").exists()
    assert PaymentJob.objects.filter(kind=BACKLOG, status="pending").count() == 2 * CANDIDATE_SLACK


@pytest.mark.django_db
def test_claim__several_kinds_skip_a_kind_with_nothing_due() -> None:
    PaymentJob.objects.enqueue(BACKLOG)
    later = PaymentJob.objects.enqueue("refund")
    PaymentJob.objects.filter(pk=later.pk).update(run_at=Now() + timedelta(hours=1))
    due = PaymentJob.objects.enqueue("capture")
    claimed = PaymentJob.objects.claim("w", ttl=60, limit=5, kinds=SERVED)
    assert [job.pk for job in claimed] == [due.pk]


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(ON_SQLITE, reason="SQLite has no row locks: a claim holds the write lock")
def test_claim__several_kinds_lock_no_more_than_limit_rows() -> None:
    enqueue_mix(seed=7, per_kind=10)
    due = len(claim_order(SERVED))

    def claim() -> int:
        return len(PaymentJob.objects.claim("holder", ttl=60, limit=2, kinds=SERVED))

    assert lockable_while_held(claim, SERVED) == (2, due - 2)


def lockable_while_held(claim: Callable[[], int], kinds: list[str]) -> tuple[int, int]:
    """Run `claim` (returning how many jobs it claimed) in a transaction on another thread and
    count, while that transaction holds its locks, the due jobs of `kinds` still lockable here;
    return both counts."""
    claimed, release = threading.Event(), threading.Event()
    counts: list[int] = []

    def holder() -> None:
        try:
            with transaction.atomic():
                counts.append(claim())
                claimed.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert claimed.wait(30)
        with transaction.atomic():
            free = PaymentJob.objects.filter(kind__in=kinds, status="pending").due()
            lockable = list(free.select_for_update(skip_locked=True).values_list("pk", flat=True))
    finally:
        release.set()
        thread.join(30)
    return counts[0], len(lockable)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_claim__four_processes_of_several_kinds_claim_each_job_once(processes: Processes) -> None:
    jobs = [PaymentJob(kind=kind) for kind in [*SERVED, BACKLOG] for _ in range(300)]
    PaymentJob.objects.bulk_create(jobs)
    results = run_claimers(processes, 4, "--limit", "3", "--kinds", ",".join(SERVED))

    won = Counter(pk for result in results for pk in result["won"])
    assert set(won.values()) == {1}
    assert len(won) == 600
    assert max(result["largest_batch"] for result in results) <= 3
    assert set(PaymentJob.objects.filter(pk__in=won).values_list("kind", flat=True)) == set(SERVED)
    assert PaymentJob.objects.filter(kind=BACKLOG, status="pending", attempts=0).count() == 300


def rows_examined(plan: dict[str, Any]) -> int:
    """Rows the plan's scans of the job table read, returned or filtered out."""
    own = 0
    if plan.get("Relation Name") == PaymentJob._meta.db_table and "Scan" in plan["Node Type"]:
        own = (plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)) * plan["Actual Loops"]
    return own + sum(rows_examined(child) for child in plan.get("Plans", []))


def expire_mix(per_kind: int) -> None:
    """Make `per_kind` jobs of each served kind and of the backlog kind hold leases that expired
    at distinct times, the backlog's longest ago."""
    order = [kind for _ in range(per_kind) for kind in [*SERVED, BACKLOG]]
    random.Random(5).shuffle(order)
    for n, kind in enumerate(order):
        job = PaymentJob.objects.enqueue(kind)
        assert PaymentJob.objects.claim_job(job.pk, "gone", ttl=60) is not None
        seconds = 10 * len(order) + n if kind == BACKLOG else 10 + n
        PaymentJob.objects.filter(pk=job.pk).update(lease_until=Now() - timedelta(seconds=seconds))


@pytest.mark.django_db
@pytest.mark.parametrize("kinds", [SERVED, SERVED[:1]])
def test_claim__takes_over_its_kinds_expired_leases_oldest_first(kinds: list[str]) -> None:
    expire_mix(per_kind=CANDIDATE_SLACK + 4)
    expected = list(
        PaymentJob.objects.expired()
        .filter(kind__in=kinds)
        .order_by("lease_until")
        .values_list("pk", flat=True)
    )
    claimed: list[int] = []
    while batch := PaymentJob.objects.claim("w", ttl=60, kinds=kinds):
        assert batch[0].taken_over  # type: ignore[attr-defined]
        claimed.append(batch[0].pk)
    assert claimed == expected
    assert PaymentJob.objects.expired().filter(kind=BACKLOG).count() == CANDIDATE_SLACK + 4


def add_backlog(backlog: str, count: int) -> None:
    """Add `count` due jobs (`backlog` "due") or expired leases ("expired") of the backlog kind,
    ahead of a few of the served kinds' in claim order."""
    if backlog == "due":
        enqueue_mix(seed=3, per_kind=5)
    else:  # expired leases are taken before due jobs are read
        expire_mix(per_kind=3)
    long_ago = datetime(2000, 1, 1, tzinfo=UTC)
    status = "pending" if backlog == "due" else "processing"
    (first,) = PaymentJob.objects.bulk_create(
        [
            PaymentJob(
                kind=BACKLOG, priority=9, status=status, lease_owner="gone", lease_until=long_ago
            )
        ]
    )
    copy_row(PaymentJob, first.pk, count - 1)


def claim_statements(kinds: list[str], limit: int) -> list[tuple[str, Any]]:
    """The claiming statements (SQL and parameters) of one claim of `kinds`, rolled back."""
    statements: list[tuple[str, Any]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if "SKIP LOCKED" in sql or sql.lstrip().startswith("UPDATE") and "RETURNING" in sql:
            statements.append((sql, params))
        return execute(sql, params, many, context)

    with transaction.atomic(), connection.execute_wrapper(record):
        PaymentJob.objects.claim("w", ttl=60, limit=limit, kinds=kinds)
        transaction.set_rollback(True)
    return statements


@pytest.mark.django_db
@pytest.mark.skipif(connection.vendor != "sqlite", reason="EXPLAIN QUERY PLAN is SQLite's")
@pytest.mark.parametrize("kinds", [SERVED, SERVED[:1]])
@pytest.mark.parametrize("backlog", ["due", "expired"])
def test_claim__searches_only_its_kinds_on_sqlite(kinds: list[str], backlog: str) -> None:
    add_backlog(backlog, 100)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    # More than there are expired leases of its kinds: both passes run.
    statements = claim_statements(kinds, limit=50)
    assert len(statements) == 2, statements  # expired leases, then due jobs
    for sql, params in statements:
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
            plan = [row[-1] for row in cursor.fetchall()]
        table = PaymentJob._meta.db_table
        # Every read of the job table but the UPDATE's primary-key lookup: no SCAN of it.
        reads = [line for line in plan if line.startswith((f"SCAN {table}", f"SEARCH {table}"))]
        reads = [line for line in reads if "PRIMARY KEY" not in line]
        assert reads, plan
        assert all("_kind_" in line and "(kind=? AND status=?" in line for line in reads), plan


@pytest.mark.django_db
@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="EXPLAIN ANALYZE's JSON plan is PostgreSQL's"
)
@pytest.mark.parametrize("kinds", [SERVED, SERVED[:1]])
@pytest.mark.parametrize("backlog", ["due", "expired"])
def test_claim__reads_none_of_another_kinds_backlog(kinds: list[str], backlog: str) -> None:
    add_backlog(backlog, 20_000)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {PaymentJob._meta.db_table}")
    (sql, params), *_ = claim_statements(kinds, limit=2)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        plan = cursor.fetchone()[0]
        transaction.set_rollback(True)
    plan = plan if isinstance(plan, list) else json.loads(plan)
    # The CTE that walks past the backlog; the UPDATE's and the ledger's are primary-key probes.
    cte = f"CTE {backlog}"
    (walk,) = (node for node in plan[0]["Plan"]["Plans"] if node.get("Subplan Name") == cte)
    examined = rows_examined(walk)
    # limit = 2: each kind's range is read a row or two past what the merge hands on, and the
    # rows it hands on are probed by primary key; nothing else, however long the ranges.
    assert 0 < examined <= len(kinds) * (2 + 2) + 2, examined
