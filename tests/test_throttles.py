"""Limits per kind across every worker: `@job_handler(kind, limit=N, rate=(N, seconds))`."""

import os
import signal
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import DatabaseError, connection, connections
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from django_leases import job_handler
from django_leases.exceptions import HandlerError
from django_leases.handlers import get_handler, unregister
from django_leases.models import JobAttempt, KindGate, KindStart, PaymentJob, Worker
from django_leases.querysets.claims import failures_of
from django_leases.querysets.throttles import GATE_IDLE, STALE_STARTS, claim_throttled
from django_leases.status import COMPLETED, FAILED, PENDING, PROCESSING
from django_leases.throttles import Throttle
from tests import throttled
from tests.conftest import Processes, finish, read_until, subprocess_env, wait_for
from tests.leasing import expire, statements
from tests.testapp.models import LockRun
from tests.throttled import (
    CAPPED,
    CAPPED_LIMIT,
    RATED,
    RATED_RATE,
    SPANNED,
    SPANNED_LIMIT,
    SPANNED_UNTIMED,
    held_gate,
)

KIND = "test_throttles_kind"


def plain(job: Any, lease: Any) -> None:
    return None


@pytest.fixture
def kinds() -> Iterator[None]:
    """The throttled kinds of `tests.throttled`, registered in this process for one test."""
    throttled.register()
    yield
    throttled.unregister()


@pytest.fixture
def kind() -> Iterator[str]:
    yield KIND
    unregister(KIND)


# ---- the options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"limit": 0}, "limit must be a whole number from 1 to 1000000, got 0"),
        ({"limit": -1}, "limit must be a whole number from 1 to 1000000, got -1"),
        ({"limit": 1.5}, "limit must be a whole number from 1 to 1000000, got 1.5"),
        ({"limit": True}, "limit must be a whole number from 1 to 1000000, got True"),
        ({"limit": "2"}, "limit must be a whole number from 1 to 1000000, got '2'"),
        ({"rate": (0, 1)}, "rate's job count must be a whole number from 1 to 1000000, got 0"),
        ({"rate": (5, 0)}, "rate's window must be a positive number of seconds"),
        ({"rate": (5, -1)}, "rate's window must be a positive number of seconds"),
        ({"rate": (5, "1")}, "rate's window must be a positive number of seconds"),
        ({"rate": "x"}, r"rate must be a pair \(jobs, seconds\), e.g. \(10, 1\), got 'x'"),
        ({"rate": (5,)}, r"rate must be a pair \(jobs, seconds\), e.g. \(10, 1\), got \(5,\)"),
        ({"rate": 5}, r"rate must be a pair \(jobs, seconds\), e.g. \(10, 1\), got 5"),
    ],
)
def test_job_handler__refuses_a_bad_limit_or_rate(
    kind: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(HandlerError, match=f"job kind {kind!r}: {message}"):
        job_handler(kind, **options)(plain)
    with pytest.raises(HandlerError, match="no handler is registered"):
        get_handler(kind)


def test_job_handler__keeps_the_limit_and_the_rate(kind: str) -> None:
    job_handler(kind, limit=3, rate=(10, timedelta(minutes=1)))(plain)
    throttle = get_handler(kind).throttle
    assert throttle == Throttle(limit=3, rate=(10, 60.0))
    assert throttle.describe() == "3 at once, 10 per 60s"
    job_handler(kind)(plain)  # registered again without: no throttle left
    assert get_handler(kind).throttle is None


# ---- limit= -----------------------------------------------------------------------------------


def enqueue(kind: str, count: int) -> list[PaymentJob]:
    return [PaymentJob.objects.enqueue(kind) for _ in range(count)]


def live(kind: str) -> int:
    jobs = PaymentJob.objects.filter(kind=kind, status=PROCESSING, lease_until__gte=Now())
    return jobs.count()


@pytest.mark.django_db
def test_claim__never_takes_a_kind_past_its_limit(kinds: None) -> None:
    jobs = enqueue(CAPPED, 5)
    first = PaymentJob.objects.claim("w1", ttl=60, limit=10, kinds=[CAPPED])
    assert [job.pk for job in first] == [job.pk for job in jobs[:CAPPED_LIMIT]]
    assert PaymentJob.objects.claim("w2", ttl=60, limit=10, kinds=[CAPPED]) == []
    assert PaymentJob.objects.claim_job(jobs[4].pk, "w2", ttl=60) is None
    # A completion frees its slot.
    PaymentJob.objects.complete(first[0].pk, "w1", first[0].lease_token)
    (again,) = PaymentJob.objects.claim("w2", ttl=60, limit=10, kinds=[CAPPED])
    assert again.pk == jobs[2].pk
    assert live(CAPPED) == CAPPED_LIMIT


@pytest.mark.django_db
def test_claim__an_expired_lease_frees_its_slot_and_its_takeover_takes_one(kinds: None) -> None:
    jobs = enqueue(CAPPED, 4)
    dead, running = PaymentJob.objects.claim("dead", ttl=60, limit=2, kinds=[CAPPED])
    expire(dead)
    # The dead holder's slot is free; the claim takes its expired lease first, and that is
    # the one slot there was.
    (taken,) = PaymentJob.objects.claim("w2", ttl=60, limit=10, kinds=[CAPPED])
    assert (taken.pk, taken.attempts) == (dead.pk, 2)
    assert PaymentJob.objects.claim("w3", ttl=60, limit=10, kinds=[CAPPED]) == []
    assert live(CAPPED) == CAPPED_LIMIT
    assert PaymentJob.objects.filter(pk__in=[j.pk for j in jobs[2:]], status="pending").count() == 2


@pytest.mark.django_db
def test_claim__throttled_kinds_first_then_the_others_and_every_kind_is_gated(
    kinds: None,
) -> None:
    capped = enqueue(CAPPED, 3)
    other = enqueue("noop", 3)
    claimed = PaymentJob.objects.claim("w1", ttl=60, limit=4, kinds=["noop", CAPPED])
    assert [job.pk for job in claimed] == [*(j.pk for j in capped[:2]), *(j.pk for j in other[:2])]
    # Every kind (None): still none of the capped kind past its limit.
    claimed = PaymentJob.objects.claim("w2", ttl=60, limit=10)
    assert [job.pk for job in claimed] == [other[2].pk]
    assert live(CAPPED) == CAPPED_LIMIT


@pytest.mark.django_db
def test_claim__of_unthrottled_kinds_never_reads_the_gates(kinds: None) -> None:
    enqueue("noop", 2)
    enqueue(CAPPED, 1)
    gates = KindGate._meta.db_table
    with CaptureQueriesContext(connection) as ctx:
        claimed = PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=["noop"])
        PaymentJob.objects.complete_and_claim("w1", [], ttl=60, kinds=["noop"])
    assert len(claimed) == 2
    assert not [sql for sql in statements(ctx) if gates in sql]
    with CaptureQueriesContext(connection) as ctx:
        assert len(PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=[CAPPED])) == 1
    assert [sql for sql in statements(ctx) if gates in sql]


