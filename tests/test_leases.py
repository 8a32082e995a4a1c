"""`LeaseQuerySet` (querysets/leases.py): the claim, the holder's writes, the rescue."""

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_leases.dialects import Dialect
from django_leases.exceptions import InvalidArgument, InvalidDuration, LeaseLost
from django_leases.limits import CONCURRENCY
from django_leases.models import JobAttempt, PaymentJob
from django_leases.querysets.claims import claim_by_dialect
from tests.leasing import claim_one, database_micros, expire, ledger, statements, token_of
from tests.testapp.models import BareJob

pytestmark = pytest.mark.django_db

Status = PaymentJob.Status


def test_leases__a_table_without_a_ledger_claims_and_completes() -> None:
    job = BareJob.objects.enqueue("bare")
    (claimed,) = BareJob.objects.claim("w1", ttl=60)
    assert (claimed.pk, claimed.attempts) == (job.pk, 1) and claimed.lease_token > job.lease_token
    assert BareJob.objects.get(pk=job.pk).lease_token == claimed.lease_token
    BareJob.objects.complete(job.pk, "w1", claimed.lease_token)
    assert BareJob.objects.get(pk=job.pk).status == Status.COMPLETED
    assert BareJob.objects.attempt_rows(job.pk) == []


def test_claim__takes_job_and_counts_attempt_in_same_update() -> None:
    job = PaymentJob.objects.enqueue("capture")
    claimed = claim_one("worker-a")
    assert claimed.pk == job.pk
    job.refresh_from_db()
    assert job.status == Status.PROCESSING
    assert job.lease_owner == "worker-a"
    assert job.attempts == 1 and job.lease_token == claimed.lease_token == token_of(job) > 0
    assert job.lease_until is not None and job.heartbeat_at is not None
    assert (job.lease_until - job.heartbeat_at).total_seconds() == pytest.approx(60, abs=0.01)
    assert ledger(job) == [(1, 1, "worker-a", "running")]


AHEAD = 10**17  # a token ahead of any clock: as after a new primary's clock was set back


def claim_by(path: str, pk: int) -> PaymentJob:
    """Claim job `pk` for "w" by `path`: this database's claim, the ORM path, or `claim_job`."""
    if path == "claim_job":
        job = PaymentJob.objects.claim_job(pk, "w", ttl=60)
        assert job is not None
        return job
    jobs = PaymentJob.objects.all()
    (job,) = (
        jobs.claim("w", ttl=60)
        if path == "claim"
        else claim_by_dialect(jobs, "w", 60.0, 1, None, dialect=Dialect())
    )
    assert job.pk == pk
    return job


@pytest.mark.parametrize("path", ["claim", "orm", "claim_job"])
def test_claim__token_is_the_database_clock_or_one_more_than_the_last(path: str) -> None:
    """A new token is GREATEST(last + 1, the database clock in microseconds): above every token
    of the job, and above every token issued before now, lost in a failover or not."""
    job = PaymentJob.objects.enqueue("a")
    floor = database_micros()
    first = claim_by(path, job.pk)
    assert floor <= first.lease_token <= database_micros()
    assert token_of(first) == first.lease_token
    PaymentJob.objects.filter(pk=job.pk).update(lease_token=AHEAD)
    expire(first)
    second = claim_by(path, job.pk)
    assert second.lease_token == token_of(second, 2) == AHEAD + 1


@pytest.mark.parametrize("force", ["requeue", "mark_failed"])
def test_forced_actions__fence_with_a_token_from_the_same_rule(force: str) -> None:
    job = PaymentJob.objects.enqueue("a")
    held = claim_one("w")
    floor = database_micros()
    jobs = PaymentJob.objects.filter(pk=job.pk)
    changed = (
        jobs.requeue(force=True) if force == "requeue" else jobs.mark_failed(reason="x", force=True)
    )
    assert changed == 1
    fenced = PaymentJob.objects.get(pk=job.pk).lease_token
    assert fenced > held.lease_token and fenced >= floor
    PaymentJob.objects.filter(pk=job.pk).update(lease_token=AHEAD, status=Status.PENDING)
    assert jobs.requeue(force=True) == 1
    assert PaymentJob.objects.get(pk=job.pk).lease_token == AHEAD + 1


