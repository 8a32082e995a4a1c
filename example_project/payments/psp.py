"""A fake payment service provider: slow, flaky, sometimes stalled, and idempotent.

Like a real PSP it honours idempotency keys: a second call with a key it has seen returns the
first call's result and moves no money. That is what makes a retried (or zombie) capture safe.

Its books are the `FakePspCharge` table (one row per money movement) and `FakePspCall` (one row per
call that reached it), in a database of their own (`routers.BOOKS`) that separate worker processes
share; they commit apart from the shop's transactions, as a real PSP's do. Its moods come from the
environment, so the demo can set them for the worker processes it starts:

- `FAKE_PSP_LATENCY`: mean seconds of a call (default 0.3);
- `FAKE_PSP_ERROR_RATE`: share of calls that fail with a 503 before doing anything (0.06);
- `FAKE_PSP_TIMEOUT_RATE`: share of calls that move the money, then lose the answer (0.03);
- `FAKE_PSP_STALL_RATE`: share of calls that hang for `FAKE_PSP_STALL_SECONDS` (0.02, 10 s); a
  caller that gives a client `timeout=` gets `PspTimeoutError` after it instead, the PSP acting
  on the call all the same.

Which payments are declined is decided by the merchant reference, so every retry of a payment
gets the same answer: about 4 in 100 are declined (at authorization, or at capture if there was
none), 2 in 100 captures rejected (authorization expired).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Required, TypedDict, Unpack

from asgiref.sync import sync_to_async
from django.db import IntegrityError, transaction
from django.db.models import F, QuerySet, Sum
from django.db.models.functions import Coalesce

from example_project.payments.models import FakePspCall, FakePspCharge, Payment
from example_project.payments.routers import BOOKS

AUTHORIZE = FakePspCharge.Operation.AUTHORIZE
CAPTURE = FakePspCharge.Operation.CAPTURE
REFUND = FakePspCharge.Operation.REFUND
SUCCEEDED = FakePspCharge.Outcome.SUCCEEDED
DECLINED = FakePspCharge.Outcome.DECLINED
REJECTED = FakePspCharge.Outcome.REJECTED


class PspUnavailableError(Exception):
    """The PSP did not answer (a 503, a reset connection): try again with the same key."""


class PspTimeoutError(PspUnavailableError):
    """The answer was lost after the PSP may have acted: only the same key makes a retry safe."""


class IdempotencyConflictError(Exception):
    """An idempotency key was sent again with a different request."""


@dataclass(frozen=True)
class Moods:
    latency: float = 0.3
    error_rate: float = 0.06
    timeout_rate: float = 0.03
    stall_rate: float = 0.02
    stall_seconds: float = 10.0

    @classmethod
    def from_env(cls) -> Moods:
        def number(name: str, default: float) -> float:
            return float(os.environ.get(f"FAKE_PSP_{name.upper()}", default))

        return cls(**{name: number(name, value) for name, value in vars(cls()).items()})


@dataclass(frozen=True)
class PspResult:
    """What the PSP answered to one call."""

    reference: str
    operation: str
    outcome: str
    message: str
    replayed: bool

    @property
    def succeeded(self) -> bool:
        return self.outcome == SUCCEEDED

    @classmethod
    def of(cls, charge: FakePspCharge, *, replayed: bool) -> PspResult:
        return cls(charge.reference, charge.operation, charge.outcome, charge.message, replayed)


@dataclass(frozen=True)
class Request:
    """What a call sends besides its operation."""

    payment_ref: str
    amount: int
    currency: str
    idempotency_key: str
    timeout: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class CallOptions(TypedDict, total=False):
    """A call's keywords: its `idempotency_key` (required), a client `timeout` in seconds (none:
    wait as long as the PSP takes), `metadata` the PSP keeps with the call."""

    idempotency_key: Required[str]
    timeout: float | None
    metadata: dict[str, Any]


def authorize(
    payment_ref: str, amount: int, currency: str, **call: Unpack[CallOptions]
) -> PspResult:
    """Hold `amount` (minor units) on the card of the payment `payment_ref`; moves no money."""
    return _call(AUTHORIZE, Request(payment_ref, amount, currency, **call))


def capture(payment_ref: str, amount: int, currency: str, **call: Unpack[CallOptions]) -> PspResult:
    """Take `amount` (minor units) for the payment `payment_ref`."""
    return _call(CAPTURE, Request(payment_ref, amount, currency, **call))


def refund(payment_ref: str, amount: int, currency: str, *, idempotency_key: str) -> PspResult:
    """Give `amount` back for the payment `payment_ref`."""
    return _call(REFUND, Request(payment_ref, amount, currency, idempotency_key))


async def arefund(
    payment_ref: str, amount: int, currency: str, *, idempotency_key: str
) -> PspResult:
    """`refund()` for async code, as an async HTTP client would call the PSP: the network legs
    are awaited, so one event loop can wait on many PSP calls; the books are kept on the
    caller's database thread (`sync_to_async`)."""
    moods = Moods.from_env()
    await _apause(moods.latency / 2)
    if random.random() < moods.error_rate:  # noqa: S311 - a fake's mood, not cryptography
        raise PspUnavailableError("503 Service Unavailable")
    if random.random() < moods.stall_rate:  # noqa: S311
        await asyncio.sleep(moods.stall_seconds)
    request = Request(payment_ref, amount, currency, idempotency_key)
    result = await sync_to_async(_act)(REFUND, request)
    await _apause(moods.latency / 2)
    if not result.replayed and random.random() < moods.timeout_rate:  # noqa: S311
        raise PspTimeoutError("read timed out; the request may have been processed")
    return result


