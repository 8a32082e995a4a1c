"""`enqueue()` and `enqueue_many()`, awaitable too (querysets/enqueue.py, inserts.py,
payments.py): checked arguments, idempotency, own columns, the statements they send."""

import json
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from asgiref.sync import async_to_sync
from django.db import connection, transaction
from django.db.models.functions import Now
from django.db.models.signals import post_init
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_leases.exceptions import (
    IdempotencyKeyReused,
    InvalidArgument,
    InvalidPayload,
    PayloadTooLarge,
)
from django_leases.models import PaymentJob
from tests.testapp.models import BareJob, PayoutJob

from .conftest import Processes

pytestmark = pytest.mark.django_db

Status = PaymentJob.Status


def test_enqueue__creates_pending_job_due_now() -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1250}, payment_id="pay_1")
    job.refresh_from_db()
    assert (job.status, job.kind, job.payload, job.payment_id) == (
        Status.PENDING,
        "capture",
        {"amount": 1250},
        "pay_1",
    )
    assert job.attempts == 0 and job.max_attempts == 5 and job.lease_token == 0
    assert PaymentJob.objects.due().filter(pk=job.pk).exists()


def test_enqueue__same_idempotency_key_returns_first_job() -> None:
    first = PaymentJob.objects.enqueue("capture", {"n": 1}, idempotency_key="cap-1", priority=3)
    second = PaymentJob.objects.enqueue("capture", {"n": 1}, idempotency_key="cap-1")
    assert second.pk == first.pk
    assert (second.payload, second.priority) == ({"n": 1}, 3)
    assert PaymentJob.objects.count() == 1