@pytest.mark.django_db
def test_complete_and_claim__completes_then_claims_within_the_limit(kinds: None) -> None:
    jobs = enqueue(CAPPED, 3)
    one, two = PaymentJob.objects.claim("w1", ttl=60, limit=2, kinds=[CAPPED])
    won, claimed = PaymentJob.objects.complete_and_claim(
        "w1", [(one.pk, one.lease_token)], ttl=60, limit=2, kinds=[CAPPED]
    )
    assert won == {(one.pk, one.lease_token)}
    assert [job.pk for job in claimed] == [jobs[2].pk]
    assert PaymentJob.objects.get(pk=one.pk).status == COMPLETED
    assert live(CAPPED) == CAPPED_LIMIT


# ---- rate= ------------------------------------------------------------------------------------


def age_starts(seconds: float) -> None:
    """Move every recorded start `seconds` into the past, by the database clock."""
    KindStart.objects.update(at=Now() - timedelta(seconds=seconds))


@pytest.mark.django_db
def test_claim__never_starts_more_than_the_rate_within_its_window(kind: str) -> None:
    job_handler(kind, rate=(3, 60))(plain)
    enqueue(kind, 8)
    assert len(PaymentJob.objects.claim("w1", ttl=60, limit=2, kinds=[kind])) == 2
    # Completing them frees nothing: they started within the window.
    for job in PaymentJob.objects.filter(status=PROCESSING):
        PaymentJob.objects.complete(job.pk, "w1", job.lease_token)
    assert len(PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=[kind])) == 1
    assert PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=[kind]) == []
    # A sliding window: 30 s later both claims are still in it, 61 s later neither.
    age_starts(30)
    assert PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=[kind]) == []
    age_starts(61)
    assert len(PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=[kind])) == 3
    # Rows past the window wait until STALE_STARTS of them do; then one claim deletes them.
    assert sorted(KindStart.objects.values_list("count", flat=True)) == [1, 2, 3]
    gate = KindGate.objects.get(kind=kind)
    KindStart.objects.bulk_create(
        KindStart(gate=gate, count=1, at=Now()) for _ in range(STALE_STARTS - 3)
    )
    age_starts(61)
    assert len(PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=[kind])) == 2
    assert list(KindStart.objects.values_list("count", flat=True)) == [2]