def test_claim__live_lease_is_not_claimable() -> None:
    PaymentJob.objects.enqueue("capture")
    claim_one("w1")
    assert PaymentJob.objects.claim("w2", ttl=60) == []


def test_claim__expired_lease_is_taken_over_with_new_token() -> None:
    PaymentJob.objects.enqueue("capture")
    first = claim_one("w1")
    expire(first)
    second = claim_one("w2")
    assert second.pk == first.pk
    assert (second.attempts, second.lease_token, second.lease_owner) == (
        2,
        token_of(first, 2),
        "w2",
    )
    assert second.lease_token > first.lease_token
    assert ledger(second) == [(1, 1, "w1", "lease_lost"), (2, 2, "w2", "running")]


def test_claim__respects_limit_priority_and_order() -> None:
    low = PaymentJob.objects.enqueue("a", priority=0)
    high = PaymentJob.objects.enqueue("a", priority=5)
    mid = PaymentJob.objects.enqueue("a", priority=1)
    claimed = PaymentJob.objects.claim("w1", ttl=60, limit=2)
    assert [job.pk for job in claimed] == [high.pk, mid.pk]
    assert [job.pk for job in PaymentJob.objects.claim("w1", ttl=60, limit=5)] == [low.pk]


def test_claim__expired_leases_come_before_pending_jobs() -> None:
    PaymentJob.objects.enqueue("a", priority=9)
    old = PaymentJob.objects.enqueue("a", priority=10)
    expire(claim_one("w1"))
    claimed = PaymentJob.objects.claim("w2", ttl=60, limit=2)
    assert [job.pk for job in claimed][0] == old.pk
    assert len(claimed) == 2


def test_claim__only_given_kinds() -> None:
    PaymentJob.objects.enqueue("capture")
    refund = PaymentJob.objects.enqueue("refund")
    assert [j.pk for j in PaymentJob.objects.claim("w1", ttl=60, limit=5, kinds=["refund"])] == [
        refund.pk
    ]
    assert PaymentJob.objects.claim("w1", ttl=60, kinds=[]) == []
    assert PaymentJob.objects.filter(kind="capture", status=Status.PENDING).count() == 1


def test_claim__job_without_attempts_left_is_not_claimable() -> None:
    PaymentJob.objects.enqueue("capture", max_attempts=1)
    expire(claim_one("w1"))
    assert PaymentJob.objects.claim("w2", ttl=60) == []
    assert PaymentJob.objects.expired().count() == 1


@pytest.mark.parametrize("ttl", [0, -1, "60", None, float("inf"), True])
def test_claim__bad_ttl_raises_before_any_write(ttl: object) -> None:
    PaymentJob.objects.enqueue("capture")
    with pytest.raises(InvalidDuration):
        PaymentJob.objects.claim("w1", ttl=ttl)  # type: ignore[arg-type]
    assert PaymentJob.objects.filter(status=Status.PENDING).count() == 1


def test_claim__a_filtered_queryset_is_refused_not_ignored() -> None:
    """A claim takes from the whole queue: given `filter(...)`, it used to take the job the
    filter left out (the capture below)."""
    capture = PaymentJob.objects.enqueue("capture")
    refund = PaymentJob.objects.enqueue("refund")
    refunds = PaymentJob.objects.filter(pk=refund.pk)
    for claim in (
        lambda: refunds.claim("w1", ttl=60),
        lambda: refunds.complete_and_claim("w1", [], ttl=60),
    ):
        with pytest.raises(InvalidArgument, match=r"kinds=, or one job with claim_job\(pk\)"):
            claim()
    assert PaymentJob.objects.filter(status=Status.PENDING).count() == 2
    assert JobAttempt.objects.count() == 0
    # What the filter meant, said the ways a claim understands.
    assert [job.pk for job in PaymentJob.objects.claim("w1", ttl=60, kinds=["refund"])] == [
        refund.pk
    ]
    assert PaymentJob.objects.using("default").claim_job(capture.pk, "w1", ttl=60) is not None


def test_claim__accepts_timedelta_and_float_ttl() -> None:
    PaymentJob.objects.enqueue("a")
    PaymentJob.objects.enqueue("a")
    a = PaymentJob.objects.claim("w1", ttl=timedelta(seconds=90))[0]
    b = PaymentJob.objects.claim("w1", ttl=0.5)[0]
    for job, seconds in ((a, 90), (b, 0.5)):
        job.refresh_from_db()
        assert (job.lease_until - job.heartbeat_at).total_seconds() == pytest.approx(
            seconds, abs=0.01
        )