def awaited(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run `coroutine` as async code would, on this thread's connection."""

    async def run() -> Any:
        return await coroutine

    return async_to_sync(run)()


# The same JSON value as the payload {"n": 1, "items": [1.5, true, null]}, spelled otherwise.
SAME_PAYLOAD = {"items": (1.5, True, None), "n": 1}
OTHER_PAYLOADS = [
    {"n": 2, "items": [1.5, True, None]},
    {"n": 1, "items": [1.5, 1, None]},  # equal in Python (True == 1), not in JSON
    {"n": 1, "items": [1.5, True]},
    {"n": 1},
    [1],
    None,  # {}
]


@pytest.mark.parametrize("lock", ["", "payment:1"])
@pytest.mark.parametrize(
    ("kind", "payload"),
    [("refund", SAME_PAYLOAD), *(("capture", payload) for payload in OTHER_PAYLOADS)],
)
def test_enqueue__a_key_reused_with_another_kind_or_payload_raises_and_changes_nothing(
    kind: str, payload: Any, lock: str
) -> None:
    first = PaymentJob.objects.enqueue(
        "capture", {"n": 1, "items": [1.5, True, None]}, idempotency_key="cap-1", lock=lock
    )
    before = list(PaymentJob.objects.values())
    differs = "kind" if kind != "capture" else "payload"
    message = f"idempotency_key 'cap-1' already names job {first.pk} .* another {differs}"
    with pytest.raises(IdempotencyKeyReused, match=message):
        PaymentJob.objects.enqueue(kind, payload, idempotency_key="cap-1", lock=lock)
    with pytest.raises(IdempotencyKeyReused, match=message):
        awaited(PaymentJob.objects.aenqueue(kind, payload, idempotency_key="cap-1"))
    assert list(PaymentJob.objects.values()) == before
    again = PaymentJob.objects.enqueue("capture", SAME_PAYLOAD, idempotency_key="cap-1", lock=lock)
    assert again.pk == first.pk and list(PaymentJob.objects.values()) == before


@pytest.mark.parametrize("lock", ["", "payment:1"])
def test_enqueue_many__a_key_reused_with_another_payload_rejects_the_whole_batch(
    lock: str,
) -> None:
    first = PaymentJob.objects.enqueue("capture", {"n": 0}, idempotency_key="k0", lock=lock)
    before = list(PaymentJob.objects.values())
    batches = [
        ([{"n": 1}, {"n": 9}], ["k1", "k0"], "payloads\\[1\\]: idempotency_key 'k0'"),
        # A key repeated in the batch with another payload than its first.
        ([{"n": 1}, {"n": 2}, {"n": 3}], ["k1", None, "k1"], "payloads\\[2\\]: .*'k1'"),
    ]
    for payloads, keys, message in batches:
        with pytest.raises(IdempotencyKeyReused, match=message):
            PaymentJob.objects.enqueue_many("capture", payloads, idempotency_keys=keys, lock=lock)
        with pytest.raises(IdempotencyKeyReused, match=message):
            awaited(
                PaymentJob.objects.aenqueue_many(
                    "capture", payloads, idempotency_keys=keys, lock=lock
                )
            )
        assert list(PaymentJob.objects.values()) == before
    jobs = PaymentJob.objects.enqueue_many(
        "capture", [{"n": 1}, {"n": 0}, {"n": 1}], idempotency_keys=["k1", "k0", "k1"], lock=lock
    )
    assert jobs[1].pk == first.pk and jobs[0].pk == jobs[2].pk
    assert PaymentJob.objects.count() == 2


def test_enqueue__a_payload_over_max_payload_bytes_raises_naming_both_and_writes_nothing() -> None:
    big = {"blob": "x" * 1024 * 1024}  # 1 MiB of text: over the default MAX_PAYLOAD_BYTES
    size = len(json.dumps(big))
    message = f"payload is {size} bytes as JSON, more than MAX_PAYLOAD_BYTES \\({1024 * 1024}\\)"
    with pytest.raises(PayloadTooLarge, match=message):
        PaymentJob.objects.enqueue("capture", big)
    with pytest.raises(PayloadTooLarge, match=message):
        awaited(PaymentJob.objects.aenqueue("capture", big, idempotency_key="k"))
    with pytest.raises(PayloadTooLarge, match=f"^payloads\\[1\\]: {message}"):
        PaymentJob.objects.enqueue_many("capture", [{}, big])
    with pytest.raises(PayloadTooLarge, match=f"^payloads\\[1\\]: {message}"):
        awaited(PaymentJob.objects.aenqueue_many("capture", [{}, big], lock="L"))
    assert issubclass(PayloadTooLarge, ValueError) and PaymentJob.objects.count() == 0
    with override_settings(DJANGO_LEASES={"MAX_PAYLOAD_BYTES": 10}):
        PaymentJob.objects.enqueue("capture", {"n": 1})  # 8 bytes
        with pytest.raises(PayloadTooLarge, match="payload is 11 bytes .*\\(10\\)"):
            PaymentJob.objects.enqueue("capture", {"n": 1000})
    assert PaymentJob.objects.count() == 1


def test_complete__a_result_over_max_payload_bytes_raises_and_changes_nothing() -> None:
    job = PaymentJob.objects.enqueue("capture")
    claimed = PaymentJob.objects.claim_job(job.pk, "w", ttl=60)
    assert claimed is not None
    with override_settings(DJANGO_LEASES={"MAX_PAYLOAD_BYTES": 10}):
        with pytest.raises(PayloadTooLarge, match="result is 11 bytes"):
            PaymentJob.objects.complete(job.pk, "w", claimed.lease_token, result={"n": 1000})
    job.refresh_from_db()
    assert (job.status, job.result) == ("processing", None)


def test_enqueue__a_key_reused_sends_no_more_statements_than_before() -> None:
    """The comparison is made in Python on the row the INSERT's conflict path reads anyway."""
    PaymentJob.objects.enqueue("capture", {"n": 1}, idempotency_key="k-1")
    same = sent(lambda: PaymentJob.objects.enqueue("capture", {"n": 1}, idempotency_key="k-1"))

    def other() -> None:
        with pytest.raises(IdempotencyKeyReused):
            PaymentJob.objects.enqueue("capture", {"n": 2}, idempotency_key="k-1")

    assert [s.split()[0] for s in sent(other)] == [s.split()[0] for s in same]


@pytest.mark.parametrize(
    "payload", [{"amount": Decimal("12.50")}, {"when": object()}, {"x": float("nan")}, {1, 2}]
)
def test_enqueue__bad_payload_raises_and_writes_nothing(payload: object) -> None:
    with pytest.raises(InvalidPayload, match="payload .*not JSON"):
        PaymentJob.objects.enqueue("capture", payload, idempotency_key="k")
    assert PaymentJob.objects.count() == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": ""}, "kind must be"),
        ({"kind": "x" * 101}, "kind must be"),
        ({"kind": "a", "priority": 40000}, "priority"),
        ({"kind": "a", "max_attempts": 0}, "max_attempts"),
        ({"kind": "a", "idempotency_key": ""}, "idempotency_key"),
        ({"kind": "a", "run_at": -1}, "run_at"),
    ],
)
def test_enqueue__bad_arguments_raise_clear_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PaymentJob.objects.enqueue(**kwargs)  # type: ignore[arg-type]
    assert PaymentJob.objects.count() == 0


