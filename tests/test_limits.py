"""Bad input gets a clear error naming the argument and its range, the same on every database,
and writes nothing; values at the bounds are stored and read back unchanged."""

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db.models.functions import Now
from django.test import override_settings

from django_leases import job_handler
from django_leases.backends import queue_problem
from django_leases.checks import check_settings
from django_leases.checks.schedules import check_schedules
from django_leases.exceptions import HandlerError, InvalidArgument, InvalidDuration, InvalidPayload
from django_leases.limits import (
    JSON_INT,
    LATEST_DATETIME,
    MAX_ATTEMPTS,
    MAX_DURATION,
    MAX_JSON_DEPTH,
    MIN_HEARTBEAT,
    MIN_POLL_INTERVAL,
    MIN_TTL,
    PRIORITY,
    duration_range,
)
from django_leases.models import JobAttempt, PaymentJob
from django_leases.worker import LeaseWorker

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
    ("kind empty", lambda: jobs.enqueue(""), InvalidArgument, "kind"),
    # A kind is logged as kind=<kind>: whitespace in it would split or forge a log line.
    ("kind blank", lambda: jobs.enqueue("   "), InvalidArgument, "kind"),
    ("kind newline", lambda: jobs.enqueue("noop\nkind=capture"), InvalidArgument, "kind"),
    ("kind space", lambda: jobs.enqueue("noop owner=w1"), InvalidArgument, "kind"),
    ("kind tab", lambda: jobs.enqueue("\tnoop"), InvalidArgument, "kind"),
    ("kind no-break space", lambda: jobs.enqueue("noop\u00a0"), InvalidArgument, "kind"),
    ("kind bidi override", lambda: jobs.enqueue("noop\u202e"), InvalidArgument, "kind"),
    ("kind escape", lambda: jobs.enqueue("noop\x1b[2K"), InvalidArgument, "kind"),
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
    (
        "claim kinds newline",
        lambda: jobs.claim("w", ttl=60, kinds=["noop\n"]),
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
    # Positive, yet below the lower bounds of limits.MIN_SECONDS.
    ("run_lease_worker", "--ttl", "1e-9"),
    ("run_lease_worker", "--ttl", "0.5"),
    ("run_lease_worker", "--heartbeat", "1e-9"),
    ("run_lease_worker", "--poll-interval", "1e-9"),
    ("run_lease_worker", "--grace-period", "-5"),
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


def handler_error(kind: str) -> str:
    with pytest.raises(HandlerError) as raised:
        job_handler(kind)
    return str(raised.value)


def raised_text(call: Callable[[], object]) -> str:
    with pytest.raises((ValueError, CommandError)) as raised:
        call()
    return str(raised.value)


def check_texts(**leases: Any) -> str:
    with override_settings(DJANGO_LEASES=leases):
        return " ".join(m.msg for m in [*check_settings(), *check_schedules()])


# (entry point, call) -> what it said about `kind`
KIND_ENTRY_POINTS: list[tuple[str, Callable[[str], str]]] = [
    ("enqueue", lambda kind: raised_text(lambda: jobs.enqueue(kind))),
    ("claim", lambda kind: raised_text(lambda: jobs.claim("w", ttl=60, kinds=[kind]))),
    ("job_handler", handler_error),
    ("LeaseWorker", lambda kind: raised_text(lambda: LeaseWorker(kinds=[kind]))),
    (
        "run_lease_worker --kind",
        lambda kind: raised_text(lambda: call_command("run_lease_worker", "--kind", kind)),
    ),
    ("SCHEDULES", lambda kind: check_texts(SCHEDULES={"s": {"kind": kind, "every": 60}})),
    ("TASKS queue", lambda kind: str(queue_problem(kind.removeprefix("tasks.")))),
]


@pytest.mark.parametrize("kind", ["tasks.a owner=w1", "tasks.a\nkind=capture", "tasks.a\u202eb"])
@pytest.mark.parametrize("entry", [pytest.param(call, id=name) for name, call in KIND_ENTRY_POINTS])
def test_kinds__whitespace_and_control_characters_refused_alike_everywhere(
    entry: Callable[[str], str], kind: str
) -> None:
    before = state()
    said = entry(kind)
    assert f"must not contain whitespace or control characters, got {kind!r}" in said, said
    assert "\n" not in said
    assert state() == before


# setting, option, LeaseWorker argument, its lower bound, settings a worker at that bound runs with
TIMINGS = [
    ("TTL", "--ttl", "ttl", MIN_TTL, {"HEARTBEAT": 0.3, "NEAR_EXPIRY": 0.5}),
    ("HEARTBEAT", "--heartbeat", "heartbeat", MIN_HEARTBEAT, {}),
    ("POLL_INTERVAL", "--poll-interval", "poll_interval", MIN_POLL_INTERVAL, {}),
]


@pytest.mark.parametrize(
    ("setting", "option", "argument", "minimum", "others"),
    TIMINGS,
    ids=[timing[0] for timing in TIMINGS],
)
def test_lease_timings__a_lower_bound_and_the_same_range_everywhere(
    setting: str, option: str, argument: str, minimum: float, others: dict[str, float]
) -> None:
    """Positive is not enough (1e-9 passed): `check`, the worker and the command refuse a
    timing below its bound with the same range, and all three take the bound itself."""
    bound = duration_range(minimum)
    assert bound == f"a number of seconds from {minimum:g} to {MAX_DURATION} (100 years)"
    for tiny in (1e-9, minimum * 0.999):
        said = {
            "check": check_texts(**others, **{setting: tiny}),
            "LeaseWorker": raised_text(lambda: LeaseWorker(**{argument: tiny})),  # noqa: B023
            option: raised_text(
                lambda: call_command("run_lease_worker", option, repr(tiny))  # noqa: B023
            ),
        }
        for entry, text in said.items():
            assert f"must be {bound}" in text, (entry, text)
        with override_settings(DJANGO_LEASES={**others, setting: tiny}):
            assert "django_leases.E002" in [m.id for m in check_settings()]

    with override_settings(DJANGO_LEASES={**others, setting: minimum}):
        assert check_settings() == []
        worker = LeaseWorker()
    timings = {"ttl": worker.ttl, "heartbeat": worker.heartbeat_interval}
    assert timings.get(argument, worker.poll_interval) == minimum
