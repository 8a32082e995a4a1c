"""Leases on a project's own job table (docs/own-table.md): `testapp.PayoutJob` with its ledger
`testapp.PayoutAttempt`, end to end with real worker and watcher processes, then the admin."""

import ast
import json
import os
import re
import signal
from datetime import timedelta

import pytest
from django.core.management import call_command, load_command_class
from django.core.management.base import CommandError
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse

from django_leases.models import JobAttempt, PaymentJob
from tests.testapp.models import Charge, PayoutAttempt, PayoutJob

from .conftest import ROOT, Processes, finish, subprocess_env, wait_for

Status = PayoutJob.Status
# The worker processes get the setting; the watcher, the last worker and prune_jobs --model.
PAYOUT_SETTINGS = json.dumps({"JOB_MODEL": "testapp.PayoutJob"})
FAST = ("--ttl", "2", "--heartbeat", "0.5", "--poll-interval", "0.1")


def fresh(job: PayoutJob) -> PayoutJob:
    return PayoutJob.objects.get(pk=job.pk)


def ledger(job: PayoutJob) -> list[tuple[int, str, str]]:
    return list(
        PayoutAttempt.objects.filter(job_ref=job.pk)
        .order_by("token")
        .values_list("attempt", "owner", "outcome")  # in token order: tokens rise with attempts
    )


def listed(client: Client, **params: str) -> set[int]:
    response = client.get(reverse("admin:testapp_payoutjob_changelist"), params)
    assert response.status_code == 200
    return {job.pk for job in response.context["cl"].result_list}


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_own_table__workers_sigkill_watcher_completion_prune_and_admin(
    processes: Processes, admin_client: Client
) -> None:
    # A payment job of the same kind: the payout workers never touch the other table.
    bystander = PaymentJob.objects.enqueue("payout.send")
    slow = PayoutJob.objects.enqueue(
        "payout.send",
        {"durations": [60, 0]},
        recipient="acct-slow",
        idempotency_key="payout-slow",
        priority=10,
    )
    again = PayoutJob.objects.enqueue(
        "payout.send", {"durations": [60, 0]}, idempotency_key="payout-slow"
    )
    assert (again.pk, again.recipient) == (slow.pk, "acct-slow")
    quick = [PayoutJob.objects.enqueue("payout.send", recipient=f"acct-{i}") for i in range(6)]

    env = subprocess_env(LEASES_TEST_SETTINGS=PAYOUT_SETTINGS)
    victim = processes.manage("run_lease_worker", "--worker-id", "victim", *FAST, env=env)
    wait_for(lambda: fresh(slow).lease_owner == "victim")
    survivor = processes.manage("run_lease_worker", "--worker-id", "survivor", *FAST, env=env)
    wait_for(lambda: all(fresh(job).status == Status.COMPLETED for job in quick))
    assert {fresh(job).lease_owner for job in quick} == {"survivor"}
    survivor.send_signal(signal.SIGTERM)
    out = finish(survivor)
    assert survivor.returncode == 0, out
    assert "worker survivor stopped" in out

    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait(timeout=10)
    wait_for(lambda: PayoutJob.objects.expired().filter(pk=slow.pk).exists())
    watcher = processes.manage(
        "watch_stuck_jobs", "--model", "testapp.PayoutJob", "--once", "--watcher-id", "w-1"
    )
    out = finish(watcher)
    assert watcher.returncode == 0, out
    assert f"job_id={slow.pk} kind=payout.send previous_owner=victim attempts=1" in out
    assert (fresh(slow).status, ledger(slow)) == (Status.PENDING, [(1, "victim", "rescued")])

    # The watcher's rescue may space the retry with backoff: a long-running worker waits for it.
    finisher = processes.manage(
        "run_lease_worker", "--model", "testapp.PayoutJob", "--worker-id", "finisher", *FAST
    )
    wait_for(lambda: fresh(slow).status == Status.COMPLETED)
    finisher.send_signal(signal.SIGTERM)
    out = finish(finisher)
    assert finisher.returncode == 0, out
    slow = fresh(slow)
    second = PayoutAttempt.objects.get(job_ref=slow.pk, attempt=2).token
    assert (slow.status, slow.attempts, slow.lease_token) == (Status.COMPLETED, 2, second)
    assert ledger(slow) == [(1, "victim", "rescued"), (2, "finisher", "completed")]
    assert [a.outcome for a in slow.attempt_log.order_by("token")] == ["rescued", "completed"]
    # One payout recorded per job, the slow one by the lease that completed it.
    assert Charge.objects.filter(job_ref=slow.pk).get().owner == "payout:finisher"
    assert Charge.objects.count() == 7
    bystander.refresh_from_db()
    assert (bystander.status, bystander.attempts, JobAttempt.objects.count()) == (
        Status.PENDING,
        0,
        0,
    )

    PayoutJob.objects.filter(status=Status.COMPLETED).update(completed_at=Now() - timedelta(days=8))
    pruner = processes.manage("prune_jobs", "--model", "testapp.PayoutJob")
    out = finish(pruner)
    assert pruner.returncode == 0, out
    assert "pruned 7 job(s)" in out
    assert (PayoutJob.objects.count(), PayoutAttempt.objects.count()) == (0, 0)
    assert PaymentJob.objects.filter(pk=bystander.pk).exists()

    stuck, healthy, waiting = (
        PayoutJob.objects.enqueue("payout.send", recipient=name)
        for name in ("acct-stuck", "acct-healthy", "acct-waiting")
    )
    assert PayoutJob.objects.claim_job(stuck.pk, "gone-worker", ttl=600)
    assert PayoutJob.objects.claim_job(healthy.pk, "live-worker", ttl=600)
    PayoutJob.objects.filter(pk=stuck.pk).update(lease_until=Now() - timedelta(seconds=5))

    assert listed(admin_client, lease="stuck") == {stuck.pk}
    page = admin_client.get(reverse("admin:testapp_payoutjob_changelist"), {"lease": "stuck"})
    assert b"acct-stuck" in page.content and b"gone-worker" in page.content
    assert listed(admin_client, lease="healthy") == {healthy.pk}
    assert listed(admin_client, status="pending") == {waiting.pk}
    assert listed(admin_client, q="gone-worker") == {stuck.pk}
    overview = admin_client.get(reverse("admin:testapp_payoutjob_overview"))
    assert (overview.status_code, overview.context["overview"].stuck) == (200, 1)
    page = admin_client.get(reverse("admin:testapp_payoutjob_change", args=[stuck.pk]))
    (inline,) = page.context["inline_admin_formsets"]
    assert inline.opts.model is PayoutAttempt
    assert [form.original.owner for form in inline] == ["gone-worker"]

    response = admin_client.post(
        reverse("admin:testapp_payoutjob_changelist"),
        {"action": "release_stuck", "_selected_action": [stuck.pk, healthy.pk, waiting.pk]},
        follow=True,
    )
    messages = [str(message) for message in response.context["messages"]]
    assert messages[0].startswith("1 stuck job released"), messages
    assert [fresh(job).status for job in (stuck, healthy, waiting)] == [
        Status.PENDING,
        Status.PROCESSING,
        Status.PENDING,
    ]
    assert fresh(healthy).lease_owner == "live-worker"
    assert [(owner, outcome) for _, owner, outcome in ledger(stuck)] == [("gone-worker", "rescued")]
    assert PayoutAttempt.objects.get(job_ref=stuck.pk).ended_by == "admin:admin"