def test_enqueue__run_at_delay_uses_database_clock() -> None:
    job = PaymentJob.objects.enqueue("capture", run_at=timedelta(hours=1))
    assert not PaymentJob.objects.due().filter(pk=job.pk).exists()
    assert PaymentJob.objects.claim("w1", ttl=60) == []


def test_enqueue__a_projects_own_table_takes_its_columns_and_idempotency_key() -> None:
    job = PayoutJob.objects.enqueue(
        "payout.send", {"amount": 500}, recipient="acct-1", idempotency_key="po-1", priority=3
    )
    again = PayoutJob.objects.enqueue(
        "payout.send", {"amount": 500}, recipient="acct-2", idempotency_key="po-1"
    )
    job.refresh_from_db()
    assert again.pk == job.pk
    assert (job.status, job.kind, job.payload, job.recipient, job.priority) == (
        Status.PENDING,
        "payout.send",
        {"amount": 500},
        "acct-1",
        3,
    )
    assert list(PayoutJob.objects.due().values_list("pk", flat=True)) == [job.pk]
    assert PaymentJob.objects.count() == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"payment_id": "pay_1"}, "payment_id is not a column of testapp.PayoutJob"),
        ({"status": "completed"}, "status is not a column of testapp.PayoutJob"),
        ({"attempts": 3}, "attempts is not a column of testapp.PayoutJob"),
        ({"id": 7}, "id is not a column of testapp.PayoutJob"),
        ({"attempt_log": []}, "attempt_log is not a column of testapp.PayoutJob"),
        ({"recipient": "x" * 65}, "recipient: Ensure this value has at most 64 characters"),
        ({"recipient": None}, "recipient: This field cannot be null"),
        ({"recipient": "acct\x00"}, "recipient contains a NUL character"),
    ],
)
def test_enqueue__own_columns_are_checked_before_anything_is_written(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        PayoutJob.objects.enqueue("payout.send", **fields)
    assert PayoutJob.objects.count() == 0


def test_enqueue__idempotency_key_needs_a_unique_field_on_the_table() -> None:
    with pytest.raises(InvalidArgument, match="idempotency_key needs a unique idempotency_key"):
        BareJob.objects.enqueue("bare", idempotency_key="k-1")
    assert BareJob.objects.count() == 0


def test_enqueue__payment_job_keeps_payment_id_and_refuses_a_long_one() -> None:
    job = PaymentJob.objects.enqueue("capture", payment_id=None)
    assert PaymentJob.objects.get(pk=job.pk).payment_id == ""
    with pytest.raises(InvalidArgument, match="payment_id must be a string of at most 64"):
        PaymentJob.objects.enqueue("capture", payment_id="p" * 65)
    assert PaymentJob.objects.count() == 1


def test_enqueue_many__one_job_per_payload_in_order_with_the_same_options() -> None:
    jobs = PaymentJob.objects.enqueue_many(
        "capture", [{"n": 1}, {"n": 2}, None], priority=3, max_attempts=2
    )
    assert [job.payload for job in jobs] == [{"n": 1}, {"n": 2}, {}]
    assert [job.pk for job in jobs] == sorted(job.pk for job in jobs)
    stored = PaymentJob.objects.order_by("pk")
    assert [(j.kind, j.priority, j.max_attempts, j.status) for j in stored] == [
        ("capture", 3, 2, Status.PENDING)
    ] * 3
    assert PaymentJob.objects.enqueue_many("capture", []) == []


def test_enqueue_many__jobs_sharing_a_lock_wait_in_the_payloads_order() -> None:
    jobs = PaymentJob.objects.enqueue_many("capture", [{}, {}, {}], payment_id="pay_9")
    statuses = [PaymentJob.objects.get(pk=job.pk).status for job in jobs]
    assert statuses == [Status.PENDING, Status.WAITING, Status.WAITING]
    assert {job.lock for job in jobs} == {"payment:pay_9"}


def test_enqueue_many__idempotency_keys_one_per_payload_return_the_first_job() -> None:
    first = PaymentJob.objects.enqueue("capture", idempotency_key="k1")
    jobs = PaymentJob.objects.enqueue_many(
        "capture", [{}, {}, {}, {}], idempotency_keys=["k1", "k2", None, "k2"]
    )
    assert jobs[0].pk == first.pk and jobs[1].pk == jobs[3].pk
    assert len({job.pk for job in jobs}) == 3 and PaymentJob.objects.count() == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"payloads": {"a": 1}}, "payloads must be a list of payloads"),
        ({"payloads": "abc"}, "payloads must be a list of payloads"),
        ({"payloads": [{}], "idempotency_key": "k"}, "takes idempotency_keys=\\[...\\]"),
        ({"payloads": [{}, {}], "idempotency_keys": ["k"]}, "got 1 for 2 payloads"),
        ({"payloads": [{}, {}, {"bad": object()}]}, "payloads\\[2\\]: payload"),
        ({"payloads": [{}, {}], "priority": "high"}, "payloads\\[0\\]: priority"),
    ],
)
def test_enqueue_many__bad_input_raises_naming_it_and_writes_nothing(
    kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        PaymentJob.objects.enqueue_many("capture", **kwargs)  # type: ignore[arg-type]
    assert PaymentJob.objects.count() == 0


def test_aenqueue__and_aenqueue_many_are_enqueue_awaitable() -> None:
    async def enqueue_from_async_code() -> tuple[PaymentJob, list[PaymentJob]]:
        one = await PaymentJob.objects.aenqueue("capture", {"n": 0}, payment_id="pay_1")
        many = await PaymentJob.objects.aenqueue_many("capture", [{"n": 1}, {"n": 2}])
        with pytest.raises(InvalidPayload):
            await PaymentJob.objects.aenqueue("capture", {"bad": object()})
        return one, many

    one, many = async_to_sync(enqueue_from_async_code)()
    assert one.lock == "payment:pay_1" and [job.payload for job in many] == [{"n": 1}, {"n": 2}]
    assert PaymentJob.objects.count() == 3


def seen_elsewhere(pks: list[int]) -> list[int]:
    """The jobs of `pks` that another connection (a thread's own) sees: the committed ones."""
    seen: list[int] = []

    def read() -> None:
        try:
            seen.extend(PaymentJob.objects.filter(pk__in=pks).values_list("pk", flat=True))
        finally:
            connection.close()

    thread = threading.Thread(target=read)
    thread.start()
    thread.join()
    return sorted(seen)


@pytest.mark.django_db(transaction=True)
def test_aenqueue__joins_the_callers_atomic_block_and_commits_outside_one() -> None:
    @async_to_sync
    async def aenqueue(*payloads: dict[str, int]) -> list[int]:
        one = await PaymentJob.objects.aenqueue("capture", payloads[0])
        many = await PaymentJob.objects.aenqueue_many("capture", payloads[1:])
        return sorted([one.pk, *(job.pk for job in many)])

    class UndoError(Exception):
        pass

    with pytest.raises(UndoError), transaction.atomic():
        inside = aenqueue({"n": 1}, {"n": 2}, {"n": 3})
        # In the block's own transaction: this connection sees them, no other one yet.
        assert (PaymentJob.objects.filter(pk__in=inside).count(), seen_elsewhere(inside)) == (3, [])
        raise UndoError
    assert PaymentJob.objects.count() == 0  # rolled back with the block
    outside = aenqueue({"n": 4}, {"n": 5})
    assert seen_elsewhere(outside) == outside  # committed at once


# ---- statements sent: no savepoint where nothing can conflict, NOTIFY once per kind -----------


def sent(run: Callable[[], object]) -> list[str]:
    """The statements `run` sends, upper-cased."""
    with CaptureQueriesContext(connection) as queries:
        run()
    return [query["sql"].upper() for query in queries.captured_queries]


def notified(statements: list[str]) -> int:
    return sum("PG_NOTIFY" in sql for sql in statements)


def test_enqueue__in_a_transaction_sends_one_insert_and_no_savepoint() -> None:
    plain = sent(lambda: PaymentJob.objects.enqueue("capture", {"n": 1}))
    keyed = sent(lambda: PaymentJob.objects.enqueue("capture", idempotency_key="k-1"))
    again = sent(lambda: PaymentJob.objects.enqueue("capture", idempotency_key="k-1"))
    assert [sql.split()[0] for sql in plain] == ["INSERT"]
    assert [sql.split()[0] for sql in keyed] == ["INSERT"]
    # The second enqueue of a key: its INSERT skips the row, then reads the first job.
    assert [sql.split()[0] for sql in again] == ["INSERT", "SELECT"]
    assert PaymentJob.objects.count() == 2


def test_enqueue__of_a_lock_reads_its_holder_and_inserts_without_a_savepoint() -> None:
    first = sent(lambda: PaymentJob.objects.enqueue("capture", payment_id="p1"))
    second = sent(lambda: PaymentJob.objects.enqueue("refund", payment_id="p1"))
    assert [sql.split()[0] for sql in first] == ["SELECT", "INSERT"]
    assert [sql.split()[0] for sql in second] == ["SELECT", "INSERT"]
    assert not any("SAVEPOINT" in sql for sql in first + second)
    assert list(PaymentJob.objects.order_by("pk").values_list("status", "lock_holder")) == [
        (Status.PENDING, "payment:p1"),
        (Status.WAITING, None),
    ]


@pytest.mark.django_db(transaction=True)
def test_enqueue__outside_a_transaction_is_one_statement_that_announces_the_job() -> None:
    """Autocommit (a web request's default): the INSERT announces its job itself, at its own
    commit, instead of a second statement and transaction after it; a key or a lock still takes
    its transaction, announced once it commits."""
    plain = sent(lambda: PaymentJob.objects.enqueue("capture", {"n": 1}))
    keyed = sent(lambda: PaymentJob.objects.enqueue("capture", idempotency_key="k-1"))
    again = sent(lambda: PaymentJob.objects.enqueue("capture", idempotency_key="k-1"))
    notifies = connection.vendor == "postgresql"
    assert [sql.split()[0] for sql in plain] == ["INSERT"]
    assert notified(plain) == (1 if notifies else 0)
    assert notified(keyed) == (1 if notifies else 0)
    assert notified(again) == 0  # nothing new
    assert PaymentJob.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_enqueue__notifies_once_per_kind_at_commit_and_never_on_rollback() -> None:
    def enqueue_in_one_transaction() -> None:
        with transaction.atomic():
            inside.extend(
                sent(
                    lambda: (
                        [
                            PaymentJob.objects.enqueue(kind, idempotency_key=key)
                            for kind, key in [
                                ("capture", None),
                                ("refund", "r1"),
                                ("capture", "c1"),
                            ]
                        ]
                        + PaymentJob.objects.enqueue_many("refund", [{}, {}])
                    )
                )
            )

    inside: list[str] = []
    committed = sent(enqueue_in_one_transaction)
    assert notified(inside) == 0  # nothing is announced before the commit

    def rolled_back_transaction() -> None:
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            PaymentJob.objects.enqueue("capture")
            1 / 0  # noqa: B018

    rolled_back = sent(rolled_back_transaction)
    after_rollback = sent(lambda: PaymentJob.objects.enqueue("capture"))

    def savepoint_rolled_back() -> None:
        with transaction.atomic():
            with pytest.raises(ZeroDivisionError), transaction.atomic():
                PaymentJob.objects.enqueue("refund")
                1 / 0  # noqa: B018
            PaymentJob.objects.enqueue("refund")

    after_savepoint = sent(savepoint_rolled_back)
    notifies = connection.vendor == "postgresql"
    assert notified(committed) == (2 if notifies else 0)
    assert notified(rolled_back) == 0
    assert notified(after_rollback) == notified(after_savepoint) == (1 if notifies else 0)
    assert PaymentJob.objects.count() == 7


# ---- enqueue_many(): one INSERT per batch, the rules of enqueue() -------------------------------


def test_enqueue_many__sends_one_insert_for_a_batch() -> None:
    statements = sent(
        lambda: PaymentJob.objects.enqueue_many("capture", [{"n": n} for n in range(50)])
    )
    assert [sql.split()[0] for sql in statements] == ["INSERT"]
    assert sorted(PaymentJob.objects.values_list("payload__n", flat=True)) == list(range(50))


PAYLOADS: list[Any] = [
    {"order": {"id": 7, "lines": [{"sku": "a", "qty": 2}, {"sku": "b", "qty": None}]}},
    {"text": "Zahlung über 5 € ✓ 🧾", "quote": 'say "hi"\\n'},
    [1, 2.5, True, False, None, "x"],
    "a plain string",
    2**63 - 1,
    -0.125,
    None,
    {},
]
"""Payloads of every JSON shape, for the rows enqueue_many() writes (None: `{}`)."""


def test_enqueue_many__writes_each_job_as_enqueue_does_and_returns_what_it_stored() -> None:
    options = {"priority": 4, "max_attempts": 3, "run_at": 600}
    keys = [None if n % 3 else f"k{n}" for n in range(len(PAYLOADS))]
    one_by_one = [
        PaymentJob.objects.enqueue("capture", payload, idempotency_key=key, **options).pk
        for payload, key in zip(PAYLOADS, keys, strict=True)
    ]
    batch = PaymentJob.objects.enqueue_many(
        "capture", PAYLOADS, idempotency_keys=[key and f"b-{key}" for key in keys], **options
    )

    def row(pk: int) -> dict[str, Any]:
        values = PaymentJob.objects.filter(pk=pk).values().get()
        values["delay"] = values.pop("run_at") - values.pop("created_at")
        del values["id"]
        return values

    for pk, job in zip(one_by_one, batch, strict=True):
        assert row(job.pk) == {**row(pk), "idempotency_key": job.idempotency_key}
        # The job returned is the job stored, every field (the database's defaults included).
        stored = PaymentJob.objects.get(pk=job.pk)
        fields = [field.attname for field in PaymentJob._meta.concrete_fields]
        assert [getattr(job, name) for name in fields] == [getattr(stored, n) for n in fields]
        assert not job._state.adding and job._state.db == stored._state.db
    assert [job.payload for job in batch] == [{} if p is None else p for p in PAYLOADS]
    assert [job.idempotency_key for job in batch] == [key and f"b-{key}" for key in keys]


def test_enqueue_many__a_post_init_receiver_sees_every_job_it_returns() -> None:
    seen: list[Any] = []

    def receiver(sender: Any, instance: PaymentJob, **kwargs: Any) -> None:
        seen.append(instance)

    post_init.connect(receiver, sender=PaymentJob)
    try:
        jobs = PaymentJob.objects.enqueue_many("capture", [{"n": n} for n in range(4)])
    finally:
        post_init.disconnect(receiver, sender=PaymentJob)
    assert all(any(job is instance for instance in seen) for job in jobs)


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="rows as arrays are PostgreSQL's INSERT"
)
def test_enqueue_many__sends_the_same_few_parameters_whatever_the_batch_size() -> None:
    def statement(count: int) -> tuple[str, int]:
        seen: list[tuple[str, Any]] = []

        def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
            seen.append((sql, params))
            return execute(sql, params, many, context)

        payloads = [{"n": n} for n in range(count)]
        keys = [f"{count}-{n}" if n % 2 else None for n in range(count)]
        with connection.execute_wrapper(record):
            jobs = PaymentJob.objects.enqueue_many("capture", payloads, idempotency_keys=keys)
        assert [job.payload for job in jobs] == payloads
        [(sql, params)] = [(sql, params) for sql, params in seen if sql.startswith("INSERT")]
        return sql, len(params)

    assert statement(3) == statement(3000)


