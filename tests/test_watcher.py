"""The stuck watcher: real worker and watcher processes, and its policy in-process."""

import contextlib
import json
import os
import signal
import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_leases.models import JobAttempt, PaymentJob, Worker
from django_leases.watcher import StuckWatcher

from .conftest import (
    ON_SQLITE,
    Processes,
    database_url,
    finish,
    free_port,
    read_until,
    subprocess_env,
    wait_for,
)
from .leasing import token_of
from .test_network import Output
from .testapp.models import Charge

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

Status = PaymentJob.Status
REVIEW_SETTINGS = {"STUCK_POLICY_BY_KIND": {"risky": "review", "risky_reconciled": "review"}}


def fresh(job: PaymentJob) -> PaymentJob:
    return PaymentJob.objects.get(pk=job.pk)


def ledger(job: PaymentJob) -> list[tuple[int, str, str]]:
    return list(
        JobAttempt.objects.filter(job_ref=job.pk)
        .order_by("token")
        .values_list("attempt", "owner", "outcome")  # in token order: tokens rise with attempts
    )


def expire_all() -> None:
    PaymentJob.objects.filter(status=Status.PROCESSING).update(
        lease_until=Now() - timedelta(seconds=5)
    )


def worker(processes: Processes, name: str, *args: str, env: dict | None = None):
    return processes.manage(
        "run_lease_worker", "--worker-id", name, "--poll-interval", "0.1", *args, env=env
    )


def watcher(processes: Processes, *args: str, env: dict | None = None):
    return processes.manage("watch_stuck_jobs", *args, env=env)


def test_watcher__sigkilled_workers_job_is_back_within_ttl_and_interval(
    processes: Processes,
) -> None:
    job = PaymentJob.objects.enqueue("sleep", {"durations": [60, 0]})
    victim = worker(processes, "victim", "--ttl", "2", "--heartbeat", "0.5", "--kind", "sleep")
    wait_for(lambda: fresh(job).lease_owner == "victim")
    os.killpg(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    watcher(processes, "--interval", "0.5", "--watcher-id", "w-1")

    wait_for(lambda: fresh(job).status == Status.PENDING, timeout=30)
    rescued_after = time.monotonic() - killed_at
    job = fresh(job)
    assert job.attempts == 1, "a rescue is not an attempt"
    assert ledger(job) == [(1, "victim", "rescued")]
    assert JobAttempt.objects.get(job_ref=job.pk).ended_by == "w-1"
    # TTL 2 s + interval 0.5 s (+ jitter); the generous bound only guards against "never".
    assert rescued_after < 20

    worker(processes, "fresh", "--ttl", "2", "--heartbeat", "0.5", "--kind", "sleep")
    wait_for(lambda: fresh(job).status == Status.COMPLETED, timeout=30)
    job = fresh(job)
    assert (job.attempts, job.lease_owner) == (2, "fresh")
    assert ledger(job) == [(1, "victim", "rescued"), (2, "fresh", "completed")]


def test_watcher__two_watchers_rescue_each_of_a_thousand_jobs_once(processes: Processes) -> None:
    PaymentJob.objects.bulk_create(PaymentJob(kind="noop") for _ in range(1000))
    assert len(PaymentJob.objects.claim("dead", ttl=60, limit=1000)) == 1000
    expire_all()

    procs = [
        watcher(processes, "--once", "--batch-size", "2000", "--watcher-id", f"race-{n}")
        for n in range(2)
    ]
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]

    assert [proc.returncode for proc in procs] == [0, 0], outputs
    printed = [line for out in outputs for line in out.splitlines() if "action=retry" in line]
    assert len(printed) == 1000
    assert PaymentJob.objects.filter(status=Status.PENDING, attempts=1).count() == 1000
    rescues = Counter(
        JobAttempt.objects.filter(outcome="rescued").values_list("job_ref", flat=True)
    )
    assert len(rescues) == 1000 and set(rescues.values()) == {1}
    by_watcher = Counter(JobAttempt.objects.values_list("ended_by", flat=True))
    assert sum(by_watcher.values()) == 1000 and set(by_watcher) <= {"race-0", "race-1"}


