"""A kind's own lease length and attempt budget: `@job_handler(kind, ttl=, max_attempts=)`.

The kind `sleep_long_lease` of tests/testapp/jobs.py has `ttl=90, max_attempts=2`; `sleep` and
`noop` have neither, so their leases are of the claim's (the worker's) TTL."""

import json
import os
import signal
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.core.checks import run_checks
from django.db.models import F
from django.db.models.functions import Now
from django.test import override_settings

from django_leases import job_handler
from django_leases.exceptions import HandlerError
from django_leases.handlers import lease_length, near_window, unregister
from django_leases.models import PaymentJob
from django_leases.worker import LeaseWorker

from .conftest import Processes, finish, subprocess_env, wait_for

LONG = "sleep_long_lease"
Status = PaymentJob.Status


def length(job: PaymentJob) -> timedelta:
    """The length of the job's lease as the database set it: from its last renewal (or claim,
    which sets `heartbeat_at` by the same clock reading) to its end."""
    job.refresh_from_db()
    return job.lease_until - job.heartbeat_at


@pytest.fixture
def kind():
    name = "test_kind_leases_kind"
    yield name
    unregister(name)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ttl": 0.5}, "job kind 'test_kind_leases_kind': ttl must be"),
        ({"ttl": "long"}, "job kind 'test_kind_leases_kind': ttl"),
        ({"max_attempts": 0}, "max_attempts must be a whole number from 1 to 1000000, got 0"),
        ({"max_attempts": True}, "max_attempts must be a whole number"),
    ],
)
def test_job_handler__refuses_a_bad_ttl_or_max_attempts_at_import(kind, options, message):
    with pytest.raises(HandlerError, match=message.replace("(", r"\(")):
        job_handler(kind, **options)(lambda job, lease: None)
    assert lease_length(kind, 60.0) == 60.0


def test_job_handler__a_kind_ttl_is_its_lease_length_and_unregister_forgets_it(kind):
    job_handler(kind, ttl=timedelta(minutes=5))(lambda job, lease: None)
    assert lease_length(kind, 60.0) == 300.0
    unregister(kind)
    assert lease_length(kind, 60.0) == 60.0


@pytest.mark.django_db
@pytest.mark.parametrize("many", [False, True])
def test_claim__leases_each_job_for_its_kind_ttl_in_one_claim(many):
    long, short = PaymentJob.objects.enqueue(LONG), PaymentJob.objects.enqueue("sleep")
    if many:
        claimed = PaymentJob.objects.claim("w1", ttl=3, limit=2)
    else:
        claimed = PaymentJob.objects.claim("w1", ttl=3, limit=2, kinds=[LONG, "sleep"])
    assert {job.pk for job in claimed} == {long.pk, short.pk}
    assert (length(long), length(short)) == (timedelta(seconds=90), timedelta(seconds=3))


@pytest.mark.django_db
def test_claim_job_and_the_heartbeat__use_the_kind_ttl_too():
    long, short = PaymentJob.objects.enqueue(LONG), PaymentJob.objects.enqueue("sleep")
    assert PaymentJob.objects.claim_job(long.pk, "w1", ttl=3) is not None
    assert length(long) == timedelta(seconds=90)
    [short] = PaymentJob.objects.claim("w1", ttl=3, kinds=["sleep"])
    keys = [(long.pk, long.lease_token), (short.pk, short.lease_token)]
    assert PaymentJob.objects.heartbeat("w1", keys, ttl=5) == set(keys)
    assert (length(long), length(short)) == (timedelta(seconds=90), timedelta(seconds=5))


@pytest.mark.django_db
def test_complete_and_claim__leases_the_next_job_for_its_kind_ttl():
    first = PaymentJob.objects.enqueue("noop")
    [held] = PaymentJob.objects.claim("w1", ttl=3, kinds=["noop"])
    long = PaymentJob.objects.enqueue(LONG)
    done, claimed = PaymentJob.objects.complete_and_claim(
        "w1", [(held.pk, held.lease_token)], ttl=3, kinds=["noop", LONG]
    )
    assert done == {(first.pk, held.lease_token)}
    assert [job.pk for job in claimed] == [long.pk]
    assert length(long) == timedelta(seconds=90)


@pytest.mark.django_db
def test_enqueue__max_attempts_defaults_to_the_kind_then_to_the_setting():
    assert PaymentJob.objects.enqueue(LONG).max_attempts == 2
    assert PaymentJob.objects.enqueue(LONG, max_attempts=7).max_attempts == 7
    assert PaymentJob.objects.enqueue("sleep").max_attempts == 5  # MAX_ATTEMPTS
    assert [job.max_attempts for job in PaymentJob.objects.enqueue_many(LONG, [{}, {}])] == [2, 2]
    assert [job.max_attempts for job in PaymentJob.objects.enqueue_many("sleep", [{}])] == [5]


@pytest.mark.django_db
def test_aenqueue__max_attempts_defaults_to_the_kind():
    async def enqueue() -> PaymentJob:
        return await PaymentJob.objects.aenqueue(LONG)

    job = async_to_sync(enqueue)()
    assert PaymentJob.objects.get(pk=job.pk).max_attempts == 2


