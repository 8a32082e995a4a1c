"""The audit of operator actions: reasons, operator events, the admin history (LogEntry), the
permissions of the dangerous actions, the payment timeline and times to the second."""

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse

from django_leases.admin.display import stamp
from django_leases.exceptions import InvalidArgument
from django_leases.models import (
    GUARDED_ACTIONS,
    JobAttempt,
    JobEvent,
    JobStep,
    PaymentJob,
    ScheduleState,
    Worker,
)

from .test_admin import CHANGELIST, OPERATOR, REASON, act, change_url, form_data, jobs, snapshot

pytestmark = pytest.mark.django_db
__all__ = ["jobs"]  # the fixture, shared with test_admin

Status = PaymentJob.Status
EVENTS = "admin:django_leases_jobevent_changelist"
TIMELINE = "admin:django_leases_paymentjob_timeline"

# Each action, the job of the `jobs` fixture it changes, and the event it records.
ACTIONS = {
    "requeue": ("failed", "requeued"),
    "force_requeue": ("healthy", "force_requeued"),
    "release_stuck": ("stuck", "released"),
    "mark_failed": ("pending", "failed"),
    "cancel": ("pending", "cancelled"),
    "force_cancel": ("healthy", "force_cancelled"),
    "resolve_review_completed": ("review", "review_completed"),
    "resolve_review_retry": ("review", "review_retry"),
    "resolve_review_failed": ("review", "review_failed"),
}
NEEDS_REASON = {
    "force_requeue",
    "mark_failed",
    "force_cancel",
    "resolve_review_completed",
    "resolve_review_retry",
    "resolve_review_failed",
}
GUARDED = ["force_requeue", "force_cancel", "resolve_review_completed", "resolve_review_failed"]


def history(job: PaymentJob) -> list[str]:
    """The job's admin history, oldest first."""
    entries = LogEntry.objects.filter(object_id=str(job.pk), action_flag=CHANGE).order_by("id")
    return [entry.get_change_message() for entry in entries]


@pytest.mark.parametrize("action", list(ACTIONS))
def test_action__records_who_when_why_as_an_event_and_in_the_history(
    admin_client: Client, jobs: dict[str, PaymentJob], action: str
) -> None:
    name, event = ACTIONS[action]
    job = jobs[name]
    assert act(admin_client, action, job, reason="PSP ticket 4711")[0].startswith("1 ")

    (recorded,) = JobEvent.objects.filter(job_ref=job.pk)
    assert (recorded.action, recorded.by) == (event, OPERATOR)
    assert "PSP ticket 4711" in recorded.reason
    assert recorded.at is not None and recorded.changes is None
    (message,) = history(job)
    assert message.startswith(str(JobEvent.Action(event).label))
    assert message.endswith("reason: PSP ticket 4711")
    # "History" on the job's page, and "Recent actions" on the index.
    page = admin_client.get(reverse("admin:django_leases_paymentjob_history", args=[job.pk]))
    assert "PSP ticket 4711" in page.content.decode()
    assert LogEntry.objects.get(object_id=str(job.pk)).user.get_username() == "admin"


@pytest.mark.parametrize("action", sorted(NEEDS_REASON))
def test_dangerous_action__without_a_reason_changes_nothing(
    admin_client: Client, jobs: dict[str, PaymentJob], action: str
) -> None:
    job = jobs[ACTIONS[action][0]]
    before, events = snapshot(), JobEvent.objects.count()
    messages = act(admin_client, action, job, reason="   ")
    assert len(messages) == 1 and messages[0].endswith("needs a reason: nothing was changed.")
    assert snapshot() == before
    assert JobEvent.objects.count() == events and not LogEntry.objects.exists()


def test_action__on_many_jobs_writes_one_history_entry_each(admin_client: Client) -> None:
    many = PaymentJob.objects.enqueue_many("capture", [{}] * 620)
    data = {
        "action": "cancel",
        "select_across": "1",
        "index": "0",
        "_selected_action": [many[0].pk],
        "reason": "duplicate batch",
    }
    admin_client.post(reverse(CHANGELIST), data, follow=True)
    assert PaymentJob.objects.filter(status=Status.CANCELLED).count() == 620
    assert LogEntry.objects.filter(action_flag=CHANGE).count() == 620
    assert JobEvent.objects.filter(action="cancelled", reason="duplicate batch").count() == 620


# ---- edits of a pending job -----------------------------------------------------------------