def test_watcher__never_flips_back_a_job_completed_after_its_read() -> None:
    PaymentJob.objects.enqueue("noop")
    (job,) = PaymentJob.objects.claim("late", ttl=60)
    expire_all()
    stale = PaymentJob.objects.expired().get()
    # The late holder completes between the watcher's read and its write.
    PaymentJob.objects.complete(job.pk, "late", job.lease_token)
    assert PaymentJob.objects.rescue(stale, "retry", by="watcher") is False
    assert StuckWatcher().run_once() == []
    assert fresh(job).status == Status.COMPLETED
    assert ledger(job) == [(1, "late", "completed")]


def test_watcher__leaves_healthy_and_renewed_leases_alone() -> None:
    PaymentJob.objects.enqueue("noop")
    PaymentJob.objects.enqueue("noop")
    live, renewed = PaymentJob.objects.claim("alive", ttl=60, limit=2)
    PaymentJob.objects.filter(pk=renewed.pk).update(lease_until=Now() - timedelta(seconds=1))
    stale = PaymentJob.objects.expired().get()
    # Renewed by its holder after the watcher read it (as a heartbeat in flight would).
    PaymentJob.objects.filter(pk=renewed.pk).update(lease_until=Now() + timedelta(seconds=60))
    assert PaymentJob.objects.rescue(stale, "retry", by="watcher") is False
    assert StuckWatcher().run_once() == []
    assert PaymentJob.objects.filter(status=Status.PROCESSING).count() == 2


def test_watcher__fails_jobs_that_used_their_last_attempt() -> None:
    PaymentJob.objects.enqueue("noop", max_attempts=1)
    (job,) = PaymentJob.objects.claim("w", ttl=60)
    expire_all()
    (action,) = StuckWatcher(watcher_id="wx").run_once()
    job = fresh(job)
    assert (action.action, job.status) == ("failed", Status.FAILED)
    assert "no attempts left" in job.last_error and "attempt 1 of 1" in job.last_error
    assert ledger(job) == [(1, "w", "failed")]


@override_settings(DJANGO_LEASES=REVIEW_SETTINGS)
def test_watcher__review_policy_holds_a_job_past_its_risky_checkpoint(
    processes: Processes,
) -> None:
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(REVIEW_SETTINGS))
    risky = PaymentJob.objects.enqueue("risky", {"durations": [60, 0]})
    safe = PaymentJob.objects.enqueue("sleep", {"durations": [60, 0]})
    victim = worker(
        processes, "victim", "--ttl", "2", "--heartbeat", "0.5", "--concurrency", "2", env=env
    )
    wait_for(lambda: fresh(risky).checkpoint == "psp_called" and fresh(safe).attempts == 1)
    os.killpg(victim.pid, signal.SIGKILL)
    # A worker polling both kinds, and a watcher: the risky job is never re-run blindly.
    worker(processes, "poller", "--ttl", "2", "--heartbeat", "0.5", env=env)
    watcher(processes, "--interval", "0.3", env=env)

    wait_for(lambda: fresh(risky).status == Status.REVIEW, timeout=30)
    wait_for(lambda: fresh(safe).status == Status.COMPLETED, timeout=30)
    risky = fresh(risky)
    assert risky.attempts == 1
    assert "after checkpoint 'psp_called'" in risky.last_error
    assert ledger(risky) == [(1, "victim", "review")]
    assert PaymentJob.objects.filter(status=Status.REVIEW).get().pk == risky.pk


@override_settings(DJANGO_LEASES=REVIEW_SETTINGS)
@pytest.mark.parametrize(
    ("verdict", "status"), [("completed", "completed"), ("failed", "failed"), ("retry", "pending")]
)
def test_watcher__reconcile_hook_resolves_a_job_under_review(verdict: str, status: str) -> None:
    job = PaymentJob.objects.enqueue("risky_reconciled", {"psp_says": verdict}, max_attempts=1)
    (claimed,) = PaymentJob.objects.claim("victim", ttl=60)
    PaymentJob.objects.checkpoint(claimed.pk, "victim", claimed.lease_token, "psp_called")
    expire_all()

    actions = StuckWatcher(watcher_id="wx").run_once()

    assert [a.action for a in actions] == ["review", f"reconciled-{verdict}"]
    job = fresh(job)
    assert job.status == status
    assert ledger(job) == [(1, "victim", "review")]
    if verdict == "retry":
        assert job.max_attempts == 2 and PaymentJob.objects.claimable().filter(pk=job.pk).exists()


