"""`manage.py demo` end to end: real workers, a crash, a zombie, and the fake PSP's books, held
against the checkouts' recorded steps and the captures' dependents."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from django_leases.lease import step_key
from django_leases.models import JobAttempt, JobStep, PaymentJob, Worker
from example_project.payments import psp
from example_project.payments.models import FakePspCall, Followup, Payment

from .conftest import ROOT, Processes, finish, processes_marked, read_until, subprocess_env
from .ticking import tick_of

pytestmark = [
    pytest.mark.concurrency,
    pytest.mark.django_db(transaction=True, databases=["default", "psp"]),
]

KINDS = ["capture", "refund", "reconcile", "checkout", "webhook", "ledger"]
# example_project.settings puts captures under the review policy and schedules the reconcile
# sweep; the test settings take theirs from the environment.
DEMO_SETTINGS = {
    "STUCK_POLICY_BY_KIND": {"capture": "review"},
    "SCHEDULES": {"reconcile-sweep": {"kind": "reconcile_sweep", "every": 2}},
}


def demo(processes: Processes, *args: str, marker: str = "") -> subprocess.Popen[str]:
    env = subprocess_env(
        LEASES_TEST_SETTINGS=json.dumps(DEMO_SETTINGS), DEMO_TEST_MARKER=marker, COLUMNS="120"
    )
    return processes.manage("demo", *args, env=env)


def demo_processes(marker: str) -> list[int]:
    return processes_marked("DEMO_TEST_MARKER", marker)


def children_of_demo(proc: subprocess.Popen[str], marker: str, logs: Path) -> list[int]:
    """Wait until the demo's three children (two workers and the watcher) are alive; return
    their pids, or fail with their logs."""
    deadline = time.monotonic() + 10
    while True:
        children = [pid for pid in demo_processes(marker) if pid != proc.pid]
        if len(children) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    shown = {log.name: log.read_text()[-2000:] for log in sorted(logs.glob("*.log"))}
    assert len(children) == 3, (children, shown)
    return children


def summary_count(out: str, label: str) -> int:
    match = re.search(rf"^\s*{label}\s+(\d+)\b", out, re.MULTILINE)
    assert match, f"no {label!r} row in the summary:\n{out}"
    return int(match.group(1))


@pytest.mark.slow
def test_demo__settles_every_payment_without_a_double_charge(processes: Processes) -> None:
    proc = demo(processes, "--jobs", "40", "--workers", "2", "--timeout", "240")
    out = proc.communicate(timeout=300)[0]

    assert proc.returncode == 0, out
    assert "OK: every payment settled, double charges: 0." in out
    assert summary_count(out, "double charges") == 0
    assert summary_count(out, "before their capture") == 0
    assert summary_count(out, "step re-runs") == 0
    assert "SIGKILL demo-w1" in out
    # Its admin hint names the interpreter that ran it (a bare `python` lacks Django).
    assert f"{os.path.relpath(sys.executable, ROOT)} manage.py createsuperuser" in " ".join(
        out.split()
    )
    # The database agrees with the summary.
    jobs = PaymentJob.objects.filter(kind__in=KINDS)
    assert jobs.count() == 40
    # A dependent of a capture that failed is held (waiting) for an operator, nothing else.
    failed_ids = set(jobs.filter(status="failed").values_list("pk", flat=True))
    for waiting in jobs.filter(status="waiting"):
        assert set(waiting.waits_for) & failed_ids, waiting
    assert set(jobs.values_list("status", flat=True)) <= {"completed", "failed", "waiting"}
    assert summary_count(out, "jobs completed") == jobs.filter(status="completed").count()
    assert summary_count(out, "fenced-out attempts") == (
        JobAttempt.objects.filter(fenced_at__isnull=False).count()
    )
    audit = psp.audit(Payment.objects.all())
    assert (audit.duplicate_charges, audit.unrecorded_charges, audit.phantom_payments) == (0, 0, 0)
    # The pending payments (lost webhooks) were healed by the periodic sweep: one reconcile job
    # each, whatever the number of sweeps, and each sweep tick ran once.
    reconciles = jobs.filter(kind="reconcile")
    assert reconciles.count() == 3
    assert summary_count(out, "healed by the sweep") == 3
    healed = Payment.objects.filter(
        pk__in=[int(p) for p in reconciles.values_list("payment_id", flat=True)]
    )
    assert set(healed.values_list("status", flat=True)) == {"captured"}
    sweeps = PaymentJob.objects.filter(kind="reconcile_sweep").values_list("idempotency_key")
    ticks = sorted(tick_of(key) for (key,) in sweeps)
    assert ticks == list(range(ticks[0], ticks[0] + len(ticks))), ticks
    # Every payment is settled, or explained by its failed job (the PSP rejected the capture).
    failed = set(jobs.filter(status="failed").values_list("payment_id", flat=True))
    for payment in Payment.objects.all():
        assert payment.status in {"captured", "declined", "refunded", "expired"} or (
            payment.status in {"new", "authorized"} and str(payment.pk) in failed
        ), payment
    # Some payments had their refund enqueued after their capture; each refund was claimed
    # only once its capture had completed.
    paired = jobs.filter(
        kind="refund", payment_id__in=jobs.filter(kind="capture").values("payment_id")
    )
    assert paired.exists()
    for refund in paired:
        capture = jobs.get(kind="capture", payment_id=refund.payment_id)
        first = JobAttempt.objects.filter(job_ref=refund.pk).order_by("claimed_at").first()
        assert (refund.waits_for, refund.lock) == ([capture.pk], "")
        if capture.status == "completed":
            assert first is not None and first.claimed_at >= capture.completed_at, refund
        else:
            assert first is None, refund
    # Webhooks and ledger postings fanned out from their capture: each completed one wrote
    # one follow-up with its completion, and found its payment settled when it started.
    dependents = jobs.filter(kind__in=["webhook", "ledger"])
    assert dependents.count() == 4
    for job in dependents.filter(status="completed"):
        (follow_up,) = Followup.objects.filter(job_ref=job.pk)
        assert (follow_up.kind, str(follow_up.payment_id)) == (job.kind, job.payment_id)
        assert follow_up.payment_status in {"captured", "declined", "refunded"}, follow_up
    # Checkouts ran authorize -> capture -> notify as steps: each recorded once, and no PSP call
    # of a recorded step came from an attempt later than the one that recorded it.
    checkouts = jobs.filter(kind="checkout")
    assert checkouts.count() == 1
    for checkout in checkouts.filter(status="completed"):
        steps = JobStep.objects.filter(job_ref=checkout.pk).order_by("recorded_at", "pk")
        names = list(steps.values_list("name", flat=True))
        assert names in (["authorize"], ["authorize", "capture", "notify"]), names
        for step in steps.exclude(name="notify"):
            calls = FakePspCall.objects.filter(idempotency_key=step_key(checkout, step.name))
            attempts = [call.metadata["attempt"] for call in calls]
            assert attempts and max(attempts) <= step.attempt, (step, attempts)
    assert (
        summary_count(out, "checkout steps")
        == JobStep.objects.filter(job_ref__in=checkouts.values("pk")).count()
    )
    # No attempt is left open: the killed worker's were closed by the watcher or a takeover.
    assert not JobAttempt.objects.filter(ended_at__isnull=True).exists()
    assert (
        not JobAttempt.objects.filter(owner="demo-w1", outcome="completed")
        .exclude(ended_by="demo-w1")
        .exists()
    )


def test_demo__ctrl_c_leaves_no_process_behind(processes: Processes) -> None:
    marker = uuid.uuid4().hex
    proc = demo(processes, "--jobs", "300", "--workers", "2", marker=marker)
    seen = read_until(proc, "their logs are in", "leases-demo-", timeout=120)
    logs = Path(re.findall(r"their logs are in\s+(\S+)", seen)[-1])
    children_of_demo(proc, marker, logs)

    proc.send_signal(signal.SIGINT)
    out = finish(proc)

    assert proc.returncode == 130, out
    assert "interrupted by SIGINT: every worker and watcher was stopped" in out
    assert demo_processes(marker) == []
    # Each worker was stopped in order (SIGTERM: it marked itself stopped), unless the demo had
    # already killed it on purpose.
    killed = {"demo-w1"} if "SIGKILL demo-w1" in out else set()
    running = Worker.objects.filter(worker_id__startswith="demo-w", stopped_at__isnull=True)
    assert set(running.values_list("worker_id", flat=True)) == killed


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--jobs", "0"], "must be from 1 to 5000"),
        (["--workers", "many"], "is not a whole number"),
        (["--database-url", "localhost/db"], "is not a database URL"),
        (["--timeout", "-1"], "must be a positive number of seconds"),
    ],
)
def test_demo__bad_flags_fail_cleanly(processes: Processes, args: list[str], message: str) -> None:
    proc = demo(processes, *args)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1
    assert message in out and "Traceback" not in out
    assert len(out.strip().splitlines()) == 1, out
    assert not Payment.objects.exists()