def test_edit__records_old_and_new_values_and_the_reason(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1}, payment_id="pay_e")
    data = form_data(priority="5", payload=json.dumps({"amount": 2}), reason="customer asked")
    assert admin_client.post(change_url(job), data).status_code == 302

    job.refresh_from_db()
    assert (job.priority, job.payload) == (5, {"amount": 2})
    (event,) = JobEvent.objects.filter(job_ref=job.pk)
    assert (event.action, event.by, event.reason) == ("edited", OPERATOR, "customer asked")
    assert event.changes == {"priority": [0, 5], "payload": [{"amount": 1}, {"amount": 2}]}
    assert history(job) == [
        "Edited (priority or payload); priority: 0 → 5; "
        "payload: {'amount': 1} → {'amount': 2}; reason: customer asked"
    ]


def test_edit__of_the_payload_needs_a_reason(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    response = admin_client.post(
        change_url(job), form_data(payload=json.dumps({"amount": 9}), priority="0", reason="")
    )
    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {
        "reason": ["Say why the payload is changed."]
    }
    job.refresh_from_db()
    assert job.payload == {"amount": 1}
    assert not JobEvent.objects.exists() and not LogEntry.objects.exists()


def test_edit__of_the_priority_alone_needs_no_reason(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    data = form_data(payload=json.dumps({"amount": 1}), priority="3", reason="")
    assert admin_client.post(change_url(job), data).status_code == 302
    (event,) = JobEvent.objects.filter(job_ref=job.pk)
    assert (event.changes, event.reason) == ({"priority": [0, 3]}, "")


def test_edit_pending__of_a_claimed_job_writes_nothing() -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    assert PaymentJob.objects.claim_job(job.pk, "w", ttl=60) is not None
    assert PaymentJob.objects.edit_pending(job.pk, {"priority": 4}, by="op") is None
    assert PaymentJob.objects.get(pk=job.pk).priority == 0
    assert not JobEvent.objects.exists()


def test_edit_pending__the_same_values_record_nothing() -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1}, priority=2)
    assert PaymentJob.objects.edit_pending(job.pk, {"priority": 2}, by="op") == {}
    assert not JobEvent.objects.exists()


def test_edit_pending__refuses_other_fields() -> None:
    job = PaymentJob.objects.enqueue("capture")
    with pytest.raises(ValueError, match="only priority, payload can be edited"):
        PaymentJob.objects.edit_pending(job.pk, {"status": "completed"}, by="op")
    assert PaymentJob.objects.get(pk=job.pk).status == Status.PENDING


# ---- permissions ----------------------------------------------------------------------------


def staff(client: Client, django_user_model: Any, *codenames: str) -> Client:
    """Log in a staff user who may view and change jobs, with the permissions `codenames`."""
    user = django_user_model.objects.create_user("support", is_staff=True)
    for codename in ("view_paymentjob", "change_paymentjob", *codenames):
        user.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(user)
    return client


def offered(client: Client) -> set[str]:
    response = client.get(reverse(CHANGELIST))
    return {name for name, _ in response.context["action_form"].fields["action"].choices if name}


def test_permissions__one_per_dangerous_action() -> None:
    names = set(
        Permission.objects.filter(content_type__model="paymentjob").values_list(
            "codename", flat=True
        )
    )
    assert {f"{action}_paymentjob" for action in GUARDED_ACTIONS} <= names


@pytest.mark.parametrize("action", GUARDED)
def test_guarded_action__without_its_permission_is_not_offered_and_a_post_is_403(
    client: Client, django_user_model: Any, jobs: dict[str, PaymentJob], action: str
) -> None:
    support = staff(client, django_user_model)
    assert action not in offered(support)
    assert {"requeue", "cancel", "release_stuck", "mark_failed"} <= offered(support)
    before, events = snapshot(), JobEvent.objects.count()
    data = {
        "action": action,
        "_selected_action": [jobs[ACTIONS[action][0]].pk],
        "post": "yes",
        "reason": REASON,
    }
    assert support.post(reverse(CHANGELIST), data).status_code == 403
    assert snapshot() == before
    assert JobEvent.objects.count() == events


@pytest.mark.parametrize("action", GUARDED)
def test_guarded_action__with_its_permission_runs(
    client: Client, django_user_model: Any, jobs: dict[str, PaymentJob], action: str
) -> None:
    support = staff(client, django_user_model, f"{action}_paymentjob")
    assert action in offered(support)
    others = set(GUARDED) - {action}
    assert not others & offered(support)
    job = jobs[ACTIONS[action][0]]
    messages = act(support, action, job)
    assert messages[0].startswith("1 ")
    assert JobEvent.objects.get(job_ref=job.pk).by == "admin:support"