def test_claim__query_count_is_pinned() -> None:
    for _ in range(3):
        PaymentJob.objects.enqueue("a")
    # PostgreSQL: one statement that claims and writes the ledger. SQLite: one UPDATE per pass
    # (expired, due) + the insert. MariaDB: an empty locking SELECT for expired leases, then
    # SELECT ... FOR UPDATE SKIP LOCKED, UPDATE and read-back for due jobs, + the insert.
    expected = {"postgresql": 1, "sqlite": 3, "mysql": 5}[connection.vendor]
    with CaptureQueriesContext(connection) as ctx:
        jobs = PaymentJob.objects.claim("w1", ttl=60, limit=3)
    assert len(jobs) == 3
    assert len(statements(ctx)) == expected, statements(ctx)


def test_claim_job__claims_only_a_claimable_job() -> None:
    job = PaymentJob.objects.enqueue("capture")
    won = PaymentJob.objects.claim_job(job.pk, "w1", ttl=60)
    assert won is not None and won.attempts == 1 and won.lease_owner == "w1"
    assert PaymentJob.objects.claim_job(job.pk, "w2", ttl=60) is None
    expire(won)
    again = PaymentJob.objects.claim_job(job.pk, "w2", ttl=60)
    assert again is not None and again.lease_token == token_of(job, 2) > won.lease_token
    assert ledger(job) == [(1, 1, "w1", "lease_lost"), (2, 2, "w2", "running")]


def test_claim_job__future_job_is_not_claimable() -> None:
    job = PaymentJob.objects.enqueue("capture", run_at=3600)
    assert PaymentJob.objects.claim_job(job.pk, "w1", ttl=60) is None


def test_heartbeat__renews_many_leases_in_one_statement() -> None:
    for _ in range(3):
        PaymentJob.objects.enqueue("a")
    jobs = PaymentJob.objects.claim("w1", ttl=5, limit=3)
    leases = {job.pk: job.lease_token for job in jobs}
    with CaptureQueriesContext(connection) as ctx:
        renewed = PaymentJob.objects.heartbeat("w1", leases, ttl=120)
    # One UPDATE of the jobs, one of their ledger rows.
    assert len(statements(ctx)) == 2, statements(ctx)
    assert renewed == set(leases.items())
    for job in PaymentJob.objects.filter(pk__in=leases):
        assert (job.lease_until - job.heartbeat_at).total_seconds() == pytest.approx(120, abs=0.01)
    assert set(JobAttempt.objects.values_list("last_heartbeat_at", flat=True)) == set(
        PaymentJob.objects.values_list("heartbeat_at", flat=True)
    )


def test_heartbeat__refuses_after_takeover() -> None:
    PaymentJob.objects.enqueue("a")
    PaymentJob.objects.enqueue("a")
    mine, theirs = PaymentJob.objects.claim("w1", ttl=60, limit=2)
    expire(theirs)
    taken = claim_one("w2")
    assert taken.pk == theirs.pk
    renewed = PaymentJob.objects.heartbeat(
        "w1", {mine.pk: mine.lease_token, theirs.pk: theirs.lease_token}, ttl=60
    )
    assert renewed == {(mine.pk, mine.lease_token)}
    theirs.refresh_from_db()
    assert (theirs.lease_owner, theirs.lease_token) == ("w2", taken.lease_token)


def test_heartbeat__tells_an_old_lease_from_the_new_one_of_the_same_job() -> None:
    """The same owner holds the old and the new lease of one job (a forced requeue, then its
    own claim): only the new one is renewed, whatever the order they are given in."""
    PaymentJob.objects.enqueue("a")
    old = claim_one("w1")
    assert PaymentJob.objects.filter(pk=old.pk).requeue(force=True) == 1
    new = claim_one("w1")
    assert new.pk == old.pk and new.lease_token > old.lease_token
    for leases in ([old, new], [new, old]):
        keys = [(job.pk, job.lease_token) for job in leases]
        assert PaymentJob.objects.heartbeat("w1", keys, ttl=60) == {(new.pk, new.lease_token)}
        won = PaymentJob.objects.complete_and_claim("w1", [], ttl=60)
        assert won == (set(), [])
    assert PaymentJob.objects.complete_many("w1", [(old.pk, old.lease_token)]) == set()
    assert PaymentJob.objects.complete_many(
        "w1", [(old.pk, old.lease_token), (new.pk, new.lease_token)]
    ) == {(new.pk, new.lease_token)}
    assert ledger(new) == [(1, 1, "w1", "requeued"), (2, 2, "w1", "completed")]
    assert [token_of(new, 1), token_of(new, 2)] == [old.lease_token, new.lease_token]


