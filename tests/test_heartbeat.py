"""The worker's heartbeat: every lease renewed by (job, token), never by job alone; leases given
up once the worker's registry row may look gone; many leases renewed at once on every database."""

import json
import time
from typing import Any

import pytest
from django.db import connection, connections
from django.test import override_settings

from django_leases.models import JobAttempt, PaymentJob
from django_leases.watcher import StuckWatcher
from tests.testapp.models import Charge, LockRun

from .conftest import ON_SQLITE, Processes, finish, subprocess_env, wait_for
from .leasing import token_of
from .owner_rules import check
from .proxy import Proxy
from .test_network import NEEDS_NETWORK, Output, default_port, proxied_url

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

Status = PaymentJob.Status


def runs(job: PaymentJob) -> list[LockRun]:
    return list(LockRun.objects.filter(job_ref=job.pk).order_by("token"))


def worker(processes: Processes, *args: str, **env: str) -> Any:
    return processes.manage(
        "run_lease_worker", "--worker-id", "w", "--poll-interval", "0.1", *args, "-v", "2",
        env=subprocess_env(**env),
    )  # fmt: skip


@pytest.mark.parametrize("new_lease_slot", ["later", "earlier"])
@pytest.mark.slow
def test_heartbeat__tells_two_leases_of_one_job_apart(
    processes: Processes, new_lease_slot: str
) -> None:
    """An operator force-requeues a running job and the same worker claims it again into its
    free slot: it holds the old lease and the new one of one job. The heartbeat must refuse
    the old one (its handler learns it lost the job) and renew the new one, whichever slot each
    is in. Keyed by job id alone it renewed both (the old handler ran on believing it held the
    job) or refused both (the valid run was discarded and the job ran a third time)."""
    first = None
    if new_lease_slot == "earlier":
        # Slot 0 runs `first` while slot 1 takes the job; slot 0 is then free for the new lease.
        first = PaymentJob.objects.enqueue("watches_lease", {"seconds": 1.5}, priority=1)
    job = PaymentJob.objects.enqueue("watches_lease", {"seconds": 6})
    proc = worker(processes, "--concurrency", "2", "--ttl", "4", "--heartbeat", "0.5")
    wait_for(lambda: len(runs(job)) == 1, timeout=60)
    if first is not None:
        wait_for(lambda: PaymentJob.objects.get(pk=first.pk).status == Status.COMPLETED)
    old = runs(job)[0].token
    assert PaymentJob.objects.filter(pk=job.pk).requeue(force=True, by="op") == 1
    wait_for(lambda: len(runs(job)) == 2, timeout=30)
    wait_for(lambda: PaymentJob.objects.get(pk=job.pk).status == Status.COMPLETED, timeout=60)
    proc.terminate()
    out = finish(proc)

    before, after = runs(job)
    assert before.token == old < after.token
    # The old holder learned at a heartbeat that it lost the job; the new one kept it to the end.
    assert before.lock == "lost=True", out
    assert after.lock == "lost=False", out
    done = PaymentJob.objects.get(pk=job.pk)
    assert (done.lease_token, done.attempts) == (after.token, 2)
    assert list(
        JobAttempt.objects.filter(job_ref=job.pk).order_by("token").values_list("token", "outcome")
    ) == [(old, "requeued"), (after.token, "completed")]
    assert f"lease lost job_id={job.pk} token={after.token}" not in out
    assert f"lease lost job_id={job.pk} token={old}" in out