@override_settings(DJANGO_LEASES=REVIEW_SETTINGS)
def test_claim__does_not_take_over_a_job_the_review_policy_holds() -> None:
    PaymentJob.objects.enqueue("risky")
    PaymentJob.objects.enqueue("risky")
    held, fresh_one = PaymentJob.objects.claim("victim", ttl=60, limit=2)
    PaymentJob.objects.checkpoint(held.pk, "victim", held.lease_token, "psp_called")
    expire_all()
    taken = PaymentJob.objects.claim("poller", ttl=60, limit=5)
    assert [job.pk for job in taken] == [fresh_one.pk]
    assert PaymentJob.objects.claim_job(held.pk, "poller", ttl=60) is None


def test_watcher__rescues_early_when_the_owner_is_known_gone(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("sleep", {"durations": [60, 0]})
    proc = worker(
        processes, "leaver", "--ttl", "600", "--heartbeat", "5", "--grace-period", "0.2", "-v", "2"
    )
    # Started, not only claimed: a job still queued for a slot is released at shutdown, and the
    # watcher would find nothing to rescue.
    read_until(proc, f"started job_id={job.pk} ", timeout=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert Worker.objects.get(worker_id="leaver").stopped_at is not None
    assert not PaymentJob.objects.expired().exists(), "the lease is still live by time"

    out = watcher(processes, "--once").communicate(timeout=60)[0]

    assert f"job_id={job.pk} kind=sleep previous_owner=leaver" in out
    assert fresh(job).status == Status.PENDING
    assert ledger(job) == [(1, "leaver", "rescued")]


def test_watch_stuck_jobs__says_who_it_is_and_what_it_watches_at_start(
    processes: Processes,
) -> None:
    """A long-running watcher's first line names it, its interval, model and database (it
    printed nothing until its first rescue); `--once`, for cron, stays quiet but for its
    summary."""
    proc = watcher(processes, "--watcher-id", "w-start", "--interval", "0.5")
    log = Output(proc)
    log.wait_for_line("watcher starting", timeout=60)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.finish()
    lines = log.finish().splitlines()
    assert lines[0].split(maxsplit=1)[1] == (
        "watcher starting watcher_id=w-start interval=0.5s model=django_leases.PaymentJob "
        "database=default"
    ), lines
    assert "watcher stopped: 0 job(s) acted on" in lines[-1], lines
    once = watcher(processes, "--once").communicate(timeout=60)[0]
    assert "watcher starting" not in once and "0 job(s) acted on" in once, once


def test_watch_stuck_jobs__once_prints_each_job_and_a_summary(processes: Processes) -> None:
    for _ in range(3):
        PaymentJob.objects.enqueue("noop")
    jobs = PaymentJob.objects.claim("gone-worker", ttl=60, limit=3)
    expire_all()
    proc = watcher(processes, "--once")
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    for job in jobs:
        assert (
            f"job_id={job.pk} kind=noop previous_owner=gone-worker attempts=1 token={token_of(job)}"
            in out
        )
    assert "3 job(s) acted on: retry=3" in out
    again = watcher(processes, "--once").communicate(timeout=60)[0]
    assert "0 job(s) acted on" in again


@pytest.mark.skipif(ON_SQLITE, reason="SQLite is a file: it has no server to be down")
def test_watch_stuck_jobs__once_exits_1_when_the_database_is_down(processes: Processes) -> None:
    down = subprocess_env(DATABASE_URL=database_url(port=free_port()))
    proc = watcher(processes, "--once", env=down)
    out = finish(proc)
    assert proc.returncode == 1, out
    assert out.startswith("CommandError: database unavailable: "), out
    assert out.rstrip().endswith("the pass did not run"), out
    assert len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--interval", "0"], "must be a positive number of seconds"),
        (["--interval", "soon"], "is not a number of seconds"),
        (["--batch-size", "-1"], "must be from 1 to 10000"),
    ],
)
def test_watch_stuck_jobs__bad_flags_fail_cleanly(
    processes: Processes, args: list[str], message: str
) -> None:
    proc = watcher(processes, *args)
    out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 1
    assert message in out and "Traceback" not in out


