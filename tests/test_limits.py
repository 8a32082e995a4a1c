"""Bad input gets a clear error naming the argument and its range, the same on every database,
and writes nothing; values at the bounds are stored and read back unchanged."""

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db.models.functions import Now

from django_leases.exceptions import InvalidArgument, InvalidDuration, InvalidPayload
from django_leases.limits import (
    JSON_INT,
    LATEST_DATETIME,
    MAX_ATTEMPTS,
    MAX_DURATION,
    MAX_JSON_DEPTH,
    PRIORITY,
)
from django_leases.models import JobAttempt, PaymentJob

from .conftest import Processes

pytestmark = pytest.mark.django_db

jobs = PaymentJob.objects


def nested(depth: int) -> Any:
    """Return a value `depth` containers deep: [[...]]."""
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def self_containing() -> list[Any]:
    value: list[Any] = []
    value.append(value)
    return value


HELD = {"pk": 0, "owner": "holder", "token": 1}  # filled in by `state()`

# (id, call, exception, the argument its message names)
BAD_INPUTS: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    # enqueue: durations and datetimes
    ("run_at=1e300", lambda: jobs.enqueue("noop", run_at=1e300), InvalidDuration, "run_at"),
    ("run_at=1e12", lambda: jobs.enqueue("noop", run_at=1e12), InvalidDuration, "run_at"),
    ("run_at=nan", lambda: jobs.enqueue("noop", run_at=float("nan")), InvalidDuration, "run_at"),
    (
        "run_at=200 years",
        lambda: jobs.enqueue("noop", run_at=timedelta(days=200 * 365)),
        InvalidDuration,
        "run_at",
    ),
    ("run_at=10**400", lambda: jobs.enqueue("noop", run_at=10**400), InvalidDuration, "run_at"),
    (
        "run_at=year 9999",
        lambda: jobs.enqueue("noop", run_at=datetime(9999, 12, 31, tzinfo=UTC)),
        InvalidArgument,
        "run_at",
    ),
    (
        "run_at=year 1",
        lambda: jobs.enqueue("noop", run_at=datetime(1, 1, 1, tzinfo=UTC)),
        InvalidArgument,
        "run_at",
    ),
    (
        "run_at=naive",
        lambda: jobs.enqueue("noop", run_at=datetime(2030, 1, 1)),  # noqa: DTZ001
        InvalidArgument,
        "run_at",
    ),
    # enqueue: the payload
    ("payload too deep", lambda: jobs.enqueue("noop", nested(32)), InvalidPayload, "payload"),
    ("payload 10000 deep", lambda: jobs.enqueue("noop", nested(10_000)), InvalidPayload, "payload"),
    (
        "payload contains itself",
        lambda: jobs.enqueue("noop", self_containing()),
        InvalidPayload,
        "payload",
    ),
    (
        "payload NUL value",
        lambda: jobs.enqueue("noop", {"card": "41\x00"}),
        InvalidPayload,
        "payload",
    ),
    ("payload NUL key", lambda: jobs.enqueue("noop", {"ca\x00rd": 1}), InvalidPayload, "payload"),
    (
        "payload surrogate value",
        lambda: jobs.enqueue("noop", {"name": ["ok", "\ud800"]}),
        InvalidPayload,
        "payload",
    ),
    (
        "payload surrogate key",
        lambda: jobs.enqueue("noop", {"\udfff": 1}),
        InvalidPayload,
        "payload",
    ),
    ("payload 2**64", lambda: jobs.enqueue("noop", {"n": 2**64}), InvalidPayload, "payload"),
    ("payload NaN", lambda: jobs.enqueue("noop", {"x": float("nan")}), InvalidPayload, "payload"),
    ("payload -inf", lambda: jobs.enqueue("noop", [float("-inf")]), InvalidPayload, "payload"),
    ("payload bytes", lambda: jobs.enqueue("noop", {"b": b"x"}), InvalidPayload, "payload"),
    # enqueue: text and whole numbers
    ("kind NUL", lambda: jobs.enqueue("no\x00op"), InvalidArgument, "kind"),
    ("kind surrogate", lambda: jobs.enqueue("noop\ud83d"), InvalidArgument, "kind"),
    ("kind too long", lambda: jobs.enqueue("k" * 101), InvalidArgument, "kind"),
    (
        "payment_id NUL",
        lambda: jobs.enqueue("noop", payment_id="p\x00"),
        InvalidArgument,
        "payment_id",
    ),
    (
        "payment_id surrogate",
        lambda: jobs.enqueue("noop", payment_id="\udc00"),
        InvalidArgument,
        "payment_id",
    ),
    (
        "idempotency_key NUL",
        lambda: jobs.enqueue("noop", idempotency_key="key\x00"),
        InvalidArgument,
        "idempotency_key",
    ),
    (
        "idempotency_key surrogate",
        lambda: jobs.enqueue("noop", idempotency_key="key\ud800"),
        InvalidArgument,
        "idempotency_key",
    ),
    (
        "max_attempts=2**31",
        lambda: jobs.enqueue("noop", max_attempts=2**31),
        InvalidArgument,
        "max_attempts",
    ),
    (
        "max_attempts=0",
        lambda: jobs.enqueue("noop", max_attempts=0),
        InvalidArgument,
        "max_attempts",
    ),
    (
        "max_attempts=True",
        lambda: jobs.enqueue("noop", max_attempts=True),
        InvalidArgument,
        "max_attempts",
    ),
    ("priority=2**31", lambda: jobs.enqueue("noop", priority=2**31), InvalidArgument, "priority"),
    ("priority=-32769", lambda: jobs.enqueue("noop", priority=-32769), InvalidArgument, "priority"),
    # claim, claim_job, heartbeat and the other lease calls
    ("claim ttl=1e300", lambda: jobs.claim("w", ttl=1e300), InvalidDuration, "ttl"),
    ("claim ttl=max timedelta", lambda: jobs.claim("w", ttl=timedelta.max), InvalidDuration, "ttl"),
    ("claim owner NUL", lambda: jobs.claim("w\x00", ttl=60), InvalidArgument, "owner"),
    ("claim owner surrogate", lambda: jobs.claim("w\ud800", ttl=60), InvalidArgument, "owner"),
    ("claim owner too long", lambda: jobs.claim("w" * 256, ttl=60), InvalidArgument, "owner"),
    ("claim limit=2**31", lambda: jobs.claim("w", ttl=60, limit=2**31), InvalidArgument, "limit"),
    (
        "claim kinds NUL",
        lambda: jobs.claim("w", ttl=60, kinds=["no\x00op"]),
        InvalidArgument,
        "kinds",
    ),
    ("claim_job pk=2**64", lambda: jobs.claim_job(2**64, "w", ttl=60), InvalidArgument, "pk"),
    (
        "claim_job ttl=1e300",
        lambda: jobs.claim_job(HELD["pk"], "w", ttl=1e300),
        InvalidDuration,
        "ttl",
    ),
    (
        "claim_job owner NUL",
        lambda: jobs.claim_job(HELD["pk"], "\x00", ttl=60),
        InvalidArgument,
        "owner",
    ),
    (
        "heartbeat ttl=1e300",
        lambda: jobs.heartbeat("holder", {HELD["pk"]: 1}, ttl=1e300),
        InvalidDuration,
        "ttl",
    ),
    (
        "checkpoint step NUL",
        lambda: jobs.checkpoint(HELD["pk"], "holder", 1, "psp\x00"),
        InvalidArgument,
        "checkpoint step",
    ),
    (
        "checkpoint step surrogate",
        lambda: jobs.checkpoint(HELD["pk"], "holder", 1, "\udbff"),
        InvalidArgument,
        "checkpoint step",
    ),
    (
        "fail retry_in=1e300",
        lambda: jobs.fail(HELD["pk"], "holder", 1, ValueError("x"), retry_in=1e300),
        InvalidDuration,
        "retry_in",
    ),
    ("near_expiry within=1e300", lambda: list(jobs.near_expiry(1e300)), InvalidDuration, "within"),
]