def test_enqueue_many__keys_repeated_in_the_batch_and_existing_return_the_first_job() -> None:
    existing = PaymentJob.objects.enqueue("capture", {"n": 0}, idempotency_key="k0")
    payloads = [{"n": 0}, {"n": 2}, {"n": 2}, {"n": 4}, {"n": 5}]
    keys = ["k0", "k1", "k1", None, "k2"]
    jobs: list[PaymentJob] = []
    statements = sent(
        lambda: jobs.extend(
            PaymentJob.objects.enqueue_many("capture", payloads, idempotency_keys=keys)
        )
    )
    # One INSERT of the keyed and keyless jobs (ids in the payloads' order), one SELECT.
    assert [sql.split()[0] for sql in statements] == ["INSERT", "SELECT"]
    assert jobs[0].pk == existing.pk and jobs[0].payload == {"n": 0}
    assert jobs[1].pk == jobs[2].pk and jobs[2].payload == {"n": 2}  # the first of k1
    assert len({job.pk for job in jobs}) == 4 and PaymentJob.objects.count() == 4
    new = [jobs[1].pk, jobs[3].pk, jobs[4].pk]
    assert new == sorted(new)  # ids in the payloads' order
    for job in jobs:  # each instance is the stored row
        stored = PaymentJob.objects.get(pk=job.pk)
        assert (job.payload, job.idempotency_key, job.run_at, job.created_at, job.status) == (
            stored.payload,
            stored.idempotency_key,
            stored.run_at,
            stored.created_at,
            stored.status,
        )


