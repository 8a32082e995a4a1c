"""A claim of given kinds: claim order across the kinds, other kinds' backlog left alone and not
walked, no row locked that it does not claim, not short while others hold rows, exactly once
under a race."""

import json
import random
import threading
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.db.models import QuerySet
from django.db.models.functions import Now

from django_leases.dialects import Dialect
from django_leases.dialects.merge import CANDIDATE_SLACK
from django_leases.models import PaymentJob
from django_leases.querysets.claims import claim_by_dialect

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


PATHS = ["dialect"] if connection.vendor == "mysql" else ["dialect", "orm"]
"""The claim's path on this database, and the ORM path (MariaDB's own) beside it."""

Claim = Callable[[str, int, list[str]], list[PaymentJob]]


@pytest.fixture(params=PATHS)
def claim_by(request: pytest.FixtureRequest) -> Claim:
    """`claim(owner, limit, kinds)` by this database's path, or by the ORM path."""

    def claim(owner: str, limit: int, kinds: list[str]) -> list[PaymentJob]:
        if request.param == "orm":
            return claim_by_dialect(
                PaymentJob.objects.all(), owner, 60.0, limit, kinds, dialect=Dialect()
            )
        return PaymentJob.objects.claim(owner, ttl=60, limit=limit, kinds=kinds)

    return claim


def row_locks(test: Callable[..., None]) -> Callable[..., None]:
    """Mark a test of the row locks a claim holds, seen from a second connection."""
    no_locks = pytest.mark.skipif(
        ON_SQLITE, reason="SQLite has no row locks: a claim holds the write lock"
    )
    marks = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True), no_locks]
    for mark in marks:
        test = mark(test)
    return test


def claim_order(kinds: list[str]) -> list[int]:
    """The due jobs of `kinds` in the order the specification gives: priority, run_at, id."""
    due = PaymentJob.objects.due().filter(kind__in=kinds)
    return list(due.order_by("-priority", "run_at", "pk").values_list("pk", flat=True))


@pytest.mark.django_db
@pytest.mark.parametrize(("kinds", "limit"), [(SERVED, 3), (SERVED[:1], 2), (SERVED, 1)])
def test_claim__keeps_claim_order_across_kinds_behind_a_backlog(
    kinds: list[str], limit: int, claim_by: Claim
) -> None:
    # More due jobs of each kind than one claim of several kinds reads per kind.
    enqueue_mix(seed=limit, per_kind=2 * CANDIDATE_SLACK)
    expected = claim_order(kinds)
    assert all(len(claim_order([kind])) > limit + CANDIDATE_SLACK for kind in kinds)
    claimed: list[int] = []
    while batch := claim_by("w", limit, kinds):
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


@row_locks
def test_claim__several_kinds_lock_no_more_than_limit_rows(claim_by: Claim) -> None:
    enqueue_mix(seed=7, per_kind=10)
    due = len(claim_order(SERVED))

    def claim() -> int:
        return len(claim_by("holder", 2, SERVED))

    assert lockable_while_held(claim, SERVED) == (2, due - 2)


@row_locks
def test_claim__several_kinds_lock_no_more_expired_leases_than_they_take_over(
    claim_by: Claim,
) -> None:
    expire_mix(per_kind=10)
    expired = PaymentJob.objects.expired()
    counts = {kind: expired.filter(kind=kind).count() for kind in [*SERVED, BACKLOG]}

    def claim() -> int:
        return len(claim_by("holder", 2, SERVED))

    def lockable_kinds() -> Counter[str]:
        kind_of = dict(expired.values_list("pk", "kind"))
        return Counter(kind_of[pk] for pk in lockable(expired))

    held, free = while_held(claim, lockable_kinds)
    assert held == 2
    assert free[SERVED[0]] + free[SERVED[1]] == counts[SERVED[0]] + counts[SERVED[1]] - 2
    assert free[BACKLOG] == counts[BACKLOG]


def lockable(jobs: QuerySet[PaymentJob]) -> list[int]:
    """Return the ids of `jobs` this connection can lock now, each tried on its own by primary
    key: a locking read of many rows may take a plan (MariaDB's) that skips, or locks, others."""
    pks = list(jobs.values_list("pk", flat=True))
    with transaction.atomic():
        rows = PaymentJob.objects.select_for_update(skip_locked=True)
        return [pk for pk in pks if rows.filter(pk=pk).exists()]


def lockable_while_held(claim: Callable[[], int], kinds: list[str]) -> tuple[int, int]:
    """Run `claim` (returning how many jobs it claimed) in a transaction on another thread and
    count, while that transaction holds its locks, the due jobs of `kinds` still lockable here;
    return both counts."""
    due = PaymentJob.objects.filter(kind__in=kinds, status="pending").due()
    return while_held(claim, lambda: len(lockable(due)))


def while_held(claim: Callable[[], Any], probe: Callable[[], Any]) -> tuple[Any, Any]:
    """Run `claim` in a transaction on another thread and `probe` here while that transaction
    is still open (holding its locks); return what each returned."""
    claimed, release = threading.Event(), threading.Event()
    results: list[Any] = []

    def holder() -> None:
        try:
            with transaction.atomic():
                results.append(claim())
                claimed.set()
                release.wait(30)
        finally:
            connection.close()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert claimed.wait(30)
        probed = probe()
    finally:
        release.set()
        thread.join(30)
    return results[0], probed


