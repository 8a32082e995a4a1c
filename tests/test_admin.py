"""The operators' admin, as a logged-in superuser: columns, filters, actions, the overview."""

import json
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection, transaction
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_leases.admin.display import EMPTY
from django_leases.admin.payments import PaymentJobAdmin
from django_leases.exceptions import Cancelled, LeaseLost
from django_leases.handlers import registered_kinds
from django_leases.models import JobAttempt, PaymentJob, Worker
from django_leases.querysets import LeaseQuerySet
from django_leases.stats import Tally
from django_leases.tables import queue_history

from . import throttled
from .conftest import ON_SQLITE, Processes, wait_for
from .testapp.models import PayoutJob

pytestmark = pytest.mark.django_db

Status = PaymentJob.Status
CHANGELIST = "admin:django_leases_paymentjob_changelist"
OVERVIEW = "admin:django_leases_paymentjob_overview"
OPERATOR = "admin:admin"  # the `admin_client` user, as the ledger names it
STATES = ("pending", "healthy", "near", "stuck", "completed", "failed", "review", "cancelled")


def expire(pk: int, seconds: float = 5) -> None:
    """Make the job's lease end `seconds` ago, by the database clock."""
    PaymentJob.objects.filter(pk=pk).update(lease_until=Now() - timedelta(seconds=seconds))


def claim(pk: int, owner: str, ttl: float = 600) -> PaymentJob:
    job = PaymentJob.objects.claim_job(pk, owner, ttl=ttl)
    assert job is not None
    return job


@pytest.fixture
def jobs() -> dict[str, PaymentJob]:
    """One job per state, each brought there through the lease API; "refund" for the stuck one."""
    made = {
        name: PaymentJob.objects.enqueue(
            "refund" if name == "stuck" else "capture",
            {"amount": 100},
            payment_id=f"pay_{name}",
            idempotency_key=f"key-{name}",
        )
        for name in STATES
    }
    tokens = {name: claim(made[name].pk, f"worker-{name}").lease_token for name in STATES[1:7]}
    PaymentJob.objects.filter(pk=made["near"].pk).update(lease_until=Now() + timedelta(seconds=10))
    expire(made["stuck"].pk)
    completed, failed, review = (made[n] for n in ("completed", "failed", "review"))
    PaymentJob.objects.complete(completed.pk, "worker-completed", tokens["completed"])
    PaymentJob.objects.fail(
        failed.pk, "worker-failed", tokens["failed"], ValueError("card declined"), permanent=True
    )
    expire(review.pk)
    assert PaymentJob.objects.rescue(PaymentJob.objects.get(pk=review.pk), "review", by="watcher")
    assert PaymentJob.objects.filter(pk=made["cancelled"].pk).cancel() == 1
    # A refund of the payment whose capture is running waits for it.
    made["waiting"] = PaymentJob.objects.enqueue("refund", payment_id="pay_healthy")
    for job in made.values():
        job.refresh_from_db()
    return made


def changelist(client: Client, **params: str) -> Any:
    response = client.get(reverse(CHANGELIST), params)
    assert response.status_code == 200
    return response


def listed(response: Any) -> set[int]:
    return {job.pk for job in response.context["cl"].result_list}


def row(response: Any, job: PaymentJob) -> str:
    """The changelist's table row of `job`, as HTML."""
    html = response.content.decode()
    (match,) = re.findall(
        rf'<tr>(?:(?!</tr>).)*?value="{job.pk}" class="action-select".*?</tr>', html, re.S
    )
    return match


# The reason an operator gives in the action bar (the dangerous actions refuse to run without).
REASON = "checked with the PSP"


def act(client: Client, action: str, *selected: PaymentJob, reason: str = REASON) -> list[str]:
    response = client.post(
        reverse(CHANGELIST),
        # "post": what an action's confirmation page sends once the operator confirms.
        {
            "action": action,
            "_selected_action": [job.pk for job in selected],
            "post": "yes",
            "reason": reason,
        },
        follow=True,
    )
    assert response.status_code == 200
    return [str(message) for message in response.context["messages"]]


def snapshot() -> dict[int, tuple[Any, ...]]:
    """The state an action may change, per job: status, lease, attempts, error and ledger."""
    ledger: dict[int, list[tuple[Any, ...]]] = {}
    for attempt in JobAttempt.objects.order_by("job_ref", "token"):
        ledger.setdefault(attempt.job_ref, []).append(
            (attempt.token, attempt.outcome, attempt.ended_by, attempt.ended_at is None)
        )
    return {
        job.pk: (
            job.status,
            job.lease_owner,
            job.lease_token,
            job.attempts,
            job.max_attempts,
            job.last_error,
            job.completed_at is None,
            tuple(ledger.get(job.pk, [])),
        )
        for job in PaymentJob.objects.all()
    }


def would(method: Callable[[LeaseQuerySet[Any]], int]) -> dict[int, tuple[Any, ...]]:
    """The snapshot after `method` ran on every job, rolled back."""
    with transaction.atomic():
        method(PaymentJob.objects.all())
        after = snapshot()
        transaction.set_rollback(True)
    return after


# ---- columns --------------------------------------------------------------------------------