def test_enqueue_many__the_first_new_job_of_a_free_lock_takes_it_the_rest_wait() -> None:
    elsewhere = PaymentJob.objects.enqueue("capture", idempotency_key="k0")  # of no lock
    jobs = PaymentJob.objects.enqueue_many(
        "capture", [{}, {}, {}, {}], lock="L", idempotency_keys=["k0", "k1", "k2", "k1"]
    )
    assert jobs[0].pk == elsewhere.pk and jobs[1].pk == jobs[3].pk
    assert [(job.status, job.lock_holder) for job in map(stored, jobs)] == [
        (Status.PENDING, None),
        (Status.PENDING, "L"),
        (Status.WAITING, None),
        (Status.PENDING, "L"),
    ]
    # A held lock: every new job waits behind its holder, in the payloads' order.
    more = PaymentJob.objects.enqueue_many(
        "capture", [{}, {}], lock="L", idempotency_keys=["k1", "k3"]
    )
    assert more[0].pk == jobs[1].pk and stored(more[1]).status == Status.WAITING
    assert list(PaymentJob.objects.waiting().order_by("pk").values_list("pk", flat=True)) == [
        jobs[2].pk,
        more[1].pk,
    ]


def stored(job: PaymentJob) -> PaymentJob:
    return PaymentJob.objects.get(pk=job.pk)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"payloads": [{}, {"bad": object()}, {}], "lock": "L"}, "payloads\\[1\\]: payload"),
        ({"payloads": [{}, {}, {}], "idempotency_keys": ["a", "", "c"]}, "payloads\\[1\\]: idem"),
        ({"payloads": [{}, {}], "payment_id": "p" * 65}, "payloads\\[0\\]: payment_id"),
    ],
)
def test_enqueue_many__a_bad_item_in_the_middle_writes_nothing(
    options: dict[str, Any], message: str
) -> None:
    PaymentJob.objects.enqueue("capture", idempotency_key="a")
    with pytest.raises(InvalidArgument, match=message):
        PaymentJob.objects.enqueue_many("capture", **options)
    assert PaymentJob.objects.count() == 1


