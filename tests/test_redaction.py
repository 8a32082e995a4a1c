"""Error text is redacted before it is stored or logged: by default, the values that database
errors quote; with DJANGO_LEASES["REDACT_ERRORS"], whatever the project's hook decides."""

import pytest
from django.db import IntegrityError, connection, transaction
from django.test import override_settings

from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets import describe_error
from django_leases.redaction import error_text, redact_database_values

from .conftest import ON_SQLITE, Processes

CARD = "4111111111111111"


def only_the_class(exc: BaseException, text: str) -> str:
    """A project's hook: keep nothing of the text."""
    return f"<{type(exc).__name__}>"


def broken(exc: BaseException, text: str) -> str:
    raise RuntimeError(text)


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        (
            'duplicate key value violates unique constraint "shop_card_uniq"\n'
            f"DETAIL:  Key (card)=({CARD}) already exists.",
            'duplicate key value violates unique constraint "shop_card_uniq"',
        ),
        (
            'new row for relation "shop" violates check constraint "amount_positive"\n'
            f"DETAIL:  Failing row contains (1, {CARD}, -5).\nHINT:  none\nCONTEXT:  x",
            'new row for relation "shop" violates check constraint "amount_positive"',
        ),
        (
            f"invalid input syntax for type integer: \"{CARD}\"\nLINE 1: SELECT '{CARD}'::int",
            "invalid input syntax for type integer: '…'",
        ),
        (
            f"(1062, \"Duplicate entry '{CARD}' for key 'shop_payment.card'\")",
            "(1062, \"Duplicate entry '…' for key 'shop_payment.card'\")",
        ),
        (
            f"(1366, \"Incorrect integer value: '{CARD}' for column `shop`.`n` at row 1\")",
            "(1366, \"Incorrect integer value: '…' for column `shop`.`n` at row 1\")",
        ),
        (
            "UNIQUE constraint failed: shop_payment.card",
            "UNIQUE constraint failed: shop_payment.card",
        ),
    ],
)
def test_redact_database_values__strips_quoted_values_and_details(text: str, kept: str) -> None:
    assert redact_database_values(IntegrityError(text), text) == kept


def test_redact_database_values__leaves_other_errors_alone() -> None:
    text = f"card {CARD} declined: 'insufficient funds'"
    assert redact_database_values(ValueError(text), text) == text


def test_describe_error__goes_through_the_default_redaction() -> None:
    error = IntegrityError(f"duplicate key\nDETAIL:  Key (card)=({CARD}) already exists.")
    assert describe_error(error) == ("django.db.utils.IntegrityError", "duplicate key")
    assert describe_error(f"operator reason {CARD}") == ("", f"operator reason {CARD}")


@override_settings(DJANGO_LEASES={"REDACT_ERRORS": "tests.test_redaction.only_the_class"})
def test_error_text__uses_the_project_hook() -> None:
    assert error_text(ValueError(CARD)) == "<ValueError>"
    assert describe_error(KeyError(CARD)) == ("KeyError", "<KeyError>")


@override_settings(DJANGO_LEASES={"REDACT_ERRORS": "tests.test_redaction.broken"})
def test_error_text__a_failing_hook_keeps_no_text() -> None:
    assert error_text(ValueError(CARD)) == (
        "[error text withheld: REDACT_ERRORS raised RuntimeError]"
    )


@pytest.mark.django_db
def test_integrity_error__the_raw_text_carries_the_value_it_refused() -> None:
    """What the redaction is for: the databases that quote values do quote this one."""
    PaymentJob.objects.enqueue("noop", idempotency_key=CARD)
    with pytest.raises(IntegrityError) as raised, transaction.atomic():
        PaymentJob.objects.create(kind="noop", idempotency_key=CARD)
    # SQLite names the column only; PostgreSQL and MariaDB quote the value.
    assert (CARD in str(raised.value)) == (not ON_SQLITE), str(raised.value)
    assert CARD not in error_text(raised.value)


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__integrity_error_value_kept_out_of_ledger_last_error_and_logs(
    processes: Processes,
) -> None:
    PaymentJob.objects.enqueue("noop", idempotency_key=CARD)
    job = PaymentJob.objects.enqueue("leaky", {"card": CARD}, max_attempts=1)
    proc = processes.manage("run_lease_worker", "--burst", "--kind", "leaky", "-v", "2")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out

    job.refresh_from_db()
    attempts = list(JobAttempt.objects.filter(job_ref=job.pk).order_by("token"))
    assert [a.outcome for a in attempts] == ["failed"], out
    assert job.status == "failed"
    assert job.last_error.startswith("django.db.utils.IntegrityError: "), job.last_error
    assert {a.error_class for a in attempts} == {"django.db.utils.IntegrityError"}
    assert f"job_id={job.pk}" in out
    for text in [job.last_error, *(a.error_message for a in attempts), out]:
        assert CARD not in text
    if connection.vendor == "postgresql":
        assert "DETAIL" not in job.last_error and "unique constraint" in job.last_error
    if connection.vendor == "mysql":
        assert "Duplicate entry '…' for key" in job.last_error