@pytest.mark.django_db
def test_near_expiry__scales_the_window_with_the_kind_ttl():
    # TTL 60 and NEAR_EXPIRY 20 (the defaults): a lease of 90 s is near expiry in its last 30 s.
    assert near_window(LONG, 20.0) == pytest.approx(30.0)
    assert near_window("sleep", 20.0) == 20.0
    long, short = PaymentJob.objects.enqueue(LONG), PaymentJob.objects.enqueue("sleep")
    PaymentJob.objects.claim("w1", ttl=30, limit=2)
    # Both leases end in 25 s: within the long kind's window, not within a default lease's.
    PaymentJob.objects.filter(pk__in=[long.pk, short.pk]).update(
        lease_until=Now() + timedelta(seconds=25)
    )
    near = set(PaymentJob.objects.near_expiry(20).values_list("pk", flat=True))
    healthy = set(PaymentJob.objects.healthy(20).values_list("pk", flat=True))
    assert (near, healthy) == ({long.pk}, {short.pk})
    PaymentJob.objects.filter(pk=short.pk).update(lease_until=Now() + timedelta(seconds=5))
    near = set(PaymentJob.objects.near_expiry(20).values_list("pk", flat=True))
    assert (near, PaymentJob.objects.healthy(20).count()) == ({long.pk, short.pk}, 0)


def check_ids(**settings: object) -> list[str]:
    with override_settings(DJANGO_LEASES=settings):
        return sorted(
            message.id
            for message in run_checks(databases=[])  # Django 6.1 would ask every database
            if message.id in ("django_leases.E038", "django_leases.W013")
        )


def test_checks__a_kind_ttl_against_the_heartbeat_and_worker_gone_after():
    assert check_ids() == []
    assert check_ids(TTL=120, HEARTBEAT=90, WORKER_GONE_AFTER=300) == ["django_leases.E038"]
    assert check_ids(TTL=20, HEARTBEAT=5, WORKER_GONE_AFTER=89) == ["django_leases.W013"]


@pytest.mark.django_db
@override_settings(DJANGO_LEASES={"WORKER_GONE_AFTER": 300})
def test_worker__refuses_a_heartbeat_not_shorter_than_a_served_kind_ttl():
    with pytest.raises(ValueError, match=r"must be shorter than the ttl of job kind 'sleep_long"):
        LeaseWorker(kinds=[LONG, "sleep"], ttl=120, heartbeat=90)
    # Without that kind, the same heartbeat is fine.
    assert LeaseWorker(kinds=["sleep"], ttl=120, heartbeat=90).heartbeat_interval == 90


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_run_lease_worker__judges_a_kind_ttl_by_its_own_heartbeat_and_kinds(
    processes: Processes,
) -> None:
    """E038 (HEARTBEAT 90 s, not shorter than the 90 s ttl of `sleep_long_lease`) refused
    every worker, also one started with the hint's own remedy (a shorter --heartbeat) or one
    that does not serve the kind."""
    env = subprocess_env(
        LEASES_TEST_SETTINGS=json.dumps({"TTL": 120, "HEARTBEAT": 90, "WORKER_GONE_AFTER": 300})
    )
    done = PaymentJob.objects.enqueue("noop")
    outcomes = {}
    for options in (["--heartbeat", "30"], ["--kind", "noop", "sleep"], []):
        proc = processes.manage("run_lease_worker", "--burst", *options, env=env)
        out = finish(proc)
        outcomes[" ".join(options)] = (proc.returncode, out.strip().splitlines()[-1])
    assert outcomes == {
        "--heartbeat 30": (0, outcomes["--heartbeat 30"][1]),
        "--kind noop sleep": (0, outcomes["--kind noop sleep"][1]),
        "": (
            1,
            "CommandError: heartbeat (90s) must be shorter than the ttl of job kind "
            "'sleep_long_lease' (90s)",
        ),
    }
    assert "stopped: claimed=1 completed=1" in outcomes["--heartbeat 30"][1]
    assert PaymentJob.objects.get(pk=done.pk).status == Status.COMPLETED


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_worker__leases_and_renews_each_kind_for_its_ttl_and_a_killed_holder_loses_each_then(
    processes: Processes,
) -> None:
    long = PaymentJob.objects.enqueue(LONG, {"seconds": 60})
    short = PaymentJob.objects.enqueue("sleep", {"seconds": 60})
    proc = processes.manage(
        "run_lease_worker", "--worker-id", "mixed", "--ttl", "2", "--heartbeat", "0.4",
        "--concurrency", "2", "--kind", LONG, "sleep", "--poll-interval", "0.1", "-v", "2",
    )  # fmt: skip
    held = PaymentJob.objects.filter(status=Status.PROCESSING, lease_owner="mixed")
    wait_for(lambda: held.count() == 2)
    claimed = dict(held.values_list("pk", "heartbeat_at"))
    # Renewed at least once each, every renewal for the job's own length.
    wait_for(lambda: all(job.heartbeat_at > claimed[job.pk] for job in held.all()))
    assert (length(long), length(short)) == (timedelta(seconds=90), timedelta(seconds=2))

    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc)
    expired = PaymentJob.objects.expired()
    wait_for(lambda: expired.filter(pk=short.pk).exists(), timeout=30)
    # When the short lease ran out, the long one had most of its 90 s left: a takeover of the
    # killed holder's job of that kind waits for its own lease.
    left = PaymentJob.objects.annotate(left=F("lease_until") - Now()).get(pk=long.pk).left
    assert timedelta(seconds=60) < left <= timedelta(seconds=90 - 2)
    assert [job.pk for job in PaymentJob.objects.claim("rescuer", ttl=2, limit=2)] == [short.pk]


@pytest.mark.django_db
def test_worker__its_lease_clock_gives_each_job_its_kind_ttl():
    long, short = PaymentJob.objects.enqueue(LONG), PaymentJob.objects.enqueue("sleep")
    worker = LeaseWorker(kinds=[LONG, "sleep"], ttl=2, heartbeat=0.4)
    jobs = PaymentJob.objects.claim(worker.worker_id, ttl=2, limit=2)
    leases = worker._outcomes.leases(jobs, started=0.0)
    assert {lease.pk: lease.ttl for lease in leases} == {long.pk: 90.0, short.pk: 2.0}