@pytest.mark.parametrize("command", ["run_lease_worker", "watch_stuck_jobs", "prune_jobs"])
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("PayoutJob", "is not of the form 'app_label.ModelName'"),
        ("shop.PayoutJob", "is not an installed model"),
        ("testapp.Charge", "is not a concrete subclass of"),
    ],
)
def test_commands__model_option_refuses_what_is_no_job_table(
    command: str, value: str, problem: str
) -> None:
    with pytest.raises(CommandError, match=rf"argument --model: '{value}' {problem}"):
        call_command(command, "--model", value)


def test_own_table_docs__code_parses_and_commands_take_their_options() -> None:
    text = (ROOT / "docs" / "own-table.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    for block in blocks:
        ast.parse(block)
    ours = {"run_lease_worker", "watch_stuck_jobs", "prune_jobs"}
    lines = [
        line.split("#")[0].split() for line in re.findall(r"^python manage.py .*$", text, re.M)
    ]
    commands = [(words[2], words[3:]) for words in lines if words[2] in ours]
    assert {name for name, _ in commands} == ours
    for name, args in commands:
        args = [arg.replace("shop.PayoutJob", "testapp.PayoutJob") for arg in args]
        parser = load_command_class("django_leases", name).create_parser("manage.py", name)
        assert vars(parser.parse_args(args))["model"] is PayoutJob, (name, args)