@row_locks
def test_claim__several_kinds_leave_every_other_job_to_a_concurrent_claim(
    claim_by: Claim,
) -> None:
    # More due jobs of each kind than the claim reads as candidates: it locks what it claims.
    enqueue_mix(seed=11, per_kind=CANDIDATE_SLACK + 8)
    order, backlog_order = claim_order(SERVED), claim_order([BACKLOG])

    def claim(kinds: list[str], limit: int) -> list[int]:
        return [job.pk for job in claim_by("w", limit, kinds)]

    def others() -> tuple[list[int], list[int]]:
        return claim([BACKLOG], 500), claim(SERVED, 500)

    held, (backlog, served) = while_held(lambda: claim(SERVED, 2), others)
    assert held == order[:2]
    assert backlog == backlog_order
    assert served == order[2:]


@row_locks
def test_claim__several_kinds_are_not_short_while_their_first_jobs_are_held(
    claim_by: Claim,
) -> None:
    enqueue_mix(seed=13, per_kind=2 * CANDIDATE_SLACK)
    order = claim_order(SERVED)
    # More of the first jobs held than one read of candidates holds, in another transaction.
    first = order[: CANDIDATE_SLACK + 8]

    def hold() -> int:
        # One row at a time: a locking read of many ids may scan (and lock) the whole table.
        rows = PaymentJob.objects.select_for_update()
        return sum(len(rows.filter(pk=pk).values_list("pk", flat=True)) for pk in first)

    def claim() -> list[int]:
        return [job.pk for job in claim_by("w", 3, SERVED)]

    held, claimed = while_held(hold, claim)
    assert held == len(first)
    assert claimed == order[len(first) : len(first) + 3]


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
def test_claim__takes_over_its_kinds_expired_leases_oldest_first(
    kinds: list[str], claim_by: Claim
) -> None:
    expire_mix(per_kind=CANDIDATE_SLACK + 4)
    expected = list(
        PaymentJob.objects.expired()
        .filter(kind__in=kinds)
        .order_by("lease_until")
        .values_list("pk", flat=True)
    )
    claimed: list[int] = []
    while batch := claim_by("w", 1, kinds):
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


def mariadb_rows_read(node: Any) -> float:
    """Rows MariaDB's ANALYZE FORMAT=JSON says each access of the job table really read."""
    if isinstance(node, list):
        return sum(mariadb_rows_read(child) for child in node)
    if not isinstance(node, dict):
        return 0
    own = 0.0
    if node.get("table_name") == PaymentJob._meta.db_table:
        own = node.get("r_rows", 0) * node.get("r_loops", 1)
    return own + sum(mariadb_rows_read(child) for child in node.values())


BACKLOG_ROWS = 20_000
SERVED_ROWS = 300


# transaction=True: ANALYZE TABLE commits the test's rows (an implicit commit on MariaDB).
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(connection.vendor != "mysql", reason="ANALYZE FORMAT=JSON is MariaDB's")
@pytest.mark.parametrize("kinds", [SERVED, SERVED[:1]])
@pytest.mark.parametrize("backlog", ["due", "expired"])
def test_claim__reads_none_of_another_kinds_backlog_on_mariadb(
    kinds: list[str], backlog: str
) -> None:
    add_backlog(backlog, BACKLOG_ROWS)
    # Enough jobs of each served kind that the optimizer expects to find LIMIT rows soon when
    # it walks the index led by `status` in claim order (as a worker's queue would have).
    for kind in kinds:
        ready = PaymentJob.objects.due() if backlog == "due" else PaymentJob.objects.expired()
        job = ready.filter(kind=kind).first()
        assert job is not None
        copy_row(PaymentJob, job.pk, SERVED_ROWS)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE TABLE {PaymentJob._meta.db_table}")
        cursor.fetchall()
    job_table = f"FROM {connection.ops.quote_name(PaymentJob._meta.db_table)}"
    selects: list[tuple[str, Any]] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.lstrip("( ").startswith("SELECT") and job_table in sql:
            selects.append((sql, params))
        return execute(sql, params, many, context)

    limit = 2
    with transaction.atomic(), connection.execute_wrapper(record):
        assert len(PaymentJob.objects.claim("w", ttl=60, limit=limit, kinds=kinds)) == limit
        transaction.set_rollback(True)
    examined = 0.0
    for sql, params in selects:  # every read of the job table: candidates, locks, read-back
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("ANALYZE FORMAT=JSON " + sql, params)
            examined += mariadb_rows_read(json.loads(cursor.fetchone()[0]))
            transaction.set_rollback(True)
    # Each kind's range is read up to `limit + CANDIDATE_SLACK` rows (and past the few of its
    # own not due yet: at most 5), the rows chosen are locked and read back by primary key;
    # none of the backlog's.
    assert 0 < examined <= len(kinds) * (limit + CANDIDATE_SLACK + 5) + 4 * limit, examined