def test_watcher__sigkilled_workers_job_runs_on_a_burst_worker_right_after_the_rescue(
    processes: Processes,
) -> None:
    job = PaymentJob.objects.enqueue("sleep", {"durations": [60, 0]})
    victim = worker(processes, "victim", "--ttl", "1", "--heartbeat", "0.3", "--kind", "sleep")
    wait_for(lambda: fresh(job).lease_owner == "victim")
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    wait_for(lambda: PaymentJob.objects.expired().filter(pk=job.pk).exists())

    rescue = watcher(processes, "--once", "--watcher-id", "cron")
    out = rescue.communicate(timeout=60)[0]
    assert rescue.returncode == 0, out
    assert f"job_id={job.pk} kind=sleep previous_owner=victim" in out
    # Due again at once: a burst worker started now finds it claimable.
    assert PaymentJob.objects.claimable().filter(pk=job.pk).exists()
    burst = worker(processes, "burst", "--burst", "--ttl", "5", "--heartbeat", "1")
    out = burst.communicate(timeout=120)[0]

    assert burst.returncode == 0, out
    job = fresh(job)
    assert (job.status, job.attempts, job.lease_owner) == (Status.COMPLETED, 2, "burst")
    assert ledger(job) == [(1, "victim", "rescued"), (2, "burst", "completed")]


def test_watcher__asks_for_orphans_with_a_registry_subquery_not_a_list_of_ids() -> None:
    Worker.objects.bulk_create(
        Worker(worker_id=f"gone-{n}", hostname="h", pid=n + 1, stopped_at=Now()) for n in range(300)
    )
    PaymentJob.objects.enqueue("noop")
    PaymentJob.objects.enqueue("noop")
    orphan, live = PaymentJob.objects.claim("gone-7", ttl=600, limit=2)
    PaymentJob.objects.filter(pk=live.pk).update(lease_owner="alive-1")

    with CaptureQueriesContext(connection) as ctx:
        actions = StuckWatcher(watcher_id="w-1").run_once()

    assert [(a.pk, a.previous_owner, a.action) for a in actions] == [(orphan.pk, "gone-7", "retry")]
    assert fresh(orphan).status == Status.PENDING
    assert fresh(live).status == Status.PROCESSING
    sql = "\n".join(q["sql"] for q in ctx.captured_queries)
    assert "gone-123" not in sql and "gone-299" not in sql
    assert Worker._meta.db_table in sql


def under_review(kind: str, n: int, payload: dict | None = None) -> list[int]:
    """Enqueue `n` jobs of `kind` and hold them for review, as the watcher would after a
    checkpoint; return their ids."""
    jobs = PaymentJob.objects.enqueue_many(kind, [payload or {}] * n)
    pks = [job.pk for job in jobs]
    PaymentJob.objects.filter(pk__in=pks).update(
        status=Status.REVIEW, attempts=1, lease_owner="victim", lease_token=1
    )
    return pks


def drain(proc) -> None:
    """Read the process's output on a thread, so that a chatty process never blocks on a full
    pipe (the test reads the database, not the output)."""
    fd = proc.stdout.fileno()

    def read() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 1 << 16):
                pass

    threading.Thread(target=read, daemon=True).start()


HOOK_SETTINGS = {"RECONCILE_TIMEOUT": 0.5}


def test_watch_stuck_jobs__once_returns_while_a_reconcile_hook_hangs(
    processes: Processes,
) -> None:
    (hanging,) = under_review("risky_hanging", 1)
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(HOOK_SETTINGS))

    out = finish(watcher(processes, "--once", "-v", "2", env=env), timeout=30)

    assert f"ran past its deadline (0.5s) for job_id={hanging}" in out, out
    assert "0 job(s) acted on" in out, out
    assert fresh(PaymentJob(pk=hanging)).status == Status.REVIEW