def lookup(idempotency_key: str) -> PspResult | None:
    """Return what the PSP did under `idempotency_key`, or None if it never acted on it."""
    charge = FakePspCharge.objects.filter(idempotency_key=idempotency_key).first()
    return PspResult.of(charge, replayed=True) if charge else None


def find_capture(payment_ref: str) -> PspResult | None:
    """Return the successful capture of the payment `payment_ref`, if the PSP made one."""
    charge = (
        FakePspCharge.objects.filter(payment_ref=payment_ref, operation=CAPTURE, outcome=SUCCEEDED)
        .order_by("pk")
        .first()
    )
    return PspResult.of(charge, replayed=True) if charge else None


def captured(payment_refs: list[str]) -> list[str]:
    """Return which of `payment_refs` the PSP captured: its settlement report."""
    charges = FakePspCharge.objects.filter(
        payment_ref__in=payment_refs, operation=CAPTURE, outcome=SUCCEEDED
    )
    return sorted(set(charges.values_list("payment_ref", flat=True)))


def act_now(
    operation: str, payment_ref: str, amount: int, currency: str, *, idempotency_key: str
) -> PspResult:
    """Make the PSP succeed at once, in no mood: for writing a demo's history (a past capture)."""
    request = Request(payment_ref, amount, currency, idempotency_key)
    return _act(operation, request, (SUCCEEDED, ""))


def _call(operation: str, request: Request) -> PspResult:
    moods = Moods.from_env()
    timeout = request.timeout
    # The request travels, is answered, travels back: half the latency on each leg.
    _pause(moods.latency / 2)
    if random.random() < moods.error_rate:  # noqa: S311 - a fake's mood, not cryptography
        raise PspUnavailableError("503 Service Unavailable")
    if random.random() < moods.stall_rate:  # noqa: S311
        if timeout is not None and timeout < moods.stall_seconds:
            time.sleep(timeout)
            # The client gave up; the PSP gets to the request all the same.
            _act(operation, request)
            raise PspTimeoutError(
                f"no answer within {timeout:g}s; the request may have been processed"
            )
        time.sleep(moods.stall_seconds)
    result = _act(operation, request)
    _pause(moods.latency / 2)
    if not result.replayed and random.random() < moods.timeout_rate:  # noqa: S311
        raise PspTimeoutError("read timed out; the request may have been processed")
    return result


def _pause(mean: float) -> None:
    time.sleep(mean * random.uniform(0.5, 1.5))  # noqa: S311


async def _apause(mean: float) -> None:
    await asyncio.sleep(mean * random.uniform(0.5, 1.5))  # noqa: S311


