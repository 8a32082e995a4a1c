"""`enqueue()` (querysets/enqueue.py, payments.py): checked arguments, idempotency, own columns."""

from datetime import timedelta
from decimal import Decimal

import pytest

from django_leases.exceptions import InvalidArgument, InvalidPayload
from django_leases.models import PaymentJob
from tests.testapp.models import BareJob, PayoutJob

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
    first = PaymentJob.objects.enqueue("capture", {"n": 1}, idempotency_key="cap-1")
    second = PaymentJob.objects.enqueue("capture", {"n": 2}, idempotency_key="cap-1")
    assert second.pk == first.pk
    assert second.payload == {"n": 1}
    assert PaymentJob.objects.count() == 1


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
    again = PayoutJob.objects.enqueue("payout.send", recipient="acct-2", idempotency_key="po-1")
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
