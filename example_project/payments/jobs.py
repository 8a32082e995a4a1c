"""The shop's payment jobs: capture, refund, reconcile and the periodic reconcile sweep.

Every handler follows the same three steps:

1. `lease.checkpoint("psp_called")` before the PSP is asked to move money, so that the stuck
   watcher knows the call may have happened if the worker dies (capture is under the "review"
   policy in settings: its expired jobs go to a reconcile hook, never blindly to another worker);
2. the PSP call with the job's `idempotency_key`: a retry, or a zombie worker that wakes up
   after its lease was taken over, sends the same key and the PSP moves no money twice;
3. `lease.atomic()` around the shop's own write: the payment's new status and the job's
   completion commit together, and not at all if the lease was lost meanwhile.

`reconcile_sweep` runs once per tick of the "reconcile-sweep" schedule (settings.py): it finds
the payments the PSP captured while the shop still shows them pending and enqueues one
`reconcile` job for each.

`refund` is an `async def` handler, as a shop calling its PSP with an async HTTP client would
write it: the same steps with `await lease.acheckpoint()` and `await lease.aatomic()`.

`checkout` is a customer's whole checkout as resumable steps (`lease.step()`): authorize, capture,
notify, each recorded with its own writes, each PSP call under the step's own idempotency key
(`lease.step_key()`); a later attempt resumes after the last recorded step. `webhook` and
`ledger` are enqueued `after=[capture]`: they start once the capture completed, with the payment
already settled.
"""

from __future__ import annotations

from typing import Any

from django.db.models.functions import Now

from django_leases import PermanentError, job_handler
from django_leases.models import PaymentJob
from example_project.payments import psp
from example_project.payments.models import Followup, Payment

Status = Payment.Status


def record_capture(payment_id: str, result: psp.PspResult) -> int:
    """Write the PSP's answer to a capture on the payment; return the rows changed."""
    status = Status.CAPTURED if result.succeeded else Status.DECLINED
    # A payment refunded meanwhile stays refunded: the capture is part of its history.
    return (
        Payment.objects.filter(pk=payment_id)
        .exclude(status=Status.REFUNDED)
        .update(status=status, psp_reference=result.reference, updated_at=Now())
    )


def reconcile_capture(job: PaymentJob) -> str:
    """Say what became of a capture whose worker died after calling the PSP.

    The watcher calls this for capture jobs under review. The PSP is asked by the job's
    idempotency key: if it never saw the call, running the job again is safe.
    """
    result = psp.lookup(job.idempotency_key or "")
    if result is None:
        return "retry"
    if result.outcome == psp.REJECTED:
        return "failed"
    record_capture(job.payment_id, result)
    return "completed"


@job_handler("capture", reconcile=reconcile_capture)
def capture(job, lease):
    payment = Payment.objects.get(pk=job.payment_id)
    lease.checkpoint("psp_called")
    result = psp.capture(
        str(payment.pk), payment.amount, payment.currency, idempotency_key=job.idempotency_key
    )
    if result.outcome == psp.REJECTED:
        raise PermanentError(f"the PSP rejected the capture: {result.message}")
    with lease.atomic():
        record_capture(job.payment_id, result)


def record_refund(payment_id: str) -> int:
    return Payment.objects.filter(pk=payment_id).update(status=Status.REFUNDED, updated_at=Now())


@job_handler("refund")
async def refund(job, lease):
    """The same three steps from async code: an async PSP client, awaited lease writes."""
    payment = await Payment.objects.aget(pk=job.payment_id)
    await lease.acheckpoint("psp_called")
    result = await psp.arefund(
        str(payment.pk), payment.amount, payment.currency, idempotency_key=job.idempotency_key
    )
    if not result.succeeded:
        raise PermanentError(f"the PSP refused the refund: {result.message}")
    # The async counterpart of `with lease.atomic():`, for a synchronous function.
    await lease.aatomic(record_refund, job.payment_id)


@job_handler("reconcile")
def reconcile(job, lease):
    """Heal a payment the shop still shows pending: did the PSP charge it after all?

    It only reads from the PSP, so running it twice is harmless: no checkpoint needed.
    """
    found = psp.find_capture(job.payment_id)
    with lease.atomic():
        pending = Payment.objects.filter(pk=job.payment_id, status=Status.PENDING)
        if found is None:
            pending.update(status=Status.EXPIRED, updated_at=Now())
        else:
            pending.update(status=Status.CAPTURED, psp_reference=found.reference, updated_at=Now())