def _act(operation: str, request: Request, decided: tuple[str, str] | None = None) -> PspResult:
    outcome, message = decided or _decide(operation, request.payment_ref)
    key = request.idempotency_key
    try:
        # The unique key decides between two calls racing with one key, not a prior read. The
        # books' own transaction: it commits whatever becomes of the caller's.
        with transaction.atomic(using=BOOKS):
            charge = FakePspCharge.objects.create(
                idempotency_key=key,
                operation=operation,
                payment_ref=request.payment_ref,
                amount=request.amount,
                currency=request.currency,
                outcome=outcome,
                message=message,
                reference=f"psp_{secrets.token_hex(8)}",
            )
            _book_call(operation, request, replayed=False)
        return PspResult.of(charge, replayed=False)
    except IntegrityError:
        charge = FakePspCharge.objects.get(idempotency_key=key)
    asked = (operation, request.payment_ref, request.amount, request.currency)
    if (charge.operation, charge.payment_ref, charge.amount, charge.currency) != asked:
        raise IdempotencyConflictError(
            f"idempotency key {key!r} was already used for another request"
        )
    with transaction.atomic(using=BOOKS):
        FakePspCharge.objects.filter(pk=charge.pk).update(replays=F("replays") + 1)
        _book_call(operation, request, replayed=True)
    return PspResult.of(charge, replayed=True)


def _book_call(operation: str, request: Request, *, replayed: bool) -> None:
    FakePspCall.objects.create(
        idempotency_key=request.idempotency_key,
        operation=operation,
        replayed=replayed,
        metadata=request.metadata,
    )


def _decide(operation: str, payment_ref: str) -> tuple[str, str]:
    if operation == REFUND:
        if find_capture(payment_ref) is None:
            return REJECTED, "nothing was captured for this payment"
        return SUCCEEDED, ""
    luck = int(hashlib.sha256(payment_ref.encode()).hexdigest()[:8], 16) % 100
    authorized = FakePspCharge.objects.filter(
        payment_ref=payment_ref, operation=AUTHORIZE, outcome=SUCCEEDED
    ).exists()
    if luck < 4 and not authorized:
        return DECLINED, "insufficient funds"
    if luck < 6 and operation == CAPTURE:
        return REJECTED, "authorization expired"
    return SUCCEEDED, ""


@dataclass(frozen=True)
class Audit:
    """The PSP's books held against the shop's payments."""

    duplicate_charges: int
    """Money moved twice for one payment (a second key for the same capture or refund)."""
    unrecorded_charges: int
    """Money the PSP moved that the shop's payment does not show."""
    phantom_payments: int
    """Payments the shop shows captured or refunded without such a charge at the PSP."""
    replays: int
    """Calls answered from an earlier result: each would have been a double charge without keys."""

    @property
    def double_charges(self) -> int:
        return self.duplicate_charges + self.unrecorded_charges


def audit(payments: QuerySet[Payment]) -> Audit:
    """Hold the PSP's successful charges of `payments` against their statuses."""
    statuses = {str(pk): status for pk, status in payments.values_list("pk", "status")}
    charges: list[dict[str, Any]] = list(
        FakePspCharge.objects.filter(
            payment_ref__in=list(statuses), operation__in=[CAPTURE, REFUND]
        ).values("payment_ref", "operation", "outcome", "replays")
    )
    moved = Counter(
        (c["payment_ref"], c["operation"]) for c in charges if c["outcome"] == SUCCEEDED
    )
    shown = {
        CAPTURE: {Payment.Status.CAPTURED, Payment.Status.REFUNDED},
        REFUND: {Payment.Status.REFUNDED},
    }
    unrecorded = sum(1 for (ref, op) in moved if statuses[ref] not in shown[op])
    phantom = sum(
        1
        for ref, status in statuses.items()
        for op, showing in shown.items()
        if status in showing and (ref, op) not in moved
    )
    return Audit(
        duplicate_charges=sum(count - 1 for count in moved.values()),
        unrecorded_charges=unrecorded,
        phantom_payments=phantom,
        replays=FakePspCharge.objects.filter(payment_ref__in=list(statuses)).aggregate(
            total=Coalesce(Sum("replays"), 0)
        )["total"],
    )