def test_watcher__rescues_while_a_reconcile_hook_hangs(processes: Processes) -> None:
    (hanging,) = under_review("risky_hanging", 1)
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(HOOK_SETTINGS))
    watcher(processes, "--interval", "0.2", env=env)
    wait_for(lambda: Charge.objects.filter(job_ref=hanging).exists())  # the hook hangs now
    job = PaymentJob.objects.enqueue("sleep")
    PaymentJob.objects.claim("victim", ttl=60)
    expire_all()

    wait_for(lambda: fresh(job).status == Status.PENDING, timeout=20)
    assert ledger(job) == [(1, "victim", "rescued")]


def test_watcher__reconciles_each_job_under_review_in_turn_whatever_the_others_hooks_do(
    processes: Processes,
) -> None:
    under_review("risky_refused", 520)
    good = under_review("risky_reconciled", 5, {"psp_says": "completed"})
    proc = watcher(processes, "--interval", "0.1")
    drain(proc)

    wait_for(
        lambda: PaymentJob.objects.filter(pk__in=good, status=Status.COMPLETED).count() == 5,
        timeout=60,
    )
    assert PaymentJob.objects.filter(kind="risky_refused", status=Status.REVIEW).count() == 520


def test_watch_stuck_jobs__records_each_pass_in_the_registry(processes: Processes) -> None:
    proc = watcher(processes, "--interval", "0.2", "--watcher-id", "w1")
    wait_for(lambda: Worker.objects.filter(worker_id="w1", last_pass__isnull=False).exists())
    row = Worker.objects.get(worker_id="w1")
    assert (row.role, row.heartbeat, row.stopped_at, row.last_pass) == ("watcher", 0.2, None, {})
    job = PaymentJob.objects.enqueue("sleep")
    PaymentJob.objects.claim("victim", ttl=60)
    expire_all()
    wait_for(lambda: Worker.objects.get(worker_id="w1").last_pass == {"retry": 1})
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert Worker.objects.get(worker_id="w1").stopped_at is not None
    assert fresh(job).status == Status.PENDING

    out = finish(watcher(processes, "--once", "--watcher-id", "cron"), timeout=30)
    row = Worker.objects.get(worker_id="cron")
    assert (row.heartbeat, row.last_pass) == (None, {}), out
    assert row.stopped_at is not None and row.last_pass_at is not None


def test_run_once__ends_a_stopped_execution_only_once_its_lease_expired() -> None:
    """A job stopped (cancelled, timed out) while its handler ran, whose holder never said its
    handler returned: it keeps its lock until its lease expires, then the watcher ends it as
    its stop said and passes the lock on."""
    from .leasing import claim_one, expire

    cancelled = PaymentJob.objects.enqueue("a", lock="account:1")
    behind = PaymentJob.objects.enqueue("a", lock="account:1")
    timed_out = PaymentJob.objects.enqueue("b", max_attempts=1)
    held = claim_one("dead")
    PaymentJob.objects.filter(pk=held.pk).cancel(by="ops")
    slow = claim_one("dead")
    assert slow.pk == timed_out.pk
    PaymentJob.objects.time_out(
        slow.pk, "dead", slow.lease_token, retry_in=None, reason="slow", running=True
    )
    assert StuckWatcher().run_once() == []
    assert PaymentJob.objects.get(pk=behind.pk).status == "waiting"

    expire(held)
    expire(slow)
    actions = StuckWatcher().run_once()
    assert sorted((a.pk, a.previous_owner, a.action) for a in actions) == [
        (cancelled.pk, "dead", "stopped-cancelled"),
        (timed_out.pk, "dead", "stopped-failed"),
    ]
    statuses = dict(PaymentJob.objects.values_list("pk", "status"))
    assert statuses == {cancelled.pk: "cancelled", behind.pk: "pending", timed_out.pk: "failed"}
    ended = JobAttempt.objects.filter(job_ref__in=[cancelled.pk, timed_out.pk]).order_by("job_ref")
    assert [(row.outcome, row.ended_by, row.ended_at is not None) for row in ended] == [
        ("cancelled", "ops", True),
        ("timed_out", "dead", True),
    ]
    assert StuckWatcher().run_once() == []