# Payments one sweep looks at: the oldest pending first; the next tick takes the rest.
SWEEP_BATCH = 500


@job_handler("reconcile_sweep")
def reconcile_sweep(job, lease):
    """Enqueue a `reconcile` job for each pending payment that the PSP captured.

    The PSP took the money but the shop never heard: its webhook was lost, or the process that
    should have recorded the capture died after the PSP call. Each payment's job has its own
    idempotency key, so however many sweeps see the payment, it gets one reconcile job.
    """
    pending = Payment.objects.filter(status=Status.PENDING).order_by("pk")[:SWEEP_BATCH]
    for payment_ref in psp.captured([str(pk) for pk in pending.values_list("pk", flat=True)]):
        PaymentJob.objects.enqueue(
            "reconcile",
            payment_id=payment_ref,
            idempotency_key=f"reconcile-{payment_ref}",
            max_attempts=8,
        )


# A step holds its transaction open while the PSP answers (on SQLite, the database's write
# lock): the checkout's calls give up after this many seconds instead of hanging.
STEP_TIMEOUT = 1.0


def ask_psp(call: Any, payment: Payment, key: str, attempt: int) -> psp.PspResult:
    """Send `call` (`psp.authorize`, `psp.capture`) for the payment, under the step's key."""
    metadata = {"attempt": attempt}
    options = {"idempotency_key": key, "timeout": STEP_TIMEOUT, "metadata": metadata}
    return call(str(payment.pk), payment.amount, payment.currency, **options)


def authorize_card(payment: Payment, key: str, attempt: int) -> dict[str, Any]:
    """Authorize the payment's amount at the PSP; the payment's new status commits with the
    step's record."""
    result = ask_psp(psp.authorize, payment, key, attempt)
    status = Status.AUTHORIZED if result.succeeded else Status.DECLINED
    Payment.objects.filter(pk=payment.pk).update(status=status, updated_at=Now())
    return {"outcome": result.outcome, "reference": result.reference}


def capture_payment(payment: Payment, key: str, attempt: int) -> dict[str, Any]:
    """Capture the authorized amount; the payment's new status commits with the step's record."""
    result = ask_psp(psp.capture, payment, key, attempt)
    if result.outcome != psp.REJECTED:
        record_capture(str(payment.pk), result)
    return {"outcome": result.outcome, "reference": result.reference}


def send_receipt(payment: Payment, job_ref: int) -> dict[str, Any]:
    """Queue the customer's receipt in the shop's outbox (a row written with the step's record)."""
    seen = Payment.objects.values_list("status", flat=True).get(pk=payment.pk)
    receipt = Followup.objects.create(
        kind=Followup.Kind.RECEIPT, payment=payment, job_ref=job_ref, payment_status=seen
    )
    return {"receipt": receipt.pk}


@job_handler("checkout")
def checkout(job, lease):
    """authorize -> capture -> notify, each recorded once; a retry resumes after the last one."""
    payment = Payment.objects.get(pk=job.payment_id)
    key = lease.step_key
    authorized = lease.step("authorize", authorize_card, payment, key("authorize"), lease.attempt)
    if authorized["outcome"] != psp.SUCCEEDED:
        return  # declined: nothing to capture, the payment says so
    captured = lease.step("capture", capture_payment, payment, key("capture"), lease.attempt)
    if captured["outcome"] == psp.REJECTED:
        raise PermanentError("the PSP rejected the capture")
    lease.step("notify", send_receipt, payment, job.pk)


def follow_up(job, lease, kind: str) -> None:
    """Record `kind` for the job's payment with the job's completion, and the payment's status as
    the job found it when it started (settled: the capture it waits for has completed)."""
    payment = Payment.objects.get(pk=job.payment_id)
    amount = (
        payment.amount if kind == Followup.Kind.LEDGER and payment.status == Status.CAPTURED else 0
    )
    with lease.atomic():
        Followup.objects.create(
            kind=kind, payment=payment, job_ref=job.pk, payment_status=payment.status, amount=amount
        )


@job_handler("webhook")
def webhook(job, lease):
    """Tell the merchant's order system what became of the capture."""
    follow_up(job, lease, Followup.Kind.WEBHOOK)


@job_handler("ledger")
def ledger(job, lease):
    """Post the captured amount to the shop's accounts (nothing for a declined capture)."""
    follow_up(job, lease, Followup.Kind.LEDGER)
