"""The live overview: its fragment (permissions, what it costs), the table per kind and its
links, the history charts, and "Run now" on the schedules."""

import re
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.urls import reverse

from django_leases.admin.charts import SPANS
from django_leases.models import JobEvent, PaymentJob, QueueMinute, ScheduleState, Worker
from django_leases.querysets.base import database_now
from django_leases.querysets.history import ALL_KINDS, BOUNDS, MINUTE, bucket_of
from django_leases.schedules import enqueue_due
from django_leases.tables import queue_history

from .test_admin import OVERVIEW, OVERVIEW_QUERIES, bulk_jobs, kind_cells

pytestmark = pytest.mark.django_db

LIVE = "admin:django_leases_paymentjob_overview_live"
SCHEDULES = "admin:django_leases_schedulestate_changelist"
# The page's (test_admin.OVERVIEW_QUERIES): the fragment is the page's content.
LIVE_QUERIES = OVERVIEW_QUERIES


def test_live__needs_a_login_and_a_permission_on_jobs(
    client: Client, django_user_model: Any
) -> None:
    response = client.get(reverse(LIVE))
    assert response.status_code == 302 and "/login/" in response["Location"]
    staff = django_user_model.objects.create_user("staff", is_staff=True)
    client.force_login(staff)
    assert client.get(reverse(LIVE)).status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="view_paymentjob"))
    response = client.get(reverse(LIVE))
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    html = response.content.decode()
    # The content alone: no page around it, the same sections as the page's.
    assert "<html" not in html and 'id="dl-kinds"' in html and 'id="dl-throughput"' in html


def test_overview__refreshes_from_the_live_fragment(admin_client: Client) -> None:
    html = admin_client.get(reverse(OVERVIEW)).content.decode()
    live = re.search(r'<div id="dl-live" data-src="([^"]+)" data-every="([^"]+)"', html)
    assert live is not None and live.groups() == (reverse(LIVE), "5")
    assert 'id="dl-refresh-toggle"' in html
    fragment = admin_client.get(reverse(LIVE)).content.decode()
    # The page embeds what the fragment serves.
    assert re.sub(r"\s+", " ", fragment).strip()[:400] in re.sub(r"\s+", " ", html)