@pytest.mark.django_db
def test_claim__takes_the_tighter_of_limit_and_rate(kind: str) -> None:
    job_handler(kind, limit=2, rate=(3, 60))(plain)
    enqueue(kind, 6)
    claimed = PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=[kind])
    assert len(claimed) == 2  # the limit
    for job in claimed:
        PaymentJob.objects.complete(job.pk, "w1", job.lease_token)
    assert len(PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=[kind])) == 1  # the rate
    gate = KindGate.objects.get(kind=kind)
    assert (gate.job_model, gate.last_claim_at is not None) == ("django_leases.paymentjob", True)


# ---- across worker processes ------------------------------------------------------------------


def throttled_worker(processes: Processes, name: str, *args: str) -> Any:
    return processes.start(
        "-m", "tests.throttled", "--worker-id", name, "--poll-interval", "0.05", *args,
        env=subprocess_env(),
    )  # fmt: skip


def spans(kind: str, *, but: str = "") -> list[tuple[datetime, datetime]]:
    """Each attempt of `kind` (but those of the owner `but`) from its claim to its end, or to
    the end of its last lease if that came first (a killed holder's attempt ends only when
    someone takes the job over)."""
    pks = PaymentJob.objects.filter(kind=kind).values_list("pk", flat=True)
    rows = JobAttempt.objects.filter(job_ref__in=list(pks)).exclude(owner=but)
    found = []
    for claimed_at, ended_at, lease_until in rows.values_list(
        "claimed_at", "ended_at", "lease_until"
    ):
        ends = [end for end in (ended_at, lease_until) if end is not None]
        found.append((claimed_at, min(ends)))
    return found


def most_at_once(intervals: list[tuple[datetime, datetime]]) -> int:
    """The largest number of `intervals` that overlap at one moment."""
    # An end sorts before a start at the same moment: a slot freed and taken at once.
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def finished(kind: str, count: int) -> bool:
    return PaymentJob.objects.filter(kind=kind, status=COMPLETED).count() == count


# Serial: it needs its racers to start together, which a machine busy with other tests may
# not give. Each racer runs one job at a time, so the limit reached among the racers is two
# workers running at once: one racer with free slots could take every job (it once did, with
# three slots each, and the test could not tell a limit kept across workers from one kept in
# one process).
@pytest.mark.serial
@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__never_run_more_than_the_limit_at_once_even_past_a_killed_holder(
    processes: Processes,
) -> None:
    victim_job = PaymentJob.objects.enqueue(CAPPED, {"durations": [60, 0.1]})
    victim = throttled_worker(processes, "victim", "--ttl", "2", "--heartbeat", "0.5")
    wait_for(lambda: PaymentJob.objects.filter(pk=victim_job.pk, status=PROCESSING).exists())
    racers = [f"racer-{n}" for n in range(3)]
    for name in racers:
        throttled_worker(processes, name, "--ttl", "2", "--heartbeat", "0.5", "--concurrency", "1")
    # Every racer is up (registered) before the jobs come: they race from the first one.
    wait_for(lambda: Worker.objects.filter(worker_id__in=racers).count() == len(racers))
    jobs = [victim_job]
    # More work than one slot gets through before the victim's lease runs out (2 s after the
    # kill): the two slots are raced for after it.
    for _ in range(30):
        jobs.append(PaymentJob.objects.enqueue(CAPPED, {"seconds": 0.15}))
    # The victim holds one slot; kill it while the others race for the second.
    wait_for(lambda: PaymentJob.objects.filter(kind=CAPPED, status=COMPLETED).count() >= 3)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)

    wait_for(lambda: finished(CAPPED, len(jobs)), timeout=120)

    assert most_at_once(spans(CAPPED)) <= CAPPED_LIMIT
    # The limit was reached by two racers at once, and the killed holder's job ran again.
    assert most_at_once(spans(CAPPED, but="victim")) == CAPPED_LIMIT
    outcomes = JobAttempt.objects.filter(job_ref=victim_job.pk).order_by("token")
    assert [(a.owner == "victim", a.outcome) for a in outcomes] == [
        (True, "lease_lost"),
        (False, "completed"),
    ]
    owners = set(JobAttempt.objects.exclude(owner="victim").values_list("owner", flat=True))
    assert len(owners) > 1, owners


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__never_start_more_than_the_rate_within_any_window(processes: Processes) -> None:
    count, window = RATED_RATE
    racers = [f"racer-{n}" for n in range(3)]
    for name in racers:
        throttled_worker(processes, name, "--concurrency", "2")
    wait_for(lambda: Worker.objects.filter(worker_id__in=racers).count() == len(racers))
    jobs = enqueue(RATED, 10)

    wait_for(lambda: finished(RATED, len(jobs)), timeout=120)

    starts = sorted(
        JobAttempt.objects.filter(job_ref__in=[j.pk for j in jobs]).values_list(
            "claimed_at", flat=True
        )
    )
    assert len(starts) == len(jobs)
    span = timedelta(seconds=window)
    busiest = max(sum(1 for t in starts if first <= t < first + span) for first in starts)
    assert busiest == count
    # Ten starts at three per second need three windows after the first.
    assert starts[-1] - starts[0] >= 3 * span


