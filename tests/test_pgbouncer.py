"""Workers, the watcher and the network timeout through a real PgBouncer of stock configuration,
in transaction and in session pooling (the `pgbouncer` fixture)."""

import json
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.db import OperationalError, connection, connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models.functions import Now
from django.test import override_settings

from django_leases.dialects.statements import sqlstate
from django_leases.models import JobAttempt, PaymentJob
from django_leases.network import harden, watchdog
from tests.testapp.models import Charge, LockRun

from .conftest import Processes, database_url, finish, subprocess_env
from .pgbouncer import PgBouncer
from .test_network import STATEMENT_TIMEOUT, server_timeout

# PgBouncer pools PostgreSQL: without psycopg (a SQLite-only install) there is nothing to test.
psycopg = pytest.importorskip("psycopg")

Status = PaymentJob.Status


def bouncer_url(bouncer: PgBouncer) -> str:
    """DATABASE_URL of this run, through `bouncer`."""
    return database_url(port=bouncer.port).replace("@localhost:", "@127.0.0.1:")


@pytest.fixture
def bounced(pgbouncer: PgBouncer) -> Iterator[BaseDatabaseWrapper]:
    """A connection of its own to the test database through PgBouncer, as the alias
    "bounced", hardened with a network timeout of 1 s as a worker's thread is."""
    conn = connections.create_connection("default")
    conn.settings_dict = {
        **conn.settings_dict,
        "NAME": connection.settings_dict["NAME"],
        "HOST": "127.0.0.1",
        "PORT": pgbouncer.port,
    }
    with override_settings(DJANGO_LEASES={"NETWORK_TIMEOUT": 1}):
        harden(conn, 6)
    connections["bounced"] = conn
    yield conn
    conn.close()
    del connections["bounced"]


def test_pgbouncer__refuses_the_startup_parameter_options(pgbouncer: PgBouncer) -> None:
    """The premise of this module: a statement timeout sent at connect never gets through."""
    params = connection.get_connection_params()
    with pytest.raises(psycopg.OperationalError, match="unsupported startup parameter: options"):
        psycopg.connect(
            host="127.0.0.1",
            port=pgbouncer.port,
            dbname=params["dbname"],
            user=params.get("user"),
            options="-c statement_timeout=1000",
        )


@pytest.mark.django_db(transaction=True)
def test_harden__a_statement_stuck_behind_pgbouncer_ends_with_the_servers_error(
    bounced: BaseDatabaseWrapper,
) -> None:
    fired = watchdog.fired
    with pytest.raises(OperationalError) as caught, bounced.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(30)")
    assert sqlstate(caught.value) == STATEMENT_TIMEOUT
    assert watchdog.fired == fired  # the server ended it, not the client's cut
    with bounced.cursor() as cursor:
        assert server_timeout(cursor) == "1s"


@pytest.mark.django_db(transaction=True)
def test_claim__behind_pgbouncer_takes_each_job_once(bounced: BaseDatabaseWrapper) -> None:
    """The prepared claim, whose statements a transaction pooler loses between sessions."""
    PaymentJob.objects.bulk_create(PaymentJob(kind="capture") for _ in range(12))
    claimed = [
        job.pk
        for _ in range(6)
        for job in PaymentJob.objects.using("bounced").claim("w", ttl=60, limit=2)
    ]
    assert len(claimed) == len(set(claimed)) == 12
    assert JobAttempt.objects.filter(owner="w", outcome="running").count() == 12


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_workers__run_every_job_once_through_pgbouncer(
    pgbouncer: PgBouncer, processes: Processes
) -> None:
    """Three burst workers and a watcher pass, all through PgBouncer with the default network
    timeout: every job runs once, locks one job at a time, and nobody loses the database."""
    charges = [PaymentJob.objects.enqueue("charge", {"seconds": 0}) for _ in range(24)]
    # A job whose worker died: the watcher's pass returns it to the queue.
    (stale,) = PaymentJob.objects.claim("gone", ttl=60, limit=1, kinds=["charge"])
    PaymentJob.objects.filter(pk=stale.pk).update(lease_until=Now() - timedelta(seconds=5))
    locks = [f"payment:{n}" for n in range(3)]
    locked = [
        PaymentJob.objects.enqueue("locked_step", {"seconds": 0.01}, lock=locks[n % 3])
        for n in range(12)
    ]
    env = subprocess_env(
        DATABASE_URL=bouncer_url(pgbouncer),
        # LISTEN needs a session of its own: behind transaction pooling workers poll.
        LEASES_TEST_SETTINGS=json.dumps({"USE_NOTIFY": pgbouncer.pool_mode == "session"}),
    )

    watcher = processes.manage("watch_stuck_jobs", "--once", env=env)
    said = {"watcher": finish(watcher)}
    assert watcher.returncode == 0, said["watcher"]
    assert f"job_id={stale.pk} kind=charge previous_owner=gone" in said["watcher"]
    workers = {
        f"w{n}": processes.manage(
            "run_lease_worker",
            "--burst",
            "--worker-id",
            f"w{n}",
            "--concurrency",
            "2",
            "--poll-interval",
            "0.1",
            "-v",
            "2",
            env=env,
        )  # fmt: skip
        for n in range(3)
    }
    for name, proc in workers.items():
        said[name] = finish(proc, timeout=120)
        assert proc.returncode == 0, said[name]

    jobs = charges + locked
    everything = PaymentJob.objects.filter(pk__in=[job.pk for job in jobs])
    assert set(everything.values_list("status", flat=True)) == {Status.COMPLETED}
    assert Counter(Charge.objects.values_list("job_ref", flat=True)) == {
        job.pk: 1 for job in charges
    }
    for lock in locks:
        runs = list(LockRun.objects.filter(lock=lock).order_by("started_at", "pk"))
        assert [run.job_ref for run in runs] == [job.pk for job in locked if job.lock == lock]
        for before, after in zip(runs, runs[1:], strict=False):
            assert before.finished_at is not None and after.started_at >= before.finished_at
    completed = JobAttempt.objects.filter(job_ref__in=[job.pk for job in jobs], outcome="completed")
    assert Counter(completed.values_list("job_ref", flat=True)) == {job.pk: 1 for job in jobs}
    assert list(
        JobAttempt.objects.filter(job_ref=stale.pk)
        .order_by("token")
        .values_list("owner", "outcome")
    ) == [("gone", "rescued"), (PaymentJob.objects.get(pk=stale.pk).lease_owner, "completed")]
    # More than one worker ran jobs, and none of them ever lost the database.
    assert len(set(everything.values_list("lease_owner", flat=True))) > 1
    for name, out in said.items():
        assert "database unavailable" not in out, (name, out)