def test_enqueue__a_delay_with_a_key_or_a_lock_counts_from_the_database_clock() -> None:
    keyed = PaymentJob.objects.enqueue("capture", idempotency_key="k", run_at=3600)
    many = PaymentJob.objects.enqueue_many(
        "capture", [{}, {}], lock="L", idempotency_keys=["a", "b"], run_at=timedelta(hours=1)
    )
    pks = [keyed.pk, *(job.pk for job in many)]
    in_an_hour = PaymentJob.objects.filter(
        pk__in=pks,
        run_at__gt=Now() + timedelta(minutes=59),
        run_at__lt=Now() + timedelta(minutes=61),
    )
    assert in_an_hour.count() == 3
    assert {stored(job).run_at for job in [keyed, *many]} == {
        keyed.run_at,
        *(j.run_at for j in many),
    }
    assert PaymentJob.objects.claim("w", ttl=60) == []


def test_enqueue_many__on_a_projects_own_tables_with_and_without_a_key_column() -> None:
    payouts = PayoutJob.objects.enqueue_many(
        "payout.send", [{}, {}], recipient="acct-1", idempotency_keys=["po-1", "po-1"]
    )
    bare = BareJob.objects.enqueue_many("bare", [{}, {}], lock="B")
    assert payouts[0].pk == payouts[1].pk and PayoutJob.objects.get().recipient == "acct-1"
    assert [BareJob.objects.get(pk=job.pk).status for job in bare] == [
        Status.PENDING,
        Status.WAITING,
    ]