# ---- a gate held by a stalled session ---------------------------------------------------------

needs_row_locks = pytest.mark.skipif(
    connection.vendor == "sqlite", reason="SQLite's one writer holds every gate at once"
)


def lock_wait(seconds: int) -> str:
    """Bound this connection's lock waits by `seconds` (as a worker's statement timeout does);
    return the statement that lifts the bound."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"SET statement_timeout = {seconds * 1000}")
            return "SET statement_timeout = 0"
        cursor.execute(f"SET SESSION innodb_lock_wait_timeout = {seconds}")
        return "SET SESSION innodb_lock_wait_timeout = DEFAULT"


@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_claim__hands_out_what_it_committed_when_a_later_gate_is_held(kinds: None) -> None:
    capped, rated, plain = enqueue(CAPPED, 2), enqueue(RATED, 2), enqueue("noop", 2)
    # Before the fix the claim waited for the held gate until this bound, then raised with the
    # capped jobs committed.
    lift = lock_wait(3)
    try:
        with held_gate(RATED) as holder:
            claimed = PaymentJob.objects.claim("w1", ttl=60, limit=10)
        with connection.cursor() as cursor:
            if connection.vendor == "mysql":  # the session's own lock wait, given back
                cursor.execute("SELECT @@SESSION.innodb_lock_wait_timeout")
                assert cursor.fetchone()[0] == 3
    finally:
        with connection.cursor() as cursor:
            cursor.execute(lift)
    # The capped kind's part committed before the rated kind's gate was found held; the
    # unthrottled kinds were claimed after it.
    assert sorted(job.pk for job in claimed) == sorted(job.pk for job in [*capped, *plain])
    held = PaymentJob.objects.filter(status=PROCESSING, lease_owner="w1")
    assert sorted(held.values_list("pk", flat=True)) == sorted(job.pk for job in claimed)
    rows = PaymentJob.objects.filter(pk__in=[job.pk for job in rated])
    assert set(rows.values_list("status", "attempts")) == {(PENDING, 0)}
    (failure,) = failures_of(claimed)
    assert failure.kind == RATED
    assert failure.holders is not None and holder in failure.holders


@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_claim_throttled__a_session_frozen_holding_its_gate_is_closed_by_the_server(
    kinds: None,
) -> None:
    enqueue(CAPPED, 1)
    KindGate.objects.create(job_model="django_leases.paymentjob", kind=CAPPED)
    frozen, done = threading.Event(), threading.Event()
    errors: list[DatabaseError] = []

    def freeze(room: int) -> list[PaymentJob]:
        frozen.set()  # the gate is locked: its client stops answering
        done.wait(timeout=GATE_IDLE + 20)
        return []

    def claim() -> None:
        try:
            throttle = get_handler(CAPPED).throttle
            assert throttle is not None
            claim_throttled(PaymentJob.objects.all(), CAPPED, throttle, 1, freeze)
        except DatabaseError as exc:
            errors.append(exc)
        finally:
            connections.close_all()

    claimer = threading.Thread(target=claim)
    claimer.start()
    try:
        assert frozen.wait(timeout=10)
        # Waits up to twice the idle bound for the frozen session's gate: before the fix the
        # gate stayed held as long as its client was frozen, and this wait failed.
        lift = lock_wait(round(GATE_IDLE * 2))
        try:
            assert KindGate.objects.filter(kind=CAPPED).update(last_claim_at=Now()) == 1
        finally:
            with connection.cursor() as cursor:
                cursor.execute(lift)
        assert not done.is_set() and claimer.is_alive()  # its client is still frozen
    finally:
        done.set()
        claimer.join(timeout=30)
    assert len(errors) == 1, errors  # the server closed the frozen session: nothing committed
    assert PaymentJob.objects.filter(kind=CAPPED, status=PENDING, attempts=0).count() == 1


# The case: the worker claims a limited kind, then finds the next kind's gate held by a
# stalled session. Before the fix the claim raised after the limited kind's jobs committed, so
# they were never run: they ran out of attempts unrun, and the plain kind's jobs never ran.
@needs_row_locks
@pytest.mark.django_db(transaction=True)
def test_worker__runs_every_job_it_claimed_and_the_other_kinds_while_a_gate_is_held(
    processes: Processes,
) -> None:
    capped = [
        PaymentJob.objects.enqueue(CAPPED, {"seconds": 0.05}, max_attempts=3) for _ in range(3)
    ]
    rated = enqueue(RATED, 3)
    plain = enqueue("noop", 5)
    with held_gate(RATED) as holder:
        worker = throttled_worker(
            processes, "w1", "--kind", CAPPED, RATED, "noop", "--ttl", "4", "--heartbeat", "1"
        )
        wait_for(lambda: finished(CAPPED, len(capped)) and finished("noop", len(plain)))
        logged = read_until(worker, f"claim skipped job kind {RATED}", holder)
        os.killpg(worker.pid, signal.SIGTERM)
        logged += finish(worker)
    assert "database unavailable" not in logged
    assert not PaymentJob.objects.filter(status=FAILED).exists()
    # Every capped job ran once, on its first attempt.
    attempts = JobAttempt.objects.filter(job_ref__in=[job.pk for job in capped])
    assert sorted(attempts.values_list("attempt", "outcome")) == [(1, "completed")] * 3
    rows = PaymentJob.objects.filter(pk__in=[job.pk for job in rated])
    assert set(rows.values_list("status", "attempts")) == {(PENDING, 0)}


def handler_spans(jobs: list[PaymentJob]) -> list[tuple[datetime, datetime]]:
    """Each handler run of `jobs` from its start to its return, as the handler recorded them."""
    runs = LockRun.objects.filter(job_ref__in=[job.pk for job in jobs])
    return list(runs.values_list("started_at", "finished_at"))


def all_returned(jobs: list[PaymentJob], runs: int) -> bool:
    ended = LockRun.objects.filter(job_ref__in=[job.pk for job in jobs], finished_at__isnull=False)
    return ended.count() >= runs


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__a_time_out_frees_its_slot_only_once_its_handler_returned(
    processes: Processes,
) -> None:
    # Each first attempt runs 2.5 s, past the kind's timeout of 1 s, ignoring it; a thread
    # cannot be stopped, so its slot is taken only once it returned.
    jobs = [
        PaymentJob.objects.enqueue(SPANNED, {"durations": [2.5, 0]}, max_attempts=2)
        for _ in range(2 * SPANNED_LIMIT)
    ]
    throttled_worker(processes, "w1", "--ttl", "5", "--heartbeat", "0.5", "--concurrency", "4")
    wait_for(lambda: finished(SPANNED, len(jobs)), timeout=90)

    assert all_returned(jobs, 2 * len(jobs))
    assert most_at_once(handler_spans(jobs)) == SPANNED_LIMIT
    outcomes = JobAttempt.objects.filter(job_ref__in=[job.pk for job in jobs])
    assert sorted(outcomes.values_list("outcome", flat=True)) == sorted(
        ["timed_out", "completed"] * len(jobs)
    )


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__a_cancel_frees_its_slot_only_once_its_handler_returned(
    processes: Processes,
) -> None:
    running = [PaymentJob.objects.enqueue(SPANNED_UNTIMED, {"seconds": 2}) for _ in range(2)]
    worker = throttled_worker(
        processes, "w1", "--ttl", "5", "--heartbeat", "0.2", "--concurrency", "3"
    )
    wait_for(lambda: LockRun.objects.filter(job_ref__in=[j.pk for j in running]).count() == 2)
    later = PaymentJob.objects.enqueue(SPANNED_UNTIMED, {"seconds": 0})
    assert PaymentJob.objects.filter(pk=running[0].pk).cancel(by="ops") == 1
    jobs = [*running, later]
    wait_for(lambda: all_returned(jobs, 3))

    assert most_at_once(handler_spans(jobs)) == SPANNED_LIMIT
    wait_for(lambda: PaymentJob.objects.get(pk=running[0].pk).status == "cancelled")
    worker.terminate()
