"""The admin in a real headless Chromium (Debian's), driven by Playwright's sync API.

Playwright's sync API runs an event loop in this thread, and Django refuses ORM calls while one
runs: so each test writes its rows first, drives the browser, and reads the rows after.
Screenshots land in build/screenshots/, those the docs show in docs/images/.
"""

import math
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection, connections
from django.db.models.functions import Now
from django.test import override_settings
from playwright.sync_api import Page, expect, sync_playwright

from django_leases.admin.payments import PaymentJobAdmin
from django_leases.models import JobAttempt, PaymentJob, QueueMinute, Worker
from django_leases.querysets.base import database_now
from django_leases.querysets.history import MINUTE, KindMinute, bucket_of

from .conftest import ROOT

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = ROOT / "build" / "screenshots"
# The screenshots docs/operations.md shows, made again by each run.
DOC_IMAGES = ROOT / "docs" / "images"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM}"),
]


@contextmanager
def chromium_page(base_url: str, width: int = 1400) -> Iterator[Page]:
    """A page of a fresh headless Chromium; never a browser downloaded by Playwright."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            context = browser.new_context(
                base_url=base_url, viewport={"width": width, "height": 900}
            )
            context.set_default_timeout(15_000)
            yield context.new_page()
        finally:
            browser.close()


def log_in(page: Page, then: str) -> None:
    """Log in as the `admin_user` fixture's superuser, then go to `then`."""
    page.goto(f"/admin/login/?next={then}")
    page.fill("#id_username", "admin")
    page.fill("#id_password", "password")
    page.click("input[type=submit]")


def queue_at_3am() -> dict[str, int]:
    """Two stuck leases, a healthy one, a near-expiry one, a backlog and an hour of history."""
    made = {}
    for name in ("stuck-a", "stuck-b", "healthy", "near", "waiting"):
        made[name] = PaymentJob.objects.enqueue(
            "capture", {"amount": 1250}, payment_id=f"pay_{name}", idempotency_key=f"cap-{name}"
        ).pk
    for name in ("stuck-a", "stuck-b", "healthy", "near"):
        PaymentJob.objects.claim_job(made[name], f"host-1:{name}", ttl=600)
    PaymentJob.objects.filter(pk__in=[made["stuck-a"], made["stuck-b"]]).update(
        lease_until=Now() - timedelta(minutes=5)
    )
    # Near expiry by the test's NEAR_EXPIRY of 300 s, yet minutes away from expiring: a slow run
    # (a loaded machine) must not see it turn stuck halfway through.
    PaymentJob.objects.filter(pk=made["near"]).update(lease_until=Now() + timedelta(seconds=240))
    PaymentJob.objects.filter(pk=made["waiting"]).update(run_at=Now() - timedelta(minutes=4))
    history = PaymentJob.objects.bulk_create(
        PaymentJob(kind="refund", payment_id=f"old_{i}") for i in range(120)
    )
    for i, job in enumerate(history):
        status = "failed" if i % 9 == 0 else "completed"
        PaymentJob.objects.filter(pk=job.pk).update(
            status=status, completed_at=Now() - timedelta(seconds=(i * 29) % 3500)
        )
    Worker.objects.register(
        "host-1:1234:ab12",
        instance="test",
        hostname="host-1",
        pid=1234,
        kinds=["capture"],
        concurrency=4,
    )
    return made