@pytest.mark.skipif(
    connection.vendor == "postgresql",
    reason="Django's PostgreSQL backend cannot insert without RETURNING (no lastrowid)",
)
def test_enqueue__without_returning_keeps_the_same_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """MySQL returns no rows from an INSERT: the enqueues there take the ORM's INSERT in
    savepoints, with the same outcomes (the switch is the backend's own feature flag)."""
    monkeypatch.setattr(connection.features, "can_return_columns_from_insert", False)
    first = PaymentJob.objects.enqueue("capture", payment_id="p1", idempotency_key="k1")
    again = PaymentJob.objects.enqueue("capture", payment_id="p1", idempotency_key="k1")
    jobs = PaymentJob.objects.enqueue_many(
        "capture", [{}, {}, {}], payment_id="p1", idempotency_keys=["k1", "k2", "k2"]
    )
    assert again.pk == first.pk == jobs[0].pk and jobs[1].pk == jobs[2].pk
    with pytest.raises(IdempotencyKeyReused, match="^idempotency_key 'k1'"):
        PaymentJob.objects.enqueue("refund", payment_id="p1", idempotency_key="k1")
    with pytest.raises(IdempotencyKeyReused, match=r"^payloads\[1\]: idempotency_key 'k2'"):
        PaymentJob.objects.enqueue_many(
            "capture", [{}, {"n": 1}], payment_id="p1", idempotency_keys=["k3", "k2"]
        )
    assert [(job.status, job.lock_holder) for job in map(stored, [first, jobs[1]])] == [
        (Status.PENDING, "payment:p1"),
        (Status.WAITING, None),
    ]
    assert PaymentJob.objects.count() == 2


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("many", [0, 4])
def test_enqueue__racing_enqueues_of_the_same_keys_and_lock_make_each_job_once(
    processes: Processes, many: int
) -> None:
    """Three processes enqueue the same 12 keys of one lock at once (one by one, or in batches
    of 4): the unique indexes decide, no savepoint catches anything, and every process gets the
    one job of each key; one job holds the lock, the others wait behind it."""
    start_at = str(time.time() + 3)  # every enqueuer has started up by then
    command = ["-m", "tests.enqueuer", "--jobs", "12", "--locks", "race", "--keys"]
    racers = [
        processes.start(*command, "--many", str(many), "--start-at", start_at) for _ in range(3)
    ]
    orders = []
    for proc in racers:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
        orders.append(json.loads(out.strip().splitlines()[-1])["pks"])
    assert orders[0] == orders[1] == orders[2]
    jobs = PaymentJob.objects.order_by("pk")
    assert sorted(jobs.values_list("idempotency_key", flat=True)) == sorted(
        f"race-{i}" for i in range(12)
    )
    assert [(job.status, job.lock_holder) for job in jobs] == [(Status.PENDING, "race")] + [
        (Status.WAITING, None)
    ] * 11