@pytest.mark.parametrize("rows", [16, 2000])
def test_live__query_count_does_not_grow_with_rows(
    admin_client: Client, django_assert_num_queries: Any, rows: int
) -> None:
    bulk_jobs(rows)
    with django_assert_num_queries(LIVE_QUERIES):
        response = admin_client.get(reverse(LIVE))
    kinds = {row.kind: row for row, _ in response.context["kinds"]}
    assert {"k0", "k1", "k2"} <= set(kinds)
    assert sum(row.running for row in kinds.values()) == 3 * (rows // 8)


def test_kinds__each_cell_counts_what_it_links_to(admin_client: Client, settings: Any) -> None:
    settings.DJANGO_LEASES = {"NEAR_EXPIRY": 20}
    for _ in range(3):
        PaymentJob.objects.enqueue("capture")
    later = PaymentJob.objects.enqueue("capture", run_at=3600)  # not due
    running = PaymentJob.objects.enqueue("capture")
    PaymentJob.objects.claim_job(running.pk, "w1", ttl=60)
    failed = PaymentJob.objects.enqueue("capture")
    claimed = PaymentJob.objects.claim_job(failed.pk, "w1", ttl=60)
    assert claimed is not None
    PaymentJob.objects.fail(failed.pk, "w1", claimed.lease_token, ValueError("x"), permanent=True)
    PaymentJob.objects.filter(kind="capture", status="pending").exclude(pk=later.pk).update(
        run_at=Now() - timedelta(minutes=2)
    )
    Worker.objects.register(
        "w-a", instance="t", hostname="h", pid=1, kinds=["capture", "refund"], concurrency=4
    )
    Worker.objects.register(
        "w-b", instance="t", hostname="h", pid=2, kinds=["refund"], concurrency=2
    )
    PaymentJob.objects.pause_kind("capture", by="ops")
    PaymentJob.objects.enqueue("refund")

    html = admin_client.get(reverse(OVERVIEW)).content.decode()

    cells = kind_cells(html, "capture")
    assert cells[0] == "capture" and cells[1] == "3"
    assert re.fullmatch(r"2 min \d+ s", cells[2])
    assert cells[3:5] == ["1 / 4", "1"] and cells[7] == "paused"
    assert cells[10] == "1"
    assert kind_cells(html, "refund")[3:5] == ["0 / 6", "2"]
    row = re.search(r'data-kind="capture">(.*?)</tr>', html, re.S)
    assert row is not None
    links = {
        name: href.replace("&amp;", "&")
        for name, href in re.findall(
            r'<a class="dl-(due|running|failed)[^"]*" href="([^"]+)"', row.group(1)
        )
    }
    expected = {"due": 3, "running": 1, "failed": 1}
    for name, href in links.items():
        listing = admin_client.get(href)
        assert listing.status_code == 200, href
        shown = listing.context["cl"].result_list
        assert (name, len(shown)) == (name, expected[name]), href
        assert {job.kind for job in shown} == {"capture"}
    assert set(links) == set(expected)


def test_kinds__waits_and_run_times_of_the_last_hour_of_history(admin_client: Client) -> None:
    now = database_now(connection.alias).replace(second=0, microsecond=0)
    label = PaymentJob._meta.label_lower
    counts = [0] * (len(BOUNDS) + 1)
    counts[bucket_of(0.3)] = 10
    for back, kind in ((5, "capture"), (30, "capture"), (90, "capture")):
        QueueMinute.objects.create(
            job_model=label,
            kind=kind,
            minute=now - back * MINUTE,
            completed=10,
            retried=2,
            wait_counts=counts,
            run_counts=counts,
        )
    html = admin_client.get(reverse(OVERVIEW)).content.decode()
    cells = kind_cells(html, "capture")
    # Two minutes in the hour (the third is older): (0.25, 0.5] holds every job.
    assert cells[8] == "0.375 / 0.488 s" == cells[9]
    assert "(+4 retried)" in cells[10]


def test_history__charts_each_span_of_a_kind_and_of_every_kind(admin_client: Client) -> None:
    job = PaymentJob.objects.enqueue("capture")
    claimed = PaymentJob.objects.claim_job(job.pk, "w1", ttl=60)
    assert claimed is not None
    PaymentJob.objects.complete(job.pk, "w1", claimed.lease_token)
    PaymentJob.objects.filter(pk=job.pk).update(completed_at=Now() - timedelta(minutes=2))
    assert queue_history(connection.alias).record(PaymentJob.objects.all())
    for span in SPANS.values():
        for kind in ("", "capture"):
            response = admin_client.get(reverse(OVERVIEW), {"span": span.name, "kind": kind})
            html = response.content.decode()
            chart = response.context["chart"]
            assert (chart["span"], chart["totals"]["completed"]) == (span, 1)
            assert html.count('<rect class="dl-bar-hover"') == span.bins
            assert html.count('<rect class="dl-bar-completed"') == 1
            assert re.search(
                rf'aria-current="true" class="dl-current" id="dl-span-{span.name}"', html
            )
            assert 'class="dl-line dl-run_p95"' in html, (span, kind)
            # The backlog is known for the newest minute of every kind (none of "capture").
            assert ('class="dl-line dl-depth-line"' in html) == (kind == ""), (span, kind)
    # A kind without history: empty bars.
    response = admin_client.get(reverse(OVERVIEW), {"kind": "refund"})
    assert response.context["chart"]["totals"]["completed"] == 0
    assert QueueMinute.objects.filter(kind=ALL_KINDS).exists()


# ---- run a schedule now ---------------------------------------------------------------------


@override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": {"kind": "noop", "every": 10**7}}})
def test_run_now__from_the_schedules_admin(
    admin_client: Client, client: Client, django_user_model: Any
) -> None:
    enqueue_due()
    state = ScheduleState.objects.get(name="beat")
    ScheduleState.objects.create(
        job_model=state.job_model, name="gone", every=60, last_tick=1, start_tick=1
    )
    response = admin_client.post(
        reverse(SCHEDULES),
        {"action": "run_now", "_selected_action": [state.pk, state.pk + 1]},
        follow=True,
    )
    messages = [str(m) for m in response.context["messages"]]
    job = PaymentJob.objects.get(idempotency_key__startswith="schedule:beat:now:")
    assert messages == [
        f"Enqueued now: beat (#{job.pk}).",
        "Not run, no such schedule in the settings for this job table: gone.",
    ]
    assert JobEvent.objects.get(job_ref=job.pk).by == "admin"

    # A viewer of the schedules is not offered the action, and cannot post it.
    viewer = django_user_model.objects.create_user("viewer", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_schedulestate"))
    client.force_login(viewer)
    assert client.get(reverse(SCHEDULES)).context["action_form"] is None
    client.post(reverse(SCHEDULES), {"action": "run_now", "_selected_action": [state.pk]})
    assert PaymentJob.objects.count() == 1
    viewer.user_permissions.add(Permission.objects.get(codename="run_schedule"))
    client.post(reverse(SCHEDULES), {"action": "run_now", "_selected_action": [state.pk]})
    assert PaymentJob.objects.count() == 2
    assert JobEvent.objects.filter(action="run_now", by="viewer").count() == 1