def state() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every job and ledger row, as stored."""
    return (
        list(PaymentJob.objects.order_by("pk").values()),
        list(JobAttempt.objects.order_by("pk").values()),
    )


@pytest.mark.parametrize(
    ("call", "error", "argument"),
    [pytest.param(call, error, argument, id=name) for name, call, error, argument in BAD_INPUTS],
)
def test_bad_input__clear_error_naming_the_argument_and_nothing_written(
    call: Callable[[], object], error: type[Exception], argument: str
) -> None:
    # A due job (a claim that got through would take it) and a held one (for holder calls).
    jobs.enqueue("noop", {"n": 1})
    held = jobs.claim_job(jobs.enqueue("noop").pk, "holder", ttl=600)
    assert held is not None
    HELD["pk"] = held.pk
    before = state()

    with pytest.raises(error) as raised:
        call()

    assert isinstance(raised.value, ValueError)  # what callers catch, beside LeaseError
    assert argument in str(raised.value)
    assert len(str(raised.value)) < 300, "the message shows the value cut short"
    assert state() == before


def test_bounds__values_at_the_limits_are_stored_and_read_back() -> None:
    payload = {"deep": nested(MAX_JSON_DEPTH - 1), "ints": list(JSON_INT), "text": "ünï 🐍"}
    job = jobs.enqueue(
        "noop",
        payload,
        priority=PRIORITY[1],
        max_attempts=MAX_ATTEMPTS[1],
        run_at=LATEST_DATETIME - timedelta(seconds=1),
        payment_id="p" * 64,
        idempotency_key="🔑" * 255,
    )
    low = jobs.enqueue("noop", run_at=MAX_DURATION, priority=PRIORITY[0])
    job.refresh_from_db()
    assert job.payload == payload
    assert (job.priority, job.max_attempts) == (PRIORITY[1], MAX_ATTEMPTS[1])
    assert job.run_at == LATEST_DATETIME - timedelta(seconds=1)
    assert job.idempotency_key == "🔑" * 255

    # A lease of the longest TTL, by the database clock.
    PaymentJob.objects.filter(pk=low.pk).update(run_at=Now())
    (claimed,) = jobs.claim("w" * 255, ttl=MAX_DURATION, kinds=["noop"])
    assert claimed.pk == low.pk
    assert jobs.near_expiry(MAX_DURATION).filter(pk=low.pk).exists()
    assert not jobs.expired().filter(pk=low.pk).exists()


BAD_FLAGS = [
    ("run_lease_worker", "--ttl", "1e300"),
    ("run_lease_worker", "--heartbeat", "1e300"),
    ("run_lease_worker", "--poll-interval", "1e300"),
    ("run_lease_worker", "--grace-period", "1e300"),
    ("run_lease_worker", "--ttl", "nan"),
    ("run_lease_worker", "--concurrency", "100000"),
    ("run_lease_worker", "--max-jobs", "1e3"),
    ("watch_stuck_jobs", "--interval", "1e300"),
    ("watch_stuck_jobs", "--batch-size", "1000000"),
    ("prune_jobs", "--older-than", "1e300"),
]


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("command", "flag", "value"), BAD_FLAGS)
def test_command_flags__out_of_range_exit_1_with_one_line_before_any_claim(
    processes: Processes, command: str, flag: str, value: str
) -> None:
    job = jobs.enqueue("noop")
    done = jobs.enqueue("noop")
    jobs.filter(pk=done.pk).update(status="completed", completed_at=Now() - timedelta(days=400))
    before = state()
    extra = ["--burst"] if command == "run_lease_worker" else []
    proc = processes.manage(command, *extra, flag, value)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, out
    assert out.startswith(f"CommandError: {command}: argument {flag}: {value!r} "), out
    assert len(out.strip().splitlines()) == 1, out
    assert state() == before
    assert jobs.get(pk=job.pk).attempts == 0