def test_heartbeat__many_leases_at_the_concurrency_maximum() -> None:
    """A worker at `--concurrency 1000` holds up to 2000 leases (one running and one claimed
    ahead per slot): they are renewed, completed and noted as fenced on every database (SQLite
    refused a chain of that many ORs: "Expression tree is too large")."""
    leases = 2 * CONCURRENCY[1]
    PaymentJob.objects.bulk_create(PaymentJob(kind="a") for _ in range(leases))
    held = PaymentJob.objects.claim("w1", ttl=60, limit=leases)
    keys = [(job.pk, job.lease_token) for job in held]
    assert len(keys) == leases
    expire(held[0])
    renewed = PaymentJob.objects.heartbeat("w1", keys, ttl=120)
    assert renewed == set(keys[1:])
    assert JobAttempt.objects.filter(last_heartbeat_at__isnull=False).count() == leases
    half = keys[: leases // 2]
    stale = [(pk, token + 7) for pk, token in half]
    assert PaymentJob.objects.complete_many("w1", half + stale) == set(half)
    won, claimed = PaymentJob.objects.complete_and_claim("w1", keys, ttl=60, limit=1)
    assert won == set(keys[leases // 2 :]) and claimed == []
    assert PaymentJob.objects.filter(status=PaymentJob.Status.COMPLETED).count() == leases
    # Every lease was completed by its holder; none was fenced (the stale tokens never existed).
    assert not JobAttempt.objects.filter(fenced_at__isnull=False).exists()
    assert JobAttempt.objects.filter(outcome="completed", ended_by="w1").count() == leases


def test_heartbeat__refuses_an_expired_lease() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    expire(job)
    assert PaymentJob.objects.heartbeat("w1", {job.pk: job.lease_token}, ttl=60) == set()
    assert PaymentJob.objects.expired().filter(pk=job.pk).exists()


def test_complete__marks_completed_and_closes_ledger() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    with CaptureQueriesContext(connection) as ctx:
        PaymentJob.objects.complete(job.pk, "w1", job.lease_token)
    # PostgreSQL: one statement for the job and its ledger row; elsewhere one each.
    assert len(statements(ctx)) == (1 if connection.vendor == "postgresql" else 2), statements(ctx)
    job.refresh_from_db()
    assert job.status == Status.COMPLETED and job.completed_at is not None
    assert job.lease_owner == "w1" and job.attempts == 1
    assert ledger(job) == [(1, 1, "w1", "completed")]
    assert JobAttempt.objects.get(job_ref=job.pk).ended_at is not None


def test_complete__refuses_after_takeover_and_records_fenced_out() -> None:
    PaymentJob.objects.enqueue("a")
    zombie = claim_one("w1")
    expire(zombie)
    owner = claim_one("w2")
    with pytest.raises(LeaseLost):
        PaymentJob.objects.complete(zombie.pk, "w1", zombie.lease_token)
    job = PaymentJob.objects.get(pk=zombie.pk)
    assert (job.status, job.lease_owner, job.lease_token) == (
        Status.PROCESSING,
        "w2",
        owner.lease_token,
    )
    assert owner.lease_token > zombie.lease_token
    old = JobAttempt.objects.get(job_ref=job.pk, token=zombie.lease_token)
    assert old.outcome == "lease_lost" and old.fenced_at is not None
    PaymentJob.objects.complete(owner.pk, "w2", owner.lease_token)
    assert ledger(job) == [(1, 1, "w1", "lease_lost"), (2, 2, "w2", "completed")]


def test_complete__refuses_wrong_owner_with_same_token() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    with pytest.raises(LeaseLost):
        PaymentJob.objects.complete(job.pk, "someone-else", job.lease_token)
    assert PaymentJob.objects.get(pk=job.pk).status == Status.PROCESSING


def test_complete__after_completion_is_refused() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    PaymentJob.objects.complete(job.pk, "w1", job.lease_token)
    with pytest.raises(LeaseLost):
        PaymentJob.objects.complete(job.pk, "w1", job.lease_token)


def test_checkpoint__records_step_and_refuses_after_takeover() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    PaymentJob.objects.checkpoint(job.pk, "w1", job.lease_token, "psp_called")
    assert PaymentJob.objects.get(pk=job.pk).checkpoint == "psp_called"
    assert JobAttempt.objects.get(job_ref=job.pk).checkpoint == "psp_called"
    expire(job)
    claim_one("w2")
    with pytest.raises(LeaseLost):
        PaymentJob.objects.checkpoint(job.pk, "w1", job.lease_token, "captured")
    assert PaymentJob.objects.get(pk=job.pk).checkpoint == "psp_called"


def test_fail__retries_with_backoff_then_fails_at_max_attempts() -> None:
    PaymentJob.objects.enqueue("a", max_attempts=2)
    job = claim_one("w1")
    assert (
        PaymentJob.objects.fail(job.pk, "w1", job.lease_token, RuntimeError("psp 502"), retry_in=30)
        == Status.PENDING
    )
    job.refresh_from_db()
    assert job.last_error == "RuntimeError: psp 502"
    assert not PaymentJob.objects.due().filter(pk=job.pk).exists()
    PaymentJob.objects.filter(pk=job.pk).update(run_at=Now())
    job = claim_one("w1")
    assert job.attempts == 2
    assert (
        PaymentJob.objects.fail(job.pk, "w1", job.lease_token, ValueError("again")) == Status.FAILED
    )
    job.refresh_from_db()
    assert job.status == Status.FAILED and job.completed_at is not None
    assert ledger(job) == [(1, 1, "w1", "retried"), (2, 2, "w1", "failed")]
    row = JobAttempt.objects.get(job_ref=job.pk, token=job.lease_token)
    assert (row.error_class, row.error_message) == ("ValueError", "again")


def test_fail__permanent_fails_at_once() -> None:
    PaymentJob.objects.enqueue("a", max_attempts=5)
    job = claim_one("w1")
    assert (
        PaymentJob.objects.fail(job.pk, "w1", job.lease_token, "declined", permanent=True)
        == Status.FAILED
    )
    assert PaymentJob.objects.get(pk=job.pk).attempts == 1


def test_fail__refuses_after_takeover() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    expire(job)
    claim_one("w2")
    with pytest.raises(LeaseLost):
        PaymentJob.objects.fail(job.pk, "w1", job.lease_token, RuntimeError("x"))
    assert PaymentJob.objects.get(pk=job.pk).last_error == ""


def test_release__returns_job_without_spending_an_attempt() -> None:
    PaymentJob.objects.enqueue("a", max_attempts=1)
    job = claim_one("w1")
    PaymentJob.objects.release(job.pk, "w1", job.lease_token)
    job.refresh_from_db()
    assert (job.status, job.attempts, job.max_attempts) == (Status.PENDING, 1, 2)
    again = claim_one("w2")
    assert again.attempts == 2
    assert ledger(job) == [(1, 1, "w1", "released"), (2, 2, "w2", "running")]


def test_release__refuses_after_takeover() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    expire(job)
    claim_one("w2")
    with pytest.raises(LeaseLost):
        PaymentJob.objects.release(job.pk, "w1", job.lease_token)
    assert PaymentJob.objects.get(pk=job.pk).lease_owner == "w2"


def test_rescue__returns_expired_job_to_pending_without_an_attempt() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    expire(job)
    stale = PaymentJob.objects.expired().get()
    assert PaymentJob.objects.rescue(stale, "retry", by="watcher") is True
    job.refresh_from_db()
    assert (job.status, job.attempts) == (Status.PENDING, 1)
    assert ledger(job) == [(1, 1, "w1", "rescued")]
    assert PaymentJob.objects.rescue(stale, "retry", by="watcher-2") is False


def test_rescue__never_resurrects_a_completed_job() -> None:
    PaymentJob.objects.enqueue("a")
    job = claim_one("w1")
    expire(job)
    stale = PaymentJob.objects.expired().get()
    # The holder completes between the watcher's read and its write.
    PaymentJob.objects.complete(job.pk, "w1", job.lease_token)
    assert PaymentJob.objects.rescue(stale, "retry", by="watcher") is False
    job.refresh_from_db()
    assert job.status == Status.COMPLETED
    assert ledger(job) == [(1, 1, "w1", "completed")]


def test_rescue__never_touches_a_job_taken_over_since_the_read() -> None:
    PaymentJob.objects.enqueue("a")
    expire(claim_one("w1"))
    stale = PaymentJob.objects.expired().get()
    claim_one("w2")
    assert PaymentJob.objects.rescue(stale, "retry", by="watcher") is False
    assert PaymentJob.objects.get(pk=stale.pk).lease_owner == "w2"


def test_rescue__review_and_failed_actions() -> None:
    PaymentJob.objects.enqueue("a")
    PaymentJob.objects.enqueue("a")
    a, b = PaymentJob.objects.claim("w1", ttl=60, limit=2)
    expire(a)
    expire(b)
    assert PaymentJob.objects.rescue(PaymentJob.objects.get(pk=a.pk), "review", by="watcher")
    assert PaymentJob.objects.rescue(
        PaymentJob.objects.get(pk=b.pk), "failed", by="watcher", reason="no attempts left"
    )
    assert PaymentJob.objects.get(pk=a.pk).status == Status.REVIEW
    failed = PaymentJob.objects.get(pk=b.pk)
    assert (failed.status, failed.last_error) == (Status.FAILED, "no attempts left")
    assert ledger(a)[0][3] == "review" and ledger(b)[0][3] == "failed"


REVIEW_CAPTURE = {"STUCK_POLICY_BY_KIND": {"capture": "review"}}


@override_settings(DJANGO_LEASES=REVIEW_CAPTURE)
def test_checkpoint__refused_once_the_lease_expired_even_untaken() -> None:
    PaymentJob.objects.enqueue("capture")
    job = claim_one("w1")
    expire(job)
    # The watcher reads an empty checkpoint and decides "retry"...
    stale = PaymentJob.objects.expired().get()
    assert stale.checkpoint == ""
    # ...so the paused holder, waking up, must not record that it is about to call the PSP.
    with pytest.raises(LeaseLost):
        PaymentJob.objects.checkpoint(job.pk, "w1", job.lease_token, "psp_called")
    assert PaymentJob.objects.get(pk=job.pk).checkpoint == ""
    assert PaymentJob.objects.rescue(stale, "retry", by="watcher")
    row = JobAttempt.objects.get(job_ref=job.pk)
    assert (row.outcome, row.checkpoint) == ("rescued", "")
    assert row.fenced_at is not None


@override_settings(DJANGO_LEASES=REVIEW_CAPTURE)
@pytest.mark.parametrize("orphaned", [False, True])
def test_rescue__refused_when_the_checkpoint_changed_since_the_read(orphaned: bool) -> None:
    PaymentJob.objects.enqueue("capture")
    job = claim_one("w1")
    read = PaymentJob.objects.get(pk=job.pk)  # what the watcher decided "retry" on
    PaymentJob.objects.checkpoint(job.pk, "w1", job.lease_token, "psp_called")
    if not orphaned:
        expire(job)
    assert not PaymentJob.objects.rescue(read, "retry", by="watcher", orphaned=orphaned)
    current = PaymentJob.objects.get(pk=job.pk)
    assert (current.status, current.checkpoint) == (Status.PROCESSING, "psp_called")
    assert JobAttempt.objects.get(job_ref=job.pk).outcome == "running"
    # Read again, the checkpoint decides "review", and that rescue wins.
    assert PaymentJob.objects.rescue(current, "review", by="watcher", orphaned=orphaned)
    assert PaymentJob.objects.get(pk=job.pk).status == Status.REVIEW


def test_rescue__refused_when_max_attempts_changed_since_the_read() -> None:
    PaymentJob.objects.enqueue("a", max_attempts=1)
    job = claim_one("w1")
    expire(job)
    read = PaymentJob.objects.expired().get()  # no attempts left: the watcher decides "failed"
    PaymentJob.objects.filter(pk=job.pk).update(max_attempts=3)
    assert not PaymentJob.objects.rescue(read, "failed", by="watcher")
    assert PaymentJob.objects.get(pk=job.pk).status == Status.PROCESSING