@override_settings(DJANGO_LEASES={"NEAR_EXPIRY": 300})
@pytest.mark.slow
def test_admin__release_a_stuck_lease_from_the_overview(live_server: Any, admin_user: Any) -> None:
    made = queue_at_3am()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    with chromium_page(live_server.url) as page:
        log_in(page, "/admin/")
        page.click("text=Queue overview")

        expect(page.locator("#dl-stuck .dl-value")).to_have_text("2")
        expect(page.locator("#dl-near-expiry .dl-value")).to_have_text("1")
        expect(page.locator("#dl-workers .dl-value")).to_have_text("1")
        expect(page.locator("#dl-stuck-jobs")).to_contain_text("pay_stuck-a")
        page.screenshot(path=SCREENSHOTS / "overview.png", full_page=True)

        page.click("#dl-stuck")
        rows = page.locator("#result_list tbody tr")
        expect(rows).to_have_count(2)
        expect(rows.first).to_contain_text("Stuck")
        expect(rows.first).to_contain_text(re.compile(r"expired 5 min \d+ s ago"))
        page.screenshot(path=SCREENSHOTS / "stuck-filter.png", full_page=True)

        page.check(f"input[name=_selected_action][value='{made['stuck-a']}']")
        page.select_option("select[name=action]", "release_stuck")
        page.click("button[name=index]")
        expect(page.locator("ul.messagelist")).to_contain_text("1 stuck job released")
        # Still filtered on stuck leases: only the other one is left.
        expect(rows).to_have_count(1)
        expect(rows.first).to_contain_text("pay_stuck-b")

        page.goto("/admin/django_leases/paymentjob/?q=pay_stuck-a")
        expect(rows.first.locator("td.field-status_badge")).to_have_text("Pending")
        page.screenshot(path=SCREENSHOTS / "released.png", full_page=True)

        # The job's page: lease fields read-only, the ledger says who released it.
        rows.first.locator("th.field-id a").click()
        ledger = page.locator("#attempt_log-group tbody tr.has_original")
        expect(ledger).to_have_count(1)
        expect(ledger.first).to_contain_text("Returned to pending after its lease expired")
        expect(ledger.first).to_contain_text("admin:admin")
        expect(page.locator("input[name=lease_owner], input[name=status]")).to_have_count(0)
        page.screenshot(path=SCREENSHOTS / "job.png", full_page=True)

    released = PaymentJob.objects.get(pk=made["stuck-a"])
    assert (released.status, released.attempts) == ("pending", 1)
    assert PaymentJob.objects.get(pk=made["stuck-b"]).status == "processing"
    assert PaymentJob.objects.get(pk=made["healthy"]).status == "processing"


@override_settings(DJANGO_LEASES={"LONG_RUNNING": 1800})
def test_admin__find_a_long_runner_through_the_filter(live_server: Any, admin_user: Any) -> None:
    made = {}
    for name, started in (("marathon", timedelta(hours=2)), ("sprint", timedelta(minutes=2))):
        job = PaymentJob.objects.enqueue("capture", payment_id=f"pay_{name}")
        claimed = PaymentJob.objects.claim_job(job.pk, f"host-1:{name}", ttl=600)
        assert claimed is not None
        # Heartbeating fine (its lease is live), but its attempt started `started` ago.
        JobAttempt.objects.filter(job_ref=job.pk, ended_at__isnull=True).update(
            claimed_at=Now() - started
        )
        made[name] = job.pk
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    with chromium_page(live_server.url) as page:
        log_in(page, "/admin/django_leases/paymentjob/")
        rows = page.locator("#result_list tbody tr")
        expect(rows).to_have_count(2)

        page.locator("#changelist-filter").get_by_role("link", name="Running long").click()
        expect(rows).to_have_count(1)
        expect(rows.first).to_contain_text("pay_marathon")
        expect(rows.first.locator("td.field-lease")).to_contain_text("Healthy")
        expect(rows.first.locator("td.field-running_for")).to_contain_text(
            re.compile(r"Running long\s+2 h 0 min")
        )
        page.screenshot(path=SCREENSHOTS / "running-long-filter.png", full_page=True)

        page.goto("/admin/django_leases/paymentjob/overview/")
        expect(page.locator("#dl-running-long .dl-value")).to_have_text("1")
        expect(page.locator("#dl-long-runners tbody tr")).to_have_count(1)
        expect(page.locator("#dl-long-runners")).to_contain_text("pay_marathon")
        expect(page.locator("#dl-long-runners")).not_to_contain_text("pay_sprint")
        page.screenshot(path=SCREENSHOTS / "running-long-overview.png", full_page=True)
        page.click("#dl-running-long")
        expect(rows).to_have_count(1)
        expect(rows.first).to_contain_text("pay_marathon")

    assert PaymentJob.objects.get(pk=made["marathon"]).status == "processing"