def test_changelist__renders_every_column(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    response = changelist(admin_client)
    assert listed(response) == {job.pk for job in jobs.values()}
    headers = re.findall(r'<th scope="col" class="[^"]*column-([a-z_]+)', response.content.decode())
    assert headers == list(PaymentJobAdmin.list_display)
    assert {"status_badge", "lease", "owner", "attempts_of_max", "heartbeat"} < set(headers)

    stuck = row(response, jobs["stuck"])
    assert ">refund<" in stuck and ">pay_stuck<" in stuck
    assert '<span class="dl-badge dl-processing">Processing</span>' in stuck
    assert ">worker-stuck<" in stuck and ">1 / 5<" in stuck
    assert re.search(r'dl-stuck">Stuck</span> <span class="dl-when">expired [5-9] s ago', stuck)
    assert re.search(
        r'<td class="field-heartbeat"><time datetime="[^"]+" title="[^"]+">'
        r"(\d{4}-\d\d-\d\d )?\d\d:\d\d:\d\d</time>"
        r' <span class="dl-when">\d+ s ago</span></td>',
        stuck,
    )

    near = row(response, jobs["near"])
    assert re.search(
        r'dl-near_expiry">Near expiry</span> <span class="dl-when">([5-9]|10) s left', near
    )
    healthy = row(response, jobs["healthy"])
    assert re.search(r'dl-healthy">Healthy</span> <span class="dl-when">9 min 5\d s left', healthy)

    failed = row(response, jobs["failed"])
    assert '<span title="ValueError: card declined">ValueError: card declined</span>' in failed
    # A finished job keeps its last owner, shown as such, and has no lease.
    assert 'title="last holder">worker-failed<' in failed
    assert '<td class="field-lease">—</td>' in failed
    pending = row(response, jobs["pending"])
    assert ">0 / 5<" in pending and '<td class="field-owner">—</td>' in pending


def test_changelist__long_error_is_cut_and_whole_in_tooltip(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture")
    token = claim(job.pk, "w1").lease_token
    message = "PSP said: <b>" + "x" * 200
    PaymentJob.objects.fail(job.pk, "w1", token, message, permanent=True)
    html = row(changelist(admin_client), job)
    assert 'title="PSP said: &lt;b&gt;xxx' in html
    assert ">PSP said: &lt;b&gt;" + "x" * 46 + "…</span>" in html


def test_changelist__exhausted_attempts_are_flagged(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture", max_attempts=1)
    claim(job.pk, "w1")
    assert '<span class="dl-attempts dl-exhausted">1 / 1</span>' in row(
        changelist(admin_client), job
    )


def test_changelist__sorts_by_time_left(admin_client: Client, jobs: dict[str, PaymentJob]) -> None:
    column = changelist(admin_client).context["cl"].list_display.index("lease")
    order = [job.pk for job in changelist(admin_client, o=str(column)).context["cl"].result_list]
    processing = [pk for pk in order if pk in {jobs[n].pk for n in ("stuck", "near", "healthy")}]
    assert processing == [jobs["stuck"].pk, jobs["near"].pk, jobs["healthy"].pk]


# ---- filters --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [("stuck", "stuck"), ("near_expiry", "near"), ("healthy", "healthy")],
)
def test_lease_filter__returns_the_queryset_rows(
    admin_client: Client, jobs: dict[str, PaymentJob], value: str, expected: str
) -> None:
    assert listed(changelist(admin_client, lease=value)) == {jobs[expected].pk}


def test_lease_filter__choices_read_stuck_and_near_expiry(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    html = changelist(admin_client).content.decode()
    for label in ("Stuck (lease expired)", "Near expiry", "Healthy"):
        assert f">{label}</a>" in html


def test_lease_filter__follows_near_expiry_setting(
    admin_client: Client, jobs: dict[str, PaymentJob], settings: Any
) -> None:
    settings.DJANGO_LEASES = {"NEAR_EXPIRY": 5}
    assert listed(changelist(admin_client, lease="near_expiry")) == set()
    assert listed(changelist(admin_client, lease="healthy")) == {
        jobs["near"].pk,
        jobs["healthy"].pk,
    }


def run_for(job: PaymentJob, ago: timedelta) -> None:
    """Make the job's open attempt start `ago`, by the database clock (its lease stays live)."""
    JobAttempt.objects.filter(job_ref=job.pk, ended_at__isnull=True).update(claimed_at=Now() - ago)


def test_lease_filter__running_long_by_the_kinds_limit(
    admin_client: Client, jobs: dict[str, PaymentJob], settings: Any
) -> None:
    settings.DJANGO_LEASES = {"LONG_RUNNING": 1800}
    run_for(jobs["healthy"], timedelta(hours=1))  # heartbeating fine, yet an hour in
    run_for(jobs["near"], timedelta(minutes=10))
    hangs = claim(PaymentJob.objects.enqueue("hangs").pk, "worker-hangs")
    run_for(hangs, timedelta(seconds=30))  # past its handler's timeout of 1.5 s
    assert listed(changelist(admin_client, lease="running_long")) == {jobs["healthy"].pk, hangs.pk}
    html = changelist(admin_client).content.decode()
    assert ">Running long</a>" in html
    long_row, short_row = (
        row(changelist(admin_client), jobs["healthy"]),
        row(changelist(admin_client), jobs["near"]),
    )
    assert re.search(r"Running long</span> <span class=\"dl-when\">1 h 0 min", long_row)
    # Seconds pass between the UPDATE and the page on a loaded machine.
    assert "Running long" not in short_row and re.search(r">10 min \d{1,2} s<", short_row)


def test_changelist__sorts_by_running_time(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    run_for(jobs["healthy"], timedelta(hours=1))
    column = changelist(admin_client).context["cl"].list_display.index("running_for")
    shown = changelist(admin_client, o=f"-{column}").context["cl"].result_list
    processing = [job.pk for job in shown if job.status == Status.PROCESSING]
    assert processing[0] == jobs["healthy"].pk


def test_overview__counts_and_lists_long_runners(
    admin_client: Client, jobs: dict[str, PaymentJob], settings: Any
) -> None:
    settings.DJANGO_LEASES = {"LONG_RUNNING": 1800}
    run_for(jobs["healthy"], timedelta(hours=2))
    run_for(jobs["stuck"], timedelta(hours=1))
    run_for(jobs["near"], timedelta(minutes=5))
    response = admin_client.get(reverse(OVERVIEW))
    data = response.context["overview"]
    assert data.running_long == 2
    assert [job.pk for job in data.long_runners] == [jobs["healthy"].pk, jobs["stuck"].pk]
    html = response.content.decode()
    assert re.search(r'id="dl-running-long".*?<span class="dl-value">2</span>', html, re.S)
    assert "?lease=running_long" in html and "pay_healthy" in html


def test_overview__lists_the_limits_per_kind(admin_client: Client, jobs: Any) -> None:
    throttled.register()
    try:
        html = admin_client.get(reverse(OVERVIEW)).content.decode()
    finally:
        throttled.unregister()
    # Limit in use and rate in use, each against its bound.
    assert kind_cells(html, "capped")[5:7] == ["0 / 2", "—"]
    assert kind_cells(html, "rated")[5:7] == ["—", "0 / 3 per 1 s"]
    html = admin_client.get(reverse(OVERVIEW)).content.decode()
    assert 'data-kind="capped"' not in html


@pytest.mark.parametrize("status", [s for s in Status.values if s != Status.STOPPING])
def test_status_filter__returns_jobs_of_that_status(
    admin_client: Client, jobs: dict[str, PaymentJob], status: str
) -> None:
    expected = {job.pk for job in jobs.values() if job.status == status}
    assert expected
    assert listed(changelist(admin_client, status=status)) == expected


def test_status_filter__lists_a_stopping_job_with_the_holder_that_runs_it(
    admin_client: Client,
) -> None:
    job = PaymentJob.objects.enqueue("capture", payment_id="pay_stop")
    claim(job.pk, "worker-stop")
    assert PaymentJob.objects.filter(pk=job.pk).cancel(by="ops") == 1
    response = changelist(admin_client, status=Status.STOPPING)
    assert listed(response) == {job.pk}
    html = row(response, job)
    assert "dl-stopping" in html and "Stopping" in html and "last holder" not in html, html


def test_time_filter__due_now_and_finished_in_the_last_hour(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    later = PaymentJob.objects.enqueue("capture", run_at=3600)
    old = PaymentJob.objects.enqueue("capture")
    PaymentJob.objects.filter(pk=old.pk).update(
        status=Status.COMPLETED, completed_at=Now() - timedelta(minutes=61)
    )
    assert listed(changelist(admin_client, when="due")) == {jobs["pending"].pk}
    assert later.pk in listed(changelist(admin_client, status="pending"))
    finished = {jobs[n].pk for n in ("completed", "failed", "cancelled")}
    assert listed(changelist(admin_client, when="last_hour")) == finished
    assert listed(changelist(admin_client, status="completed", when="last_hour")) == {
        jobs["completed"].pk
    }


def test_lock_filter__blocked_and_holding(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    holders = {job.pk for job in jobs.values() if job.lock_holder}
    # Every job of the fixture has a payment, so each live one holds its payment's lock.
    assert holders == {jobs[n].pk for n in ("pending", "healthy", "near", "stuck", "review")}
    assert listed(changelist(admin_client, locked="blocked")) == {jobs["waiting"].pk}
    assert listed(changelist(admin_client, locked="holding")) == holders


def test_lock_column__names_the_job_a_waiting_job_waits_for(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    response = changelist(admin_client)
    holder = jobs["healthy"].pk
    link = reverse("admin:django_leases_paymentjob_change", args=[holder])
    waiting = row(response, jobs["waiting"])
    assert f'waiting for job <a href="{link}">#{holder}</a> (same lock)' in waiting
    assert 'title="holds its lock">payment:pay_healthy<' in row(response, jobs["healthy"])
    page = admin_client.get(
        reverse("admin:django_leases_paymentjob_change", args=[jobs["waiting"].pk])
    )
    assert f'<a href="{link}">#{holder}</a>' in page.content.decode()


@pytest.mark.parametrize(
    ("name", "state"),
    [
        ("waiting", "waiting for job"),
        ("healthy", "holds its lock"),
        ("completed", EMPTY),
    ],
)
def test_change_form__shows_the_lock_once_and_its_state_beside_it(
    admin_client: Client, jobs: dict[str, PaymentJob], name: str, state: str
) -> None:
    html = admin_client.get(change_url(jobs[name])).content.decode()
    labels = re.findall(r"<label[^>]*>([^<]*):</label>", html)
    assert labels.count("Lock") == 1 and labels.count("Lock state") == 1, labels
    # Each field's box holds its label, help text (after the label on Django 6) and value.
    lock, position = (
        re.search(rf'fieldBox field-{field}">.*?<div class="readonly">(.*?)</div>', html, re.S)
        for field in ("lock", "lock_position")
    )
    assert lock is not None and position is not None
    assert lock.group(1) == f"payment:pay_{'healthy' if name == 'waiting' else name}"
    assert state in position.group(1)


def test_kind_filter__offers_registered_and_live_kinds(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    PaymentJob.objects.filter(pk=jobs["completed"].pk).update(kind="archived")
    response = changelist(admin_client)
    cl = response.context["cl"]
    kinds = [choice["display"] for choice in cl.filter_specs[3].choices(cl)]
    # The test app's handlers, and the kinds of pending and processing jobs; not "archived",
    # which only a finished job has (finding it would scan the table).
    assert kinds == ["All", *sorted({*registered_kinds(), "capture", "refund"})]
    assert "noop" in kinds and "archived" not in kinds
    assert listed(changelist(admin_client, kind="refund")) == {jobs["stuck"].pk, jobs["waiting"].pk}
    assert listed(changelist(admin_client, kind="archived")) == {jobs["completed"].pk}


def test_filters__combine(admin_client: Client, jobs: dict[str, PaymentJob]) -> None:
    assert listed(changelist(admin_client, lease="stuck", kind="capture")) == set()
    assert listed(changelist(admin_client, status="processing", kind="capture")) == {
        jobs["healthy"].pk,
        jobs["near"].pk,
    }


def test_filters__facet_counts_render(admin_client: Client, jobs: dict[str, PaymentJob]) -> None:
    html = changelist(admin_client, _facets="1").content.decode()
    assert "Stuck (lease expired) (1)" in html
    assert "Under review (1)" in html


@pytest.mark.parametrize(
    ("term", "expected"),
    [
        ("pay_near", {"near"}),
        ("key-failed", {"failed"}),
        ("worker-he", {"healthy"}),  # the start of the owner of a processing job
        ("worker-failed", set()),  # a finished job's last owner is in the ledger, not here
        ("pay_", set()),  # payment ids and keys match exactly
    ],
)
def test_search__payment_id_key_and_owner(
    admin_client: Client, jobs: dict[str, PaymentJob], term: str, expected: set[str]
) -> None:
    assert listed(changelist(admin_client, q=term)) == {jobs[name].pk for name in expected}


# ---- actions --------------------------------------------------------------------------------

ACTIONS: dict[str, Callable[[LeaseQuerySet[Any]], int]] = {
    "requeue": lambda jobs: jobs.requeue(by=OPERATOR),
    "force_requeue": lambda jobs: jobs.requeue(force=True, by=OPERATOR),
    "release_stuck": lambda jobs: jobs.release_stuck(by=OPERATOR),
    "mark_failed": lambda jobs: jobs.mark_failed(
        reason=f"marked failed by {OPERATOR}: {REASON}", by=OPERATOR
    ),
    "cancel": lambda jobs: jobs.cancel(running=False, by=OPERATOR, reason=REASON),
    "force_cancel": lambda jobs: jobs.cancel(by=OPERATOR, reason=REASON),
    "resolve_review_completed": lambda jobs: jobs.resolve_review("completed", by=OPERATOR),
    "resolve_review_retry": lambda jobs: jobs.resolve_review("retry", by=OPERATOR),
    "resolve_review_failed": lambda jobs: jobs.resolve_review("failed", by=OPERATOR),
}


def fenced(
    states: dict[int, tuple[Any, ...]], before: dict[int, tuple[Any, ...]]
) -> dict[int, tuple[Any, ...]]:
    """`states` with each fencing token that grew past its value in `before` written "new": a
    new token is a database-clock number, its value differs between two runs of an action."""
    return {
        pk: (*state[:2], "new" if state[2] > before[pk][2] else state[2], *state[3:])
        for pk, state in states.items()
    }


@pytest.mark.parametrize("action", list(ACTIONS))
def test_action__changes_exactly_the_rows_its_queryset_method_would(
    admin_client: Client, jobs: dict[str, PaymentJob], action: str
) -> None:
    before = snapshot()
    expected = would(ACTIONS[action])
    changed = {pk for pk in before if expected[pk] != before[pk]}
    assert changed, "the method changes nothing here: the test proves nothing"

    messages = act(admin_client, action, *jobs.values())

    assert fenced(snapshot(), before) == fenced(expected, before)
    (message,) = messages
    assert re.match(rf"{len(changed)} (stuck )?jobs? ", message), message
    assert f"; {len(jobs) - len(changed)} skipped: " in message


def test_action__only_the_selected_jobs(admin_client: Client, jobs: dict[str, PaymentJob]) -> None:
    before = snapshot()
    act(admin_client, "cancel", jobs["healthy"])
    assert snapshot() == before


def test_requeue__refuses_a_healthy_lease_and_says_why(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    healthy = jobs["healthy"]
    before = snapshot()
    messages = act(admin_client, "requeue", healthy)
    assert messages == ["0 jobs requeued; 1 skipped: its lease is live — use “Force requeue”"]
    assert snapshot() == before
    # The holder still owns the job and can complete it.
    PaymentJob.objects.complete(healthy.pk, "worker-healthy", healthy.lease_token)


def test_requeue__mixed_selection_reports_each_reason(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    picked = [jobs[n] for n in ("stuck", "failed", "review", "healthy", "near", "completed")]
    messages = act(admin_client, "requeue", *picked)
    assert messages == [
        "3 jobs requeued; 3 skipped: its lease is live — use “Force requeue” (2); "
        "completed jobs are never requeued (1)"
    ]
    statuses = dict(
        PaymentJob.objects.filter(pk__in=[j.pk for j in picked]).values_list("pk", "status")
    )
    assert [statuses[j.pk] for j in picked] == ["pending"] * 3 + ["processing"] * 2 + ["completed"]


def test_force_requeue__fences_out_the_holder(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    healthy = jobs["healthy"]
    assert act(admin_client, "force_requeue", healthy) == ["1 job requeued by force"]
    job = PaymentJob.objects.get(pk=healthy.pk)
    assert job.status == Status.PENDING and job.lease_token > healthy.lease_token
    with pytest.raises(LeaseLost):
        PaymentJob.objects.complete(healthy.pk, "worker-healthy", healthy.lease_token)
    attempt = JobAttempt.objects.get(job_ref=healthy.pk, token=healthy.lease_token)
    assert (attempt.outcome, attempt.ended_by) == ("requeued", OPERATOR)
    assert attempt.fenced_at is not None
    assert PaymentJob.objects.get(pk=healthy.pk).status == Status.PENDING


def test_force_requeue__names_the_force_in_the_action_list(admin_client: Client) -> None:
    choices = dict(changelist(admin_client).context["action_form"].fields["action"].choices)
    assert "Force" in choices["force_requeue"] and "Force" not in choices["requeue"]
    assert "delete_selected" not in choices


def test_release_stuck__only_the_expired_lease(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    picked = [jobs[n] for n in ("stuck", "near", "pending")]
    assert act(admin_client, "release_stuck", *picked) == [
        "1 stuck job released; 2 skipped: its lease is live, so it is not stuck (1); "
        "not processing, so there is no lease to release (1)"
    ]
    stuck = PaymentJob.objects.get(pk=jobs["stuck"].pk)
    assert (stuck.status, stuck.attempts) == (Status.PENDING, 1)
    assert PaymentJob.objects.get(pk=jobs["near"].pk).status == Status.PROCESSING
    attempt = JobAttempt.objects.get(job_ref=stuck.pk)
    assert (attempt.outcome, attempt.ended_by) == ("rescued", OPERATOR)


def test_mark_failed__never_a_live_lease(admin_client: Client, jobs: dict[str, PaymentJob]) -> None:
    picked = [jobs[n] for n in ("pending", "stuck", "healthy", "completed")]
    assert act(admin_client, "mark_failed", *picked) == [
        "2 jobs marked failed; 2 skipped: its lease is live and its holder may still be working "
        "(1); already finished (1)"
    ]
    rows = dict(PaymentJob.objects.values_list("pk", "status"))
    assert [rows[j.pk] for j in picked] == ["failed", "failed", "processing", "completed"]
    assert (
        PaymentJob.objects.get(pk=jobs["stuck"].pk).last_error
        == f"marked failed by {OPERATOR}: {REASON}"
    )


def test_cancel__pending_only(admin_client: Client, jobs: dict[str, PaymentJob]) -> None:
    assert act(admin_client, "cancel", jobs["pending"], jobs["stuck"]) == [
        "1 job cancelled; 1 skipped: only pending or waiting jobs can be cancelled — use “Force "
        "cancel”"
    ]
    assert PaymentJob.objects.get(pk=jobs["pending"].pk).status == Status.CANCELLED
    assert PaymentJob.objects.get(pk=jobs["stuck"].pk).status == Status.PROCESSING


def test_force_cancel__asks_first_then_tells_the_running_holder_to_stop(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    healthy, before = jobs["healthy"], snapshot()
    data = {
        "action": "force_cancel",
        "_selected_action": [healthy.pk, jobs["completed"].pk],
        "reason": REASON,
    }
    page = admin_client.post(reverse(CHANGELIST), data)
    assert page.status_code == 200
    text = page.content.decode()
    assert "told to stop within one heartbeat interval" in text and "2 jobs selected" in text
    assert snapshot() == before

    confirmed = admin_client.post(reverse(CHANGELIST), {**data, "post": "yes"}, follow=True)
    assert [str(m) for m in confirmed.context["messages"]] == [
        "1 job cancelled by force; 1 skipped: already finished or under review"
    ]
    job = PaymentJob.objects.get(pk=healthy.pk)
    # Its handler may still run: stopping until its worker acknowledges (no worker here).
    assert (job.status, job.ends_as, job.last_error) == (
        Status.STOPPING,
        Status.CANCELLED,
        f"cancelled by {OPERATOR}: {REASON}",
    )
    with pytest.raises(Cancelled):
        PaymentJob.objects.complete(healthy.pk, "worker-healthy", healthy.lease_token)


@pytest.mark.parametrize(
    ("action", "status", "text"),
    [
        ("resolve_review_completed", "completed", "completed"),
        ("resolve_review_retry", "pending", "sent back to pending"),
        ("resolve_review_failed", "failed", "failed"),
    ],
)
def test_resolve_review__each_verdict(
    admin_client: Client, jobs: dict[str, PaymentJob], action: str, status: str, text: str
) -> None:
    assert act(admin_client, action, jobs["review"], jobs["pending"]) == [
        f"1 job under review {text}; 1 skipped: not under review"
    ]
    assert PaymentJob.objects.get(pk=jobs["review"].pk).status == status
    assert PaymentJob.objects.get(pk=jobs["pending"].pk).status == Status.PENDING


def test_actions__need_change_permission(
    client: Client, django_user_model: Any, jobs: dict[str, PaymentJob]
) -> None:
    viewer = django_user_model.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_paymentjob"))
    client.force_login(viewer)
    response = changelist(client)
    assert response.context["action_form"] is None
    client.post(
        reverse(CHANGELIST), {"action": "force_requeue", "_selected_action": [jobs["healthy"].pk]}
    )
    assert PaymentJob.objects.get(pk=jobs["healthy"].pk).status == Status.PROCESSING
    assert client.get(reverse(OVERVIEW)).status_code == 200


# ---- the change form and the ledger -------------------------------------------------------


def change_url(job: PaymentJob) -> str:
    return reverse("admin:django_leases_paymentjob_change", args=[job.pk])


def test_change_form__lease_fields_are_read_only(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    response = admin_client.get(change_url(jobs["stuck"]))
    assert response.status_code == 200
    assert set(response.context["adminform"].form.fields) == set()  # not pending
    html = response.content.decode()
    assert re.search(r'dl-stuck">Stuck</span> <span class="dl-when">expired \d+ s ago', html)
    assert "worker-stuck" in html


def test_change_form__inline_ledger_newest_first(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture")
    first = claim(job.pk, "first-owner").lease_token
    expire(job.pk)
    second = claim(job.pk, "second-owner").lease_token
    with pytest.raises(LeaseLost):
        PaymentJob.objects.complete(job.pk, "first-owner", first)
    response = admin_client.get(change_url(job))
    inline = response.context["inline_admin_formsets"][0]
    rows = [form.original for form in inline]
    assert [(a.token, a.owner, a.outcome) for a in rows] == [
        (second, "second-owner", "running"),
        (first, "first-owner", "lease_lost"),
    ]
    assert first < second
    assert rows[1].fenced_at is not None
    html = response.content.decode()
    assert html.index("second-owner") < html.index("first-owner")
    assert not inline.has_add_permission and not inline.has_change_permission


def test_change_form__operator_events_beside_the_unchanged_ledger(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture", max_attempts=1)
    token = claim(job.pk, "w1").lease_token
    PaymentJob.objects.fail(job.pk, "w1", token, ValueError("card declined"))
    assert act(admin_client, "requeue", job) == ["1 job requeued"]
    assert act(admin_client, "mark_failed", job) == ["1 job marked failed"]

    response = admin_client.get(change_url(job))

    ledger, events = response.context["inline_admin_formsets"]
    assert [(a.token, a.owner, a.outcome, a.ended_by) for a in (f.original for f in ledger)] == [
        (token, "w1", "failed", "w1")
    ]
    assert [(e.action, e.by, e.attempts) for e in (f.original for f in events)] == [
        ("failed", OPERATOR, 1),
        ("requeued", OPERATOR, 1),
    ]
    html = response.content.decode()
    assert "Operator events (newest first)" in html and "Marked failed" in html
    assert "marked failed by admin:admin" in html
    assert not events.has_add_permission and not events.has_change_permission
    assert not events.has_delete_permission


def test_change_form__timed_out_attempt_reads_readably(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture")
    token = claim(job.pk, "w1").lease_token
    PaymentJob.objects.time_out(job.pk, "w1", token, retry_in=None, reason="ran past 1.5 s")

    html = admin_client.get(change_url(job)).content.decode()

    assert "Timed out (ran past its kind&#x27;s timeout)" in html
    ledger = admin_client.get(
        reverse("admin:django_leases_jobattempt_changelist"), {"outcome__exact": "timed_out"}
    )
    assert "Timed out (ran past" in ledger.content.decode()
    assert [a.pk for a in ledger.context["cl"].result_list] == [
        JobAttempt.objects.get(job_ref=job.pk).pk
    ]


def form_data(**fields: str) -> dict[str, str]:
    management = {
        f"{inline}-{name}": "0"
        for inline in ("attempt_log", "event_log")
        for name in ("TOTAL_FORMS", "INITIAL_FORMS", "MIN_NUM_FORMS", "MAX_NUM_FORMS")
    }
    return {"reason": REASON, **fields, **management, "_save": "Save"}


def warnings_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"] if m.level_tag == "warning"]


def test_change_form__save_of_a_pending_job_restates_pending(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    data = form_data(priority="7", payload=json.dumps({"amount": 2}))
    with CaptureQueriesContext(connection) as ctx:
        response = admin_client.post(change_url(job), data)
    assert response.status_code == 302
    job.refresh_from_db()
    assert (job.priority, job.payload, job.status) == (7, {"amount": 2}, "pending")
    updates = [q["sql"] for q in ctx.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(updates) == 1
    set_clause, where = updates[0].split(" WHERE ")
    assert "lease_" not in set_clause and "status" not in set_clause
    assert "status" in where and "'pending'" in where.replace('"', "'")


def test_change_form__a_payload_over_max_payload_bytes_is_a_form_error(
    admin_client: Client,
) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    with override_settings(DJANGO_LEASES={"MAX_PAYLOAD_BYTES": 20}):
        data = form_data(priority="0", payload=json.dumps({"amount": "1" * 20}))
        response = admin_client.post(change_url(job), data)
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["payload"]
    assert errors == ["payload is 34 bytes as JSON, more than MAX_PAYLOAD_BYTES (20): store "
                      "large data elsewhere and pass its reference"]  # fmt: skip
    job.refresh_from_db()
    assert job.payload == {"amount": 1}


def test_changelist__loads_no_payload_and_no_result(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture", {"blob": "x" * 1000})
    claimed = PaymentJob.objects.claim_job(job.pk, "w", ttl=60)
    assert claimed is not None
    PaymentJob.objects.complete(job.pk, "w", claimed.lease_token, result={"r": "y" * 1000})
    with CaptureQueriesContext(connection) as ctx:
        response = changelist(admin_client)
    assert listed(response) == {job.pk}
    payload, result = (connection.ops.quote_name(name) for name in ("payload", "result"))
    rows = [
        q["sql"] for q in ctx.captured_queries if f"{payload}" in q["sql"] or "x" * 100 in q["sql"]
    ]
    assert rows == [], rows
    assert not any(result in q["sql"] for q in ctx.captured_queries)
    assert "x" * 1000 not in response.content.decode()


def test_change_form__job_claimed_while_the_form_was_open_is_not_changed(
    admin_client: Client,
) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    assert set(admin_client.get(change_url(job)).context["adminform"].form.fields) == {
        "priority",
        "payload",
        "reason",
    }
    # A worker claims the job while the operator's form is open.
    claimed = claim(job.pk, "w1")
    response = admin_client.post(
        change_url(job), form_data(priority="7", payload=json.dumps({"amount": 2})), follow=True
    )
    assert response.status_code == 200
    (warning,) = warnings_of(response)
    assert f"Nothing was saved: job {job.pk} is Processing now" in warning
    job.refresh_from_db()
    assert (job.priority, job.payload) == (0, {"amount": 1})
    assert (job.status, job.lease_owner, job.lease_token) == (
        "processing",
        "w1",
        claimed.lease_token,
    )
    renewed = PaymentJob.objects.heartbeat("w1", {job.pk: claimed.lease_token}, ttl=60)
    assert renewed == {(job.pk, claimed.lease_token)}
    assert not LogEntry.objects.exists(), "the history must not claim a change"


def test_change_form__claimed_between_form_check_and_update_is_not_changed(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The UPDATE itself restates pending: a claim that lands after the form was validated
    still wins, and the operator is told."""
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    validate = PaymentJobAdmin.save_model

    def claim_first(self: Any, request: Any, obj: Any, form: Any, change: bool) -> None:
        claim(job.pk, "w1")
        validate(self, request, obj, form, change)

    monkeypatch.setattr(PaymentJobAdmin, "save_model", claim_first)
    response = admin_client.post(
        change_url(job), form_data(priority="7", payload=json.dumps({"amount": 2})), follow=True
    )
    (warning,) = warnings_of(response)
    assert f"job {job.pk} left pending" in warning
    job.refresh_from_db()
    assert (job.priority, job.payload, job.status) == (0, {"amount": 1}, "processing")


def test_change_form__only_pending_jobs_are_editable(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    for name, job in jobs.items():
        fields = set(admin_client.get(change_url(job)).context["adminform"].form.fields)
        expected = {"priority", "payload", "reason"} if name == "pending" else set()
        assert fields == expected, name


def test_change_form__task_payload_is_never_editable(admin_client: Client) -> None:
    payload = {
        "task": "tests.testapp.tasks.add",
        "args": [1, 2],
        "kwargs": {},
        "backend": "default",
    }
    job = PaymentJob.objects.enqueue("tasks.default", payload)
    form = admin_client.get(change_url(job)).context["adminform"].form
    assert set(form.fields) == {"priority", "reason"}

    crafted = {**payload, "task": "os.system", "args": ["id"]}
    response = admin_client.post(
        change_url(job), form_data(priority="3", payload=json.dumps(crafted)), follow=True
    )
    (warning,) = warnings_of(response)
    assert "payload of task job" in warning
    job.refresh_from_db()
    assert (job.payload, job.priority) == (payload, 0)

    admin_client.post(change_url(job), form_data(priority="3"))
    job.refresh_from_db()
    assert (job.payload, job.priority) == (payload, 3)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"payload": json.dumps({"card": "41\u0000"}), "priority": "0"}, "NUL"),
        ({"payload": "[" * 40 + "]" * 40, "priority": "0"}, "nested deeper"),
        ({"payload": "{}", "priority": "40000"}, "32767"),
    ],
)
def test_change_form__bad_values_are_form_errors(
    admin_client: Client, fields: dict[str, str], error: str
) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    response = admin_client.post(change_url(job), form_data(**fields))
    assert response.status_code == 200
    assert error in str(response.context["adminform"].form.errors)
    job.refresh_from_db()
    assert (job.payload, job.priority) == ({"amount": 1}, 0)


OVER_UPLOAD_LIMIT = json.dumps({"note": "x" * 3_000_000})
# What an operator (or a crafted request) may post in each editable field of a pending job.
HOSTILE_PAYLOADS = {
    "empty": "",
    "json null": "null",
    "whitespace": "  ",
    "raw NUL": "\x00",
    "NUL in a string": json.dumps({"card": "41\u0000"}),
    "lone surrogate escape": '{"card": "\\ud800"}',
    "lone surrogate key": '{"\\udfff": 1}',
    "not JSON": "{card: 4111}",
    "NaN": "NaN",
    "Infinity": '{"amount": Infinity}',
    "nested 32 deep": "[" * 32 + "]" * 32,
    "nested 100000 deep": "[" * 100_000 + "]" * 100_000,
    "integer of 65 bits": '{"amount": 18446744073709551616}',
    "integer of 5000 digits": '{"amount": ' + "9" * 5000 + "}",
    "a megabyte": json.dumps({"note": "x" * 1_000_000}),
    "over the upload limit": OVER_UPLOAD_LIMIT,
}
HOSTILE_PRIORITIES = {
    "empty": "",
    "raw NUL": "\x00",
    "NUL after digits": "7\x00",
    "lone surrogate escape": "\\ud800",
    "not a number": "high",
    "fraction": "1.5",
    "out of range": "40000",
    "below range": "-40000",
    "integer of 65 bits": "18446744073709551616",
    "integer of 5000 digits": "9" * 5000,
    "over-long": "1" * 100_000,
}


def post_hostile(client: Client, url: str, field: str, value: str) -> Any:
    """Post `value` in `field` (the other field unchanged) and return the response."""
    fields = {"priority": "0", "payload": json.dumps({"amount": 1}), field: value}
    return client.post(url, form_data(**fields))


@pytest.mark.parametrize(
    ("field", "value"),
    [("payload", v) for v in HOSTILE_PAYLOADS.values()]
    + [("priority", v) for v in HOSTILE_PRIORITIES.values()],
    ids=[f"payload-{k}" for k in HOSTILE_PAYLOADS] + [f"priority-{k}" for k in HOSTILE_PRIORITIES],
)
def test_change_form__hostile_input_is_a_form_error_or_a_clean_save(
    admin_client: Client, field: str, value: str
) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    response = post_hostile(admin_client, change_url(job), field, value)
    job.refresh_from_db()
    if response.status_code == 302:  # saved: what enqueue() would have stored
        assert field == "payload", response
        assert job.payload == ({} if value in ("", "null") else json.loads(value))
        assert job.priority == 0
        return
    if value is OVER_UPLOAD_LIMIT:  # Django's DATA_UPLOAD_MAX_MEMORY_SIZE
        assert response.status_code == 400
        assert (job.payload, job.priority) == ({"amount": 1}, 0)
        return
    assert response.status_code == 200
    form = response.context["adminform"].form
    assert set(form.errors) == {field}, form.errors
    assert (job.payload, job.priority) == ({"amount": 1}, 0)
    # The page re-renders what was posted, and is valid UTF-8.
    response.content.decode("utf-8")
    assert not LogEntry.objects.exists()


def test_change_form__cleared_payload_is_stored_as_an_empty_object(admin_client: Client) -> None:
    """As `enqueue(payload=None)` stores it; the column is NOT NULL on every database."""
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    response = admin_client.post(change_url(job), form_data(priority="0", payload=""))
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.payload == {}
    assert "{}" in admin_client.get(change_url(job)).content.decode()


def test_change_form__lone_surrogate_is_shown_back_as_posted(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    posted = '{"card": "41\\ud800"}'
    response = post_hostile(admin_client, change_url(job), "payload", posted)
    assert response.status_code == 200
    assert "lone surrogate" in str(response.context["adminform"].form.errors)
    assert "41\\ud800" in response.content.decode("utf-8")


def test_change_form__raw_invalid_utf8_is_never_stored_as_sent(admin_client: Client) -> None:
    """A lone surrogate sent as bytes (CESU-8) reaches the form as replacement characters."""
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    management = urlencode(form_data())
    body = f"priority=0&payload=%22%ED%A0%80%22&{management}"
    response = admin_client.post(
        change_url(job), body, content_type="application/x-www-form-urlencoded"
    )
    assert response.status_code in (200, 302)
    job.refresh_from_db()
    assert job.payload in ({"amount": 1}, "\ufffd\ufffd\ufffd")
    response.content.decode("utf-8")


@pytest.mark.skipif(
    not ON_SQLITE, reason="PostgreSQL's jsonb and MariaDB's JSON_VALID refuse a lone surrogate"
)
def test_change_form__stored_lone_surrogate_renders(admin_client: Client) -> None:
    """A row written around enqueue() (SQLite stores the escape) still opens."""
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    PaymentJob.objects.filter(pk=job.pk).update(payload={"card": "41\ud800"})
    response = admin_client.get(change_url(job))
    assert response.status_code == 200
    assert "41\\ud800" in response.content.decode("utf-8")


# ---- the history page -------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["django_leases_paymentjob", "testapp_payoutjob"])
def test_history__shows_the_payload_and_priority_edits(admin_client: Client, model: str) -> None:
    table = PaymentJob if model.startswith("django_leases") else PayoutJob
    job = table.objects.enqueue("capture", {"amount": 1})
    change = reverse(f"admin:{model}_change", args=[job.pk])
    response = admin_client.post(change, form_data(priority="7", payload='{"amount": 2}'))
    assert response.status_code == 302
    response = admin_client.get(reverse(f"admin:{model}_history", args=[job.pk]))
    assert response.status_code == 200
    (entry,) = response.context["action_list"]
    message = (
        "Edited (priority or payload); priority: 0 → 7; payload: {'amount': 1} → {'amount': 2}; "
        f"reason: {REASON}"
    )
    assert entry.get_change_message() == message
    assert "priority: 0 → 7" in response.content.decode()


@pytest.mark.parametrize(
    "term", ["²", "١٢", "99999999999999999999", "9223372036854775808", "9" * 5000]
)
@pytest.mark.parametrize(
    "url",
    [
        "admin:django_leases_jobattempt_changelist",
        CHANGELIST,
        "admin:django_leases_worker_changelist",
    ],
)
def test_search__odd_terms_find_nothing_instead_of_failing(
    admin_client: Client, jobs: dict[str, PaymentJob], url: str, term: str
) -> None:
    response = admin_client.get(reverse(url), {"q": term})
    assert response.status_code == 200
    assert list(response.context["cl"].result_list) == []


@pytest.mark.parametrize(
    "url",
    [
        "admin:django_leases_jobattempt_changelist",
        CHANGELIST,
        "admin:django_leases_worker_changelist",
    ],
)
def test_search__nul_is_refused_by_the_search_form(
    admin_client: Client, jobs: dict[str, PaymentJob], url: str
) -> None:
    # Django's search form refuses NUL characters and lists everything, on every database.
    response = admin_client.get(reverse(url), {"q": "worker\x00"})
    assert response.status_code == 200
    assert response.context["cl"].query == ""


def test_search__ledger_by_the_largest_job_id(admin_client: Client) -> None:
    url = reverse("admin:django_leases_jobattempt_changelist")
    response = admin_client.get(url, {"q": "9223372036854775807"})
    assert response.status_code == 200 and list(response.context["cl"].result_list) == []


def test_kind_filter__nul_finds_nothing(admin_client: Client, jobs: dict[str, PaymentJob]) -> None:
    assert listed(changelist(admin_client, kind="cap\x00ture")) == set()


def test_add_and_delete__are_not_offered(admin_client: Client, jobs: dict[str, PaymentJob]) -> None:
    assert admin_client.get(reverse("admin:django_leases_paymentjob_add")).status_code == 403
    url = reverse("admin:django_leases_paymentjob_delete", args=[jobs["pending"].pk])
    assert admin_client.post(url, {"post": "yes"}).status_code == 403
    assert PaymentJob.objects.filter(pk=jobs["pending"].pk).exists()


def test_attempt_admin__read_only_list_filters_and_search(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    url = reverse("admin:django_leases_jobattempt_changelist")
    response = admin_client.get(url)
    assert response.status_code == 200
    assert {a.job_ref for a in response.context["cl"].result_list} == {
        jobs[n].pk for n in STATES[1:7]
    }
    html = response.content.decode()
    change = reverse("admin:django_leases_paymentjob_change", args=[jobs["stuck"].pk])
    assert f'<a href="{change}">{jobs["stuck"].pk}</a>' in html
    assert "ValueError: card declined" in html
    open_ = admin_client.get(url, {"open": "1"}).context["cl"].result_list
    assert {a.job_ref for a in open_} == {jobs[n].pk for n in ("healthy", "near", "stuck")}
    found = admin_client.get(url, {"q": str(jobs["failed"].pk)}).context["cl"].result_list
    assert [a.owner for a in found] == ["worker-failed"]
    found = admin_client.get(url, {"q": "worker-fa"}).context["cl"].result_list
    assert [a.job_ref for a in found] == [jobs["failed"].pk]
    attempt = JobAttempt.objects.get(job_ref=jobs["failed"].pk)
    assert admin_client.get(reverse("admin:django_leases_jobattempt_add")).status_code == 403
    change = reverse("admin:django_leases_jobattempt_change", args=[attempt.pk])
    assert admin_client.post(change, {"owner": "forged"}).status_code == 403
    assert JobAttempt.objects.get(pk=attempt.pk).owner == "worker-failed"


def test_worker_admin__alive_and_gone(admin_client: Client) -> None:
    for name in ("alive-1", "stopped-1", "silent-1"):
        Worker.objects.register(
            name, instance="test", hostname="h", pid=1, kinds=["capture"], concurrency=2
        )
    Worker.objects.stopped("stopped-1", "test")
    Worker.objects.filter(worker_id="silent-1").update(last_seen_at=Now() - timedelta(hours=1))
    url = reverse("admin:django_leases_worker_changelist")

    def shown(**params: str) -> set[str]:
        return {w.worker_id for w in admin_client.get(url, params).context["cl"].result_list}

    assert shown() == {"alive-1", "stopped-1", "silent-1"}
    assert shown(state="alive") == {"alive-1"}
    assert shown(state="gone") == {"stopped-1", "silent-1"}
    html = admin_client.get(url).content.decode()
    assert html.count('dl-healthy">alive<') == 1 and 'dl-quiet">stopped<' in html
    assert 'dl-quiet">gone<' in html and "1 h 0 min ago" in html


# ---- the overview ---------------------------------------------------------------------------


def test_overview__counts_and_lists(admin_client: Client, jobs: dict[str, PaymentJob]) -> None:
    Worker.objects.register(
        "worker-a", instance="test", hostname="h", pid=1, kinds=["capture"], concurrency=4
    )
    Worker.objects.register(
        "worker-b", instance="test", hostname="h", pid=2, kinds=[], concurrency=1
    )
    Worker.objects.stopped("worker-b", "test")
    # Finished in a minute the watcher has closed: the history chart draws it.
    finished = PaymentJob.objects.filter(pk__in=[jobs["completed"].pk, jobs["failed"].pk])
    finished.update(completed_at=Now() - timedelta(minutes=2))
    assert queue_history(connection.alias).record(PaymentJob.objects.all())
    # Recording took a while on a loaded machine: the near-expiry lease ends 10 s from now again.
    PaymentJob.objects.filter(pk=jobs["near"].pk).update(lease_until=Now() + timedelta(seconds=10))
    PaymentJob.objects.filter(pk=jobs["pending"].pk).update(run_at=Now() - timedelta(minutes=3))
    response = admin_client.get(reverse(OVERVIEW))
    assert response.status_code == 200
    data = response.context["overview"]
    assert data.by_status == {
        "pending": Tally(1),
        "processing": Tally(3),
        "completed": Tally(1),
        "failed": Tally(1),
        "review": Tally(1),
        "cancelled": Tally(1),
        "waiting": Tally(1),
        "stopping": Tally(0),
    }
    assert (data.stuck, data.near_expiry) == (1, 1)
    assert data.under_review == data.blocked_by_lock == Tally(1)
    assert (data.finished["completed"], data.finished["failed"]) == (1, 1)
    assert data.oldest_due.wait is not None
    assert data.oldest_due.wait.total_seconds() == pytest.approx(180, abs=5)
    assert [w.worker_id for w in data.fleet.workers] == ["worker-a"]
    assert [job.pk for job in data.stuck_jobs] == [jobs["stuck"].pk]

    html = response.content.decode()
    assert re.search(r'id="dl-stuck" href="[^"]+\?lease=stuck">\s*<span class="dl-value">1<', html)
    assert re.search(
        r'id="dl-blocked" href="[^"]+\?locked=blocked">\s*<span class="dl-value">1<', html
    )
    assert re.search(r'id="dl-oldest"[^>]*>\s*<span class="dl-value">3 min \d+ s<', html)
    assert html.count('<rect class="dl-bar-hover"') == 60
    assert html.count('<rect class="dl-bar-completed"') == 1
    assert html.count('<rect class="dl-bar-failed"') == 1
    assert 'id="dl-count-review">1<' in html
    assert "worker-a" in html and "worker-b" not in html
    assert f"#{jobs['stuck'].pk}</a>" in html


def kind_cells(html: str, kind: str) -> list[str]:
    """The cells of `kind`'s row of the overview's table per kind, as text."""
    row = re.search(rf'<tr id="dl-kind-\d+" data-kind="{kind}">(.*?)</tr>', html, re.S)
    assert row is not None, kind
    cells = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row.group(1), re.S)
    return [" ".join(re.sub(r"<[^>]+>", "", cell).split()) for cell in cells]


CARD = re.compile(r'id="dl-([\w-]+)" href="([^"]+)">\s*<span class="dl-value">([^<]*)<')


def test_overview__each_card_links_to_exactly_the_jobs_it_counts(
    admin_client: Client, jobs: dict[str, PaymentJob], settings: Any
) -> None:
    settings.DJANGO_LEASES = {"LONG_RUNNING": 1800}
    run_for(jobs["healthy"], timedelta(hours=2))
    Worker.objects.register("worker-a", instance="t", hostname="h", pid=1, kinds=[], concurrency=1)
    # What each card must leave out: jobs that finished before the last hour, a pending job
    # not due yet, a stopped worker.
    for status in ("completed", "failed"):
        old = PaymentJob.objects.enqueue("capture")
        PaymentJob.objects.filter(pk=old.pk).update(
            status=status, completed_at=Now() - timedelta(hours=2)
        )
    PaymentJob.objects.enqueue("capture", run_at=3600)
    Worker.objects.register("worker-b", instance="t", hostname="h", pid=2, kinds=[], concurrency=1)
    Worker.objects.stopped("worker-b", "t")

    html = admin_client.get(reverse(OVERVIEW)).content.decode()
    cards = {name: (href.replace("&amp;", "&"), value) for name, href, value in CARD.findall(html)}

    assert set(cards) == {
        "stuck",
        "near-expiry",
        "review",
        "blocked",
        "running-long",
        "oldest",
        "completed",
        "failed",
        "workers",
    }
    for name, (href, value) in cards.items():
        listing = admin_client.get(href)
        assert listing.status_code == 200, name
        shown = listing.context["cl"].result_list
        if name == "oldest":  # a wait, not a count: the link lists the due jobs it is about
            assert {job.pk for job in shown} == {jobs["pending"].pk}, href
        else:
            assert (name, len(shown)) == (name, int(value)), href
            assert int(value) >= 1, name  # every card counts something here


def test_overview__empty_queue(admin_client: Client) -> None:
    response = admin_client.get(reverse(OVERVIEW))
    assert response.status_code == 200
    html = response.content.decode()
    assert "No stuck job" in html and "No worker has reported in recently." in html
    assert '<rect class="dl-bar-completed"' not in html


def test_overview__linked_from_index_app_index_and_changelist(admin_client: Client) -> None:
    url = reverse(OVERVIEW)
    for page in (
        reverse("admin:index"),
        reverse("admin:app_list", args=["django_leases"]),
        reverse(CHANGELIST),
    ):
        assert f'href="{url}"' in admin_client.get(page).content.decode(), page


def test_overview__needs_a_permission_on_jobs(client: Client, django_user_model: Any) -> None:
    staff = django_user_model.objects.create_user("staff", is_staff=True)
    client.force_login(staff)
    assert client.get(reverse(OVERVIEW)).status_code == 403
    assert reverse(OVERVIEW) not in client.get(reverse("admin:index")).content.decode()


# ---- query counts ---------------------------------------------------------------------------


def bulk_jobs(n: int) -> None:
    """Add `n` jobs, an eighth in each state; lease and finish times from the database clock."""
    PaymentJob.objects.bulk_create(
        PaymentJob(kind=f"k{i % 3}", payment_id=f"bulk_{i}", last_error="e" * (i % 90))
        for i in range(n)
    )
    pks = list(PaymentJob.objects.order_by("pk").values_list("pk", flat=True))
    share = {state: pks[i :: len(STATES)] for i, state in enumerate(STATES)}
    lease_ends = {"healthy": 600, "near": 10, "stuck": -60}
    for state, seconds in lease_ends.items():
        PaymentJob.objects.filter(pk__in=share[state]).update(
            status=Status.PROCESSING,
            lease_owner=f"bulk-{state}",
            lease_token=1,
            attempts=1,
            lease_until=Now() + timedelta(seconds=seconds),
            heartbeat_at=Now() - timedelta(seconds=30),
        )
    for state in ("completed", "failed", "cancelled"):
        PaymentJob.objects.filter(pk__in=share[state]).update(
            status=state, completed_at=Now() - timedelta(minutes=len(state))
        )
    PaymentJob.objects.filter(pk__in=share["review"]).update(status=Status.REVIEW)
    for i in range(min(n // 100, 30)):
        Worker.objects.register(
            f"bulk-{i}", instance="test", hostname="h", pid=i, kinds=["k0"], concurrency=1
        )


# Session, user, the kind filter's lookups, COUNT, the page. Every filter combination is
# the same five: filters narrow the same two queries.
CHANGELIST_QUERIES = 5
# Session, user, then stats.overview(): a capped count per status (eight), expired count,
# near-expiry count, oldest due job, last hour's throughput, live workers and watchers, their
# last pass, the pending kinds, stuck sample, long runners' count and sample; what holds the
# vacuum horizon (PostgreSQL, MariaDB/MySQL); the table per kind (the backlog, the running
# jobs, the last hour's failures and history, the paused kinds); the charts (the database
# clock, the minutes of the span).
OVERVIEW_QUERIES = 27 + (connection.vendor != "sqlite")
# Session, user, the job, its ledger and its operator events (the inlines).
CHANGE_FORM_QUERIES = 5


@pytest.mark.parametrize("rows", [16, 2000])
@pytest.mark.parametrize("params", [{}, {"lease": "stuck"}, {"status": "failed", "kind": "k1"}])
def test_changelist__query_count_does_not_grow_with_rows(
    admin_client: Client, django_assert_num_queries: Any, rows: int, params: dict[str, str]
) -> None:
    bulk_jobs(rows)
    with django_assert_num_queries(CHANGELIST_QUERIES):
        response = admin_client.get(reverse(CHANGELIST), params)
    assert response.status_code == 200
    shown = response.context["cl"].result_list
    assert len(shown) == min(100, response.context["cl"].result_count) > 0


@pytest.mark.parametrize("rows", [16, 2000])
def test_overview__query_count_does_not_grow_with_rows(
    admin_client: Client, django_assert_num_queries: Any, rows: int
) -> None:
    bulk_jobs(rows)
    with django_assert_num_queries(OVERVIEW_QUERIES):
        response = admin_client.get(reverse(OVERVIEW))
    data = response.context["overview"]
    assert data.total == Tally(rows) and data.stuck == data.near_expiry == rows // 8
    assert data.finished["completed"] == data.finished["failed"] == rows // 8
    assert len(data.stuck_jobs) == min(10, rows // 8)


@pytest.mark.parametrize("attempts", [1, 20])
def test_change_form__query_count_does_not_grow_with_attempts(
    admin_client: Client, django_assert_num_queries: Any, attempts: int
) -> None:
    job = PaymentJob.objects.enqueue("capture", max_attempts=attempts)
    for n in range(attempts):
        claim(job.pk, f"w{n}")
        expire(job.pk)
        assert PaymentJob.objects.filter(pk=job.pk).release_stuck(by=OPERATOR) == 1
    # Django caches content types per process: the count must not depend on an earlier test.
    ContentType.objects.get_for_model(PaymentJob)
    with django_assert_num_queries(CHANGE_FORM_QUERIES):
        response = admin_client.get(change_url(job))
    ledger, events = response.context["inline_admin_formsets"]
    assert len(list(ledger)) == len(list(events)) == attempts


# ---- an action racing a worker process -----------------------------------------------------


def read_lines(proc: Any) -> list[dict[str, Any]]:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_actions__race_a_live_holder_process(admin_client: Client, processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("capture", payment_id="pay_race")
    holder = processes.start("-m", "tests.holder", "--owner", "holder-1", "--ttl", "30")

    held = wait_for(
        lambda: (
            PaymentJob.objects.filter(pk=job.pk, status="processing", lease_owner="holder-1")
            .values("lease_token", "heartbeat_at")
            .first()
        )
    )
    assert isinstance(held, dict)
    token = held["lease_token"]
    assert listed(changelist(admin_client, lease="healthy")) == {job.pk}

    # A plain requeue is refused while the holder renews its lease...
    assert act(admin_client, "requeue", job) == [
        "0 jobs requeued; 1 skipped: its lease is live — use “Force requeue”"
    ]
    now = PaymentJob.objects.get(pk=job.pk)
    assert (now.status, now.lease_owner, now.lease_token) == ("processing", "holder-1", token)
    # ...and the holder carries on: its heartbeats still win.
    wait_for(
        lambda: PaymentJob.objects.filter(pk=job.pk, heartbeat_at__gt=now.heartbeat_at).exists()
    )
    assert holder.poll() is None

    # Force requeue fences it out: its next heartbeat and its completion are refused.
    assert act(admin_client, "force_requeue", job) == ["1 job requeued by force"]
    lines = read_lines(holder)
    assert lines[0] == {"claimed": job.pk, "token": token}
    assert lines[1] == {"heartbeat_refused": True}
    assert "lease_lost" in lines[2] and "completed" not in lines[2]

    requeued = PaymentJob.objects.get(pk=job.pk)
    assert requeued.status == "pending" and requeued.lease_token > token
    attempt = JobAttempt.objects.get(job_ref=job.pk, token=token)
    assert (attempt.outcome, attempt.ended_by) == ("requeued", OPERATOR)
    assert attempt.fenced_at is not None


def test_force_cancel__every_page_of_more_than_a_thousand_jobs(admin_client: Client) -> None:
    jobs = PaymentJob.objects.enqueue_many("capture", [{}] * 1200)
    other = PaymentJob.objects.enqueue("refund")
    url = reverse(CHANGELIST) + "?kind=capture"
    page = [job.pk for job in jobs][-100:]  # the first page, newest first
    data = {
        "action": "force_cancel",
        "select_across": "1",
        "index": "0",
        "_selected_action": page,
        "reason": REASON,
    }
    confirmation = admin_client.post(url, data)
    assert confirmation.status_code == 200
    assert "1200 jobs selected" in confirmation.content.decode()
    assert not PaymentJob.objects.filter(status=Status.CANCELLED).exists()

    # What the operator's "Yes" sends: the confirmation form's fields, to the same URL.
    fields: dict[str, list[str]] = {}
    for name, value in re.findall(
        r'<input type="hidden" name="([^"]+)" value="([^"]*)"', confirmation.content.decode()
    ):
        fields.setdefault(name, []).append(value)
    confirmed = admin_client.post(url, fields, follow=True)

    assert confirmed.status_code == 200
    assert [str(m) for m in confirmed.context["messages"]] == ["1200 jobs cancelled by force"]
    assert PaymentJob.objects.filter(kind="capture", status=Status.CANCELLED).count() == 1200
    assert PaymentJob.objects.get(pk=other.pk).status == Status.PENDING


def viewer_client(client: Client, django_user_model: Any) -> Client:
    viewer = django_user_model.objects.create_user("viewer", is_staff=True)
    for codename in ("view_paymentjob", "view_jobattempt", "view_worker", "view_schedulestate"):
        viewer.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(viewer)
    return client


REFUSED_LOOKUPS = {
    CHANGELIST: [
        {"payload__icontains": "4242"},
        {"last_error__regex": "("},
        {"kind__unsupported": "x"},
        {"lease_owner": "a\x00b"},
        {"id__gt": "nan"},
        {"status__exact": "pending"},
    ],
    "admin:django_leases_jobattempt_changelist": [
        {"outcome__exact": "a\x00b"},
        {"owner__regex": "("},
        {"error__icontains": "card"},
    ],
    "admin:django_leases_worker_changelist": [{"hostname__regex": "("}, {"kinds__contains": "x"}],
    "admin:django_leases_schedulestate_changelist": [{"name__regex": "("}],
}
OFFERED_LOOKUPS = {
    CHANGELIST: [{"status": "pending", "kind": "a\x00b", "lease": "stuck", "when": "due"}],
    "admin:django_leases_jobattempt_changelist": [{"outcome__exact": "completed", "open": "1"}],
    "admin:django_leases_worker_changelist": [{"state": "alive"}],
}


@pytest.mark.parametrize("who", ["superuser", "viewer"])
def test_changelists__refuse_the_lookups_they_do_not_offer(
    who: str, admin_client: Client, client: Client, django_user_model: Any
) -> None:
    user = admin_client if who == "superuser" else viewer_client(client, django_user_model)
    PaymentJob.objects.enqueue("capture", {"card": "4242"})
    for name, lookups in REFUSED_LOOKUPS.items():
        for params in lookups:
            response = user.get(reverse(name), params)
            assert response.status_code == 400, (name, params, response.status_code)
    for name, lookups in OFFERED_LOOKUPS.items():
        for params in lookups:
            assert user.get(reverse(name), params).status_code == 200, (name, params)


def fleet_of_two() -> None:
    """A live worker of "sleep", and one of "refund" that missed two heartbeats (frozen, or
    killed), still alive by WORKER_GONE_AFTER; pending jobs of "sleep", "refund" and "captur"
    (a misspelt kind: no worker serves it), "captur" the oldest due."""
    for name, kinds in (("w-live", ["sleep"]), ("w-frozen", ["refund"])):
        Worker.objects.register(
            name, instance=name, hostname="h", pid=1, kinds=kinds, concurrency=1, heartbeat=30.0
        )
    # Late after 60 s, gone after WORKER_GONE_AFTER (120 s).
    Worker.objects.filter(worker_id="w-frozen").update(last_seen_at=Now() - timedelta(seconds=90))
    for kind in ("sleep", "refund", "captur"):
        PaymentJob.objects.enqueue(kind)
    PaymentJob.objects.filter(kind="captur").update(run_at=Now() - timedelta(minutes=3))


def test_overview__late_workers_unserved_kinds_and_the_oldest_due_kind(
    admin_client: Client,
) -> None:
    fleet_of_two()
    response = admin_client.get(reverse(OVERVIEW))
    html = response.content.decode()

    assert re.search(r'id="dl-late-count">\s*1 late', html), html
    unserved = html[html.index('id="dl-unserved"') :].split("</table>")[0]
    assert re.findall(r'status=pending">([^<]+)</a>', unserved) == ["captur", "refund"]
    assert re.search(r'id="dl-oldest-kind">captur<', html)
    workers = admin_client.get(reverse("admin:django_leases_worker_changelist")).content.decode()
    frozen = re.search(r"w-frozen.*?</tr>", workers, re.S)
    assert frozen and ">late<" in frozen.group(0)
    live = re.search(r"w-live.*?</tr>", workers, re.S)
    assert live and ">alive<" in live.group(0)