@NEEDS_NETWORK
def test_heartbeat__leases_end_when_the_registry_row_may_look_gone(processes: Processes) -> None:
    """WORKER_GONE_AFTER shorter than the TTL: once a cut-off worker's registry row is that
    old, the watcher may rescue its job for another worker, so the worker must take the lease
    as lost by then, not a TTL after its last renewal (20 s here). Exactly one run writes."""
    settings: dict[str, Any] = connections["default"].settings_dict
    port = int(settings["PORT"] or default_port(connection))
    gone_after = {
        "TTL": 20,
        "HEARTBEAT": 1,
        "NEAR_EXPIRY": 5,
        "WORKER_GONE_AFTER": 3,
        "NETWORK_TIMEOUT": 2,
    }
    job = PaymentJob.objects.enqueue("charge", {"durations": [12, 0]})
    with Proxy(port) as proxy:
        cut = processes.manage(
            "run_lease_worker", "--worker-id", "cut", "--kind", "charge", "--ttl", "20",
            "--heartbeat", "1", "--poll-interval", "0.2", "-v", "2",
            env=subprocess_env(
                DATABASE_URL=proxied_url(proxy.port), LEASES_TEST_SETTINGS=json.dumps(gone_after)
            ),
        )  # fmt: skip
        log = Output(cut)
        log.wait_for_line(f"claimed job_id={job.pk}")
        proxy.blackhole()
        cut_at = time.monotonic()
        with override_settings(DJANGO_LEASES=gone_after):
            watcher = StuckWatcher(watcher_id="watcher")
            wait_for(lambda: job.pk in {a.pk for a in watcher.run_once()}, timeout=30)
        rescued = time.monotonic()
        assert rescued - cut_at < 20, "the watcher waited for the TTL"
        # It gave the lease up with its registry row, by the time the watcher could rescue
        # it (with room for the log line to reach us), and said why.
        log.wait_for_line(f"lease lost job_id={job.pk} token={token_of(job)}", timeout=5)
        line = next(line for line in log.lines if f"lease lost job_id={job.pk}" in line)
        assert "WORKER_GONE_AFTER" in line, line
        assert log.started + float(line.split()[0]) <= rescued + 0.5, log.text
        peer = processes.manage(
            "run_lease_worker", "--worker-id", "peer", "--kind", "charge", "--burst"
        )
        finish(peer)
        assert PaymentJob.objects.get(pk=job.pk).status == Status.COMPLETED
        log.wait_for_line(f"fenced out job_id={job.pk} token={token_of(job)}", timeout=30)
    assert list(Charge.objects.values_list("job_ref", "token", "owner")) == [
        (job.pk, token_of(job, 2), "peer")
    ]


# Serial: a thousand threads share two cores with the worker's heartbeat. A 4 s lease for a 6 s
# handler must be renewed at least once, and a renewal may be 3.5 s late (with 2 s leases, a
# loaded CI machine lost some: 1,000 completions queue behind SQLite's one writer).
@pytest.mark.serial
@pytest.mark.skipif(not ON_SQLITE, reason="a thousand connections: past a server's default limit")
def test_heartbeat__renews_a_thousand_leases_at_the_concurrency_maximum(
    processes: Processes,
) -> None:
    """`--concurrency 1000` on SQLite: every heartbeat renews a thousand leases in statements
    SQLite accepts (a chain of a thousand ORs was "Expression tree is too large": every lease
    lost, every result discarded)."""
    jobs = [PaymentJob.objects.enqueue("sleep", {"seconds": 6}) for _ in range(1000)]
    proc = worker(processes, "--concurrency", "1000", "--ttl", "4", "--heartbeat", "0.5", "--burst")
    out = finish(proc, timeout=240)
    assert proc.returncode == 0, out[-3000:]
    assert "heartbeat failed" not in out, out[-3000:]
    assert "lease lost" not in out and "fenced out" not in out, out[-3000:]
    assert (
        PaymentJob.objects.filter(pk__in=[j.pk for j in jobs], status=Status.COMPLETED).count()
        == 1000
    )
    assert "completed=1000" in out and "lost=0" in out


def test_heartbeat__a_renewal_that_raced_a_completion_is_not_a_lost_lease(
    processes: Processes,
) -> None:
    """The heartbeat reads the leases held, then renews them; a slot's completion may commit in
    between. That refusal is the completion's own race, not a lost lease: nothing is logged as
    lost (a run that counted 0 lost leases logged hundreds of "lease lost" lines)."""
    PaymentJob.objects.bulk_create(PaymentJob(kind="noop") for _ in range(1000))
    proc = worker(processes, "--concurrency", "4", "--ttl", "10", "--heartbeat", "0.02", "--burst")
    out = finish(proc, timeout=240)
    assert proc.returncode == 0, out[-3000:]
    assert "completed=1000" in out and "lost=0" in out, out[-3000:]
    assert "lease lost" not in out, [line for line in out.splitlines() if "lease lost" in line]


def test_heartbeat__the_leases_it_reported_lost_are_written_under_its_lock_only() -> None:
    assert check("Heartbeat._reported_lost") == []
