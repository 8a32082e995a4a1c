"""The claim as a named prepared statement (PostgreSQL, `dialects.postgresql`): one
statement per read window, sent whole inside a transaction, prepared again when the session lost
it or the job table's columns changed, planned anew as it ages, left alone where sessions keep
losing it, its generic plan off other kinds' backlog, and the very claims of the statement sent
whole."""

import enum
import json
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, connections, transaction

from django_leases.dialects import dialect_of
from django_leases.dialects import postgresql_prepared as prepared_module
from django_leases.dialects import postgresql_prepared as prepared_sql
from django_leases.dialects.postgresql_prepared import PREPARED_PREFIX
from django_leases.models import JobAttempt, PaymentJob

from .test_claim_kinds import (
    SERVED,
    add_backlog,
    claim_order,
    claim_statements,
    enqueue_mix,
    lockable_while_held,
    rows_examined,
)
from .test_claim_paths import ORM, claim_outcome, generate, outcome_of


def literal_cursor() -> Any:
    """The cursor the prepared claim's EXECUTE runs on (`PostgreSQL.literal_cursor()`)."""
    conn = connections[connection.alias]
    return dialect_of(conn).literal_cursor(conn)


pytestmark = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="prepared claims are PostgreSQL's"
)


def prepared_claims() -> dict[str, tuple[str, int]]:
    """This connection's prepared claims: name -> (PREPARE text, executions)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT name, statement, generic_plans + custom_plans FROM pg_prepared_statements "
            "WHERE name LIKE %s",
            [PREPARED_PREFIX + "%"],
        )
        return {name: (text, runs) for name, text, runs in cursor.fetchall()}


@contextmanager
def statements_sent() -> Iterator[list[str]]:
    """Record the first word and name of every statement this connection sends."""
    sent: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        sent.append(" ".join(sql.split()[:2]))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        yield sent


def claim(limit: int) -> list[Any]:
    return PaymentJob.objects.claim("w", ttl=60, limit=limit, kinds=["capture"])


def enqueue(count: int) -> None:
    PaymentJob.objects.bulk_create(PaymentJob(kind="capture") for _ in range(count))


@pytest.mark.django_db(transaction=True)
def test_claim__is_one_prepared_statement_per_window_of_its_limit() -> None:
    enqueue(20)
    assert [len(claim(3)), len(claim(4))] == [3, 4]
    ((name, (text, runs)),) = prepared_claims().items()
    assert text.startswith(f"PREPARE {name} (") and "LIMIT 4" in text and "%(" not in text
    assert runs == 2
    jobs = claim(5)
    assert len(jobs) == 5
    assert {(job.attempts, job.lease_owner) for job in jobs} == {(1, "w")}
    # Each job's first token, as stored (the database clock in microseconds, at least 1).
    stored = dict(
        PaymentJob.objects.filter(pk__in=[j.pk for j in jobs]).values_list("pk", "lease_token")
    )
    assert {job.pk: job.lease_token for job in jobs} == stored and min(stored.values()) >= 1
    statements = prepared_claims()
    assert len(statements) == 2
    assert any("LIMIT 8" in text for text, _ in statements.values())
    assert JobAttempt.objects.count() == 12


@pytest.mark.django_db(transaction=True)
def test_claim__of_kinds_given_as_str_subclasses_is_prepared_too() -> None:
    class Kind(enum.StrEnum):
        CAPTURE = "capture"

    enqueue(2)
    jobs = PaymentJob.objects.claim("w", ttl=60, limit=1, kinds=[Kind.CAPTURE])
    assert [job.kind for job in jobs] == ["capture"]
    assert [runs for _, runs in prepared_claims().values()] == [1]


@pytest.mark.django_db(transaction=True)
def test_claim__inside_a_transaction_is_sent_whole() -> None:
    enqueue(3)
    with transaction.atomic(), statements_sent() as sent:
        assert len(claim(2)) == 2
    assert prepared_claims() == {}
    assert [word for word in sent if word.startswith(("PREPARE", "EXECUTE"))] == []


@pytest.mark.django_db(transaction=True)
def test_claim__prepares_again_a_statement_the_session_lost() -> None:
    enqueue(4)
    assert len(claim(1)) == 1
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")  # what a pooler's reset or a new server session does
    with statements_sent() as sent:
        assert len(claim(1)) == 1
    assert [word.split()[0] for word in sent] == ["EXECUTE", "PREPARE", "EXECUTE"]
    assert [runs for _, runs in prepared_claims().values()] == [1]


@pytest.mark.django_db(transaction=True)
def test_claim__uses_the_same_statement_another_client_prepared_in_the_session() -> None:
    enqueue(4)
    assert len(claim(1)) == 1
    prepared_module.SESSIONS.clear()  # as if another client of a pooler had prepared it
    with statements_sent() as sent:
        assert len(claim(1)) == 1
    assert [word.split()[0] for word in sent] == ["PREPARE", "EXECUTE"]
    assert [runs for _, runs in prepared_claims().values()] == [2]


@pytest.mark.django_db(transaction=True)
def test_claim__stops_preparing_where_the_sessions_keep_losing_statements(
    caplog: pytest.LogCaptureFixture,
) -> None:
    enqueue(10)

    def lose_them(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        if sql.startswith(f"EXECUTE {PREPARED_PREFIX}"):
            # A transaction pooler that ran the PREPARE on another server session.
            context["connection"].connection.execute("DEALLOCATE ALL")
        return execute(sql, params, many, context)

    claimed = []
    with caplog.at_level(logging.INFO, "django_leases.worker"):
        with connection.execute_wrapper(lose_them):
            for _ in range(2):
                claimed += claim(2)
        with statements_sent() as sent:
            claimed += claim(2)
    assert len(claimed) == len({job.pk for job in claimed}) == 6
    assert JobAttempt.objects.count() == 6
    assert [word for word in sent if word.startswith(("PREPARE", "EXECUTE"))] == []
    assert [r.message for r in caplog.records if "losing prepared" in r.message] == [
        "database 'default' keeps losing prepared statements (a transaction pooler?): this "
        "connection's claims are planned at every statement"
    ]


@pytest.mark.django_db(transaction=True)
def test_claim__prepares_again_after_the_job_tables_columns_changed() -> None:
    enqueue(6)
    table = connection.ops.quote_name(PaymentJob._meta.db_table)
    assert len(claim(1)) == 1
    try:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} ADD COLUMN probe integer")
        # "cached plan must not change result type": deallocated, prepared again, run.
        with statements_sent() as sent:
            assert len(claim(1)) == 1
        assert [word.split()[0] for word in sent] == ["EXECUTE", "DEALLOCATE", "PREPARE", "EXECUTE"]
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {table} DROP COLUMN probe")
    assert len(claim(1)) == 1
    assert PaymentJob.objects.filter(attempts=1).count() == JobAttempt.objects.count() == 3


@pytest.mark.django_db(transaction=True)
def test_claim__is_prepared_anew_after_twice_as_many_runs_each_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prepared_module, "FIRST_REPLAN", 2)
    monkeypatch.setattr(prepared_module, "REPLAN_EVERY", 4)
    enqueue(12)
    prepares = []
    for n in range(1, 13):
        with statements_sent() as sent:
            assert len(claim(1)) == 1
        if any(word.startswith("PREPARE") for word in sent):
            prepares.append(n)
            assert [word.split()[0] for word in sent] == (
                ["PREPARE", "EXECUTE"] if n == 1 else ["DEALLOCATE", "PREPARE", "EXECUTE"]
            )
    assert prepares == [1, 3, 7, 11]  # after 2 runs, then 4, then 4 (at most REPLAN_EVERY)


@pytest.mark.django_db(transaction=True)
def test_claim__is_prepared_anew_once_older_than_replan_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prepared_module, "REPLAN_AFTER", 0.0)
    enqueue(3)
    for _ in range(3):
        with statements_sent() as sent:
            assert len(claim(1)) == 1
        assert any(word.startswith("PREPARE") for word in sent)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("seed", range(4))
def test_prepared_claims__claim_what_the_orm_path_claims(seed: int) -> None:
    generate(seed)
    rng = random.Random(seed)
    for limit, kinds in [(1, None), (3, None), (3, None), (4, ["capture", "webhook"]), (50, None)]:
        expected = outcome_of(ORM, "w", limit, kinds)
        before = prepared_claims()
        tokens = dict(PaymentJob.objects.values_list("pk", "lease_token"))
        jobs = PaymentJob.objects.claim("w", ttl=60, limit=limit, kinds=kinds)
        assert sum(runs for _, runs in prepared_claims().values()) == 1 + sum(
            runs for _, runs in before.values()
        ), "the claim ran as a prepared statement"
        assert claim_outcome(jobs, tokens) == expected, (limit, kinds)
        for job in jobs:  # finish some, so that the next claim meets other rows
            if rng.random() < 0.5:
                PaymentJob.objects.complete(job.pk, "w", job.lease_token)


@pytest.mark.django_db
@pytest.mark.parametrize("kinds", [SERVED, SERVED[:1]])
@pytest.mark.parametrize("backlog", ["due", "expired"])
def test_prepared_claim__its_generic_plan_reads_none_of_another_kinds_backlog(
    kinds: list[str], backlog: str
) -> None:
    add_backlog(backlog, 20_000)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {PaymentJob._meta.db_table}")
    statement, *_ = claim_statements(kinds, limit=2)
    prepared, params = prepared_sql.prepared_claim(statement)
    with (
        transaction.atomic(),
        dialect_of(connections[connection.alias]).literal_cursor(
            connections[connection.alias]
        ) as cursor,
    ):
        cursor.execute(prepared.prepare)
        # The plan a kept prepared statement runs, made without the parameters' values.
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + prepared.execute, params)
        plan = cursor.fetchone()[0]
        transaction.set_rollback(True)
    with connection.cursor() as cursor:
        cursor.execute(prepared.deallocate)
    plan = plan if isinstance(plan, list) else json.loads(plan)
    cte = f"CTE {backlog}"
    (walk,) = (node for node in plan[0]["Plan"]["Plans"] if node.get("Subplan Name") == cte)
    examined = rows_examined(walk)
    # As with the statement sent whole (test_claim_kinds): a row or two past what each kind's
    # range hands on, whatever the backlog; the read window of limit 2 is 2.
    assert 0 < examined <= len(kinds) * (2 + 2) + 2, examined


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("kinds", [SERVED, SERVED[:1]])
def test_prepared_claim__locks_no_more_than_limit_rows_with_a_wider_window(
    kinds: list[str],
) -> None:
    enqueue_mix(seed=7, per_kind=10)
    due = len(claim_order(kinds))
    statement, *_ = claim_statements(kinds, limit=3)
    prepared, params = prepared_sql.prepared_claim(statement)
    assert "LIMIT 4" in prepared.prepare  # the window is wider than the limit

    def claim() -> int:
        with dialect_of(connections[connection.alias]).literal_cursor(
            connections[connection.alias]
        ) as cursor:
            cursor.execute(prepared.prepare)
            cursor.execute(prepared.execute, params)
            return len(cursor.fetchall())

    assert lockable_while_held(claim, kinds) == (3, due - 3)