def test_payload__without_its_permission_is_read_only_and_a_post_is_403(
    client: Client, django_user_model: Any
) -> None:
    job = PaymentJob.objects.enqueue("capture", {"amount": 1})
    support = staff(client, django_user_model)
    form = support.get(change_url(job)).context["adminform"].form
    assert "payload" not in form.fields and "priority" in form.fields
    crafted = form_data(priority="0", payload=json.dumps({"amount": 99}))
    assert support.post(change_url(job), crafted).status_code == 403
    assert PaymentJob.objects.get(pk=job.pk).payload == {"amount": 1}
    # The priority it may change.
    assert support.post(change_url(job), form_data(priority="4")).status_code == 302
    assert PaymentJob.objects.get(pk=job.pk).priority == 4

    editor = django_user_model.objects.create_user("editor", is_staff=True)
    for codename in ("change_paymentjob", "edit_payload_paymentjob"):
        editor.user_permissions.add(Permission.objects.get(codename=codename))
    client.force_login(editor)
    assert client.post(change_url(job), crafted).status_code == 302
    assert PaymentJob.objects.get(pk=job.pk).payload == {"amount": 99}


# ---- the operator events list ---------------------------------------------------------------


def test_events_list__filterable_and_read_only(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    act(admin_client, "force_requeue", jobs["healthy"], reason="holder hung")
    act(admin_client, "cancel", jobs["pending"], reason="duplicate")
    event = JobEvent.objects.get(action="force_requeued")

    def listed(**params: str) -> list[str]:
        # The fixture's own cancel was by "operator".
        response = admin_client.get(reverse(EVENTS), {"by__exact": OPERATOR, **params})
        assert response.status_code == 200
        return [e.action for e in response.context["cl"].result_list]

    assert listed() == ["cancelled", "force_requeued"]
    assert listed(action__exact="force_requeued") == ["force_requeued"]
    assert listed(within="hour") == ["cancelled", "force_requeued"]
    assert len(admin_client.get(reverse(EVENTS)).context["cl"].result_list) == 3
    assert listed(q=str(jobs["pending"].pk)) == ["cancelled"]
    html = admin_client.get(reverse(EVENTS)).content.decode()
    assert "holder hung" in html
    assert re.search(
        r"<time datetime=\"[^\"]+\" title=\"[^\"]+\">\d{4}-\d\d-\d\d \d\d:\d\d:\d\d</time>", html
    )

    change = reverse("admin:django_leases_jobevent_change", args=[event.pk])
    assert admin_client.post(change, {"reason": "rewritten"}).status_code == 403
    delete = reverse("admin:django_leases_jobevent_delete", args=[event.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    assert admin_client.get(reverse("admin:django_leases_jobevent_add")).status_code == 403
    assert JobEvent.objects.get(pk=event.pk).reason == "holder hung"


# ---- the payment timeline -------------------------------------------------------------------


def test_timeline__every_job_attempt_step_and_event_in_time_order(admin_client: Client) -> None:
    capture = PaymentJob.objects.enqueue("capture", payment_id="pay_t")
    refund = PaymentJob.objects.enqueue("refund", payment_id="pay_t", after=[capture])
    other = PaymentJob.objects.enqueue("capture", payment_id="pay_other")
    held = PaymentJob.objects.claim_job(capture.pk, "host-1:77", ttl=60)
    assert held is not None
    JobStep.objects.create(
        job=held, job_ref=held.pk, name="charge", token=held.lease_token, attempt=1
    )
    PaymentJob.objects.heartbeat("host-1:77", [(held.pk, held.lease_token)], ttl=60)
    PaymentJob.objects.complete(held.pk, "host-1:77", held.lease_token)
    PaymentJob.objects.filter(pk=refund.pk).cancel(by="admin:alice", reason="chargeback")

    response = admin_client.get(reverse(TIMELINE), {"payment_id": "pay_t"})
    assert response.status_code == 200
    entries = [row["entry"] for row in response.context["rows"]]
    assert {e.job for e in entries} == {capture.pk, refund.pk}
    assert [e.at for e in entries] == sorted(e.at for e in entries)
    whats = [(e.job, e.what) for e in entries]
    for expected in [
        (capture.pk, "enqueued"),
        (capture.pk, f"attempt 1 claimed by host-1:77 (token {held.lease_token})"),
        (capture.pk, "step charge recorded"),
        (capture.pk, "attempt 1 ended: Completed"),
        (capture.pk, "Completed"),
        (refund.pk, "enqueued"),
        (refund.pk, "Cancelled by force (running jobs too) by admin:alice"),
        (refund.pk, "Cancelled"),
    ]:
        assert expected in whats, (expected, whats)
    claim_at = next(i for i, (j, w) in enumerate(whats) if w.startswith("attempt 1 claimed"))
    step_at = whats.index((capture.pk, "step charge recorded"))
    end_at = whats.index((capture.pk, "attempt 1 ended: Completed"))
    assert claim_at < step_at < end_at
    html = response.content.decode()
    assert "chargeback" in html and f"#{other.pk}<" not in html
    assert len(re.findall(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d</time>", html)) == len(entries)
    # The job's page links to it.
    page = admin_client.get(change_url(capture)).content.decode()
    assert f"{reverse(TIMELINE)}?payment_id=pay_t" in page


def test_timeline__an_unknown_payment_says_so(admin_client: Client) -> None:
    response = admin_client.get(reverse(TIMELINE), {"payment_id": "nope"})
    assert response.status_code == 200 and response.context["timeline"] is None
    assert "No job has payment id “nope”." in response.content.decode()


def test_timeline__needs_view_permission(client: Client, django_user_model: Any) -> None:
    client.force_login(django_user_model.objects.create_user("nobody", is_staff=True))
    assert client.get(reverse(TIMELINE), {"payment_id": "pay_t"}).status_code == 403


# ---- times to the second --------------------------------------------------------------------


def test_stamp__to_the_second_with_the_relative_time() -> None:
    now = datetime(2026, 12, 7, 21, 39, 4, 700_000, tzinfo=UTC)
    past = stamp(now - timedelta(minutes=2, seconds=5), now)
    assert ">2026-12-07 21:36:59</time>" in past and "2 min 5 s ago" in past
    soon = stamp(now + timedelta(seconds=40), now)
    assert ">2026-12-07 21:39:44</time>" in soon and "in 40 s" in soon
    assert stamp(None, now) == "—"


def test_change_form__every_time_to_the_second(
    admin_client: Client, jobs: dict[str, PaymentJob]
) -> None:
    job = jobs["failed"]
    JobAttempt.objects.filter(job_ref=job.pk).update(claimed_at=Now() - timedelta(minutes=3))
    html = admin_client.get(change_url(job)).content.decode()
    times = re.findall(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)</time> <span class=\"dl-when\">", html)
    # created, run at, lease until, completed; claimed, last heartbeat, ended of the attempt.
    assert len(times) >= 7, times
    assert re.search(r"\d\d:\d\d:\d\d</time> <span class=\"dl-when\">3 min \d+ s ago", html)


def test_lists__the_workers_paused_kinds_kind_events_and_schedules_show_times_to_the_second(
    admin_client: Client,
) -> None:
    """The lists that showed a time to the minute (a worker's start, a pause, a kind event, a
    schedule's last enqueue) show it to the second, with the relative time beside it."""
    Worker.objects.register(
        "host-1:1:ab", instance="t", hostname="host-1", pid=1, kinds=["noop"], concurrency=1
    )
    PaymentJob.objects.pause_kind("noop", by="oncall", reason="PSP outage")
    ScheduleState.objects.create(
        name="nightly", job_model="django_leases.paymentjob", every=3600, last_tick=1
    )
    second = r"\d\d:\d\d:\d\d</time> <span class=\"dl-when\">"
    for model in ("worker", "pausedkind", "kindevent", "schedulestate"):
        html = admin_client.get(f"/admin/django_leases/{model}/").content.decode()
        assert re.search(second, html), model


def test_edit_pending__checks_the_bounds_an_enqueue_checks(settings: Any) -> None:
    """An edit is no way around an enqueue's checks: a priority out of range, a payload that is
    not JSON or over MAX_PAYLOAD_BYTES is refused and nothing is written."""
    settings.DJANGO_LEASES = {"MAX_PAYLOAD_BYTES": 64}
    job = PaymentJob.objects.enqueue("noop", {"amount": 1}, priority=2)
    for edits in ({"priority": 2**40}, {"payload": {"x": "y" * 100}}, {"payload": {1, 2}}):
        with pytest.raises(InvalidArgument):
            PaymentJob.objects.edit_pending(job.pk, edits, by="op", reason="fix")
    kept = PaymentJob.objects.values_list("priority", "payload").get(pk=job.pk)
    assert kept == (2, {"amount": 1})
    assert not JobEvent.objects.filter(job_ref=job.pk).exists()