def two_days_of_history() -> None:
    """Minutes of history as the watcher writes them: a daily wave of captures, refunds, a
    failure now and then, waits that grow with the backlog."""
    now = database_now(connection.alias).replace(second=0, microsecond=0)
    label = PaymentJob._meta.label_lower
    rows = []
    for back in range(1, 2 * 24 * 60):
        minute = now - back * MINUTE
        wave = 1 + math.sin(back / 240)
        kinds: dict[str, KindMinute] = {}
        for kind, scale, took in (("capture", 40, 0.3), ("refund", 8, 1.5)):
            done = round(scale * wave)
            row = KindMinute(done, int(back % 37 == 0) * 2, int(back % 11 == 0), round(30 * wave))
            row.wait[bucket_of(0.05 * wave * wave)] = done
            row.run[bucket_of(took)] = done
            kinds[kind] = row
        total = KindMinute(depth=0)
        for kind, row in kinds.items():
            total.add(row)
            rows.append(QueueMinute(job_model=label, kind=kind, minute=minute, **row.fields()))
        rows.append(QueueMinute(job_model=label, kind="", minute=minute, **total.fields()))
    QueueMinute.objects.bulk_create(rows, batch_size=500)


def finish(pks: list[int]) -> None:
    """Claim and complete the jobs `pks` through the lease API, on a thread of its own: this
    thread runs Playwright's event loop, where Django refuses ORM calls."""

    def work() -> None:
        try:
            for pk in pks:
                job = PaymentJob.objects.claim_job(pk, "host-2:finisher", ttl=60)
                assert job is not None
                PaymentJob.objects.complete(pk, "host-2:finisher", job.lease_token)
        finally:
            connections.close_all()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)


@pytest.mark.slow
def test_admin__the_overview_refreshes_while_jobs_change_state(
    live_server: Any, admin_user: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(PaymentJobAdmin, "refresh_every", 0.5)
    two_days_of_history()
    due = [PaymentJob.objects.enqueue("capture", {"amount": 900 + i}).pk for i in range(5)]
    PaymentJob.objects.enqueue("refund", {"amount": 120})
    PaymentJob.objects.filter(kind="capture").update(run_at=Now() - timedelta(seconds=95))
    Worker.objects.register(
        "host-1:1234:ab12",
        instance="t",
        hostname="host-1",
        pid=1234,
        kinds=["capture", "refund"],
        concurrency=4,
    )
    DOC_IMAGES.mkdir(parents=True, exist_ok=True)

    with chromium_page(live_server.url, width=1440) as page:
        log_in(page, "/admin/django_leases/paymentjob/overview/")
        live = page.locator("#dl-live")
        capture = page.locator('#dl-kinds tr[data-kind="capture"]')
        expect(capture.locator("a.dl-due")).to_have_text("5")
        expect(capture.locator("a.dl-running")).to_have_text("0 / 4")
        expect(page.locator("#dl-throughput rect.dl-bar-hover")).to_have_count(60)
        # Every recorded minute of the hour has a bar (the seeded ones end a minute ago).
        assert page.locator("#dl-throughput rect.dl-bar-completed").count() >= 58
        page.screenshot(path=DOC_IMAGES / "overview-live.png", full_page=True)

        # Jobs finish while the page is open: it shows them without a reload.
        finish(due[:2])
        expect(capture.locator("a.dl-due")).to_have_text("3")
        expect(page.locator("#dl-completed .dl-value")).to_have_text("2")

        # Paused, it stays as it was; resumed, it catches up.
        page.click("#dl-refresh-toggle")
        expect(page.locator("#dl-refresh-toggle")).to_have_attribute("aria-pressed", "true")
        expect(page.locator("#dl-refresh-state")).to_have_text("Refresh paused.")
        refreshes = live.get_attribute("data-refreshes")
        finish(due[2:3])
        page.wait_for_timeout(2000)  # four refresh periods
        expect(live).to_have_attribute("data-refreshes", refreshes or "")
        expect(capture.locator("a.dl-due")).to_have_text("3")
        page.click("#dl-refresh-toggle")
        expect(capture.locator("a.dl-due")).to_have_text("2")

        # The history over a week, then one kind's.
        page.click("#dl-span-week")
        expect(page.locator("#dl-history h2")).to_contain_text("last week: every kind")
        expect(page.locator("#dl-throughput rect.dl-bar-hover")).to_have_count(168)
        page.locator("#dl-history").screenshot(path=DOC_IMAGES / "history-week.png")
        page.locator("#dl-history .dl-spans").get_by_role("link", name="refund").click()
        expect(page.locator("#dl-history h2")).to_contain_text("last week: refund")
        # A cell links to the jobs it counts.
        page.locator('#dl-kinds tr[data-kind="capture"] a.dl-due').click()
        expect(page.locator("#result_list tbody tr")).to_have_count(2)

    left = PaymentJob.objects.filter(kind="capture", status="pending").count()
    assert left == 2
