"""The admin in a real headless Chromium (Debian's), driven by Playwright's sync API.

Playwright's sync API runs an event loop in this thread, and Django refuses ORM calls while one
runs: so each test writes its rows first, drives the browser, and reads the rows after.
Screenshots land in build/screenshots/.
"""

import re
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db.models.functions import Now
from django.test import override_settings
from playwright.sync_api import Page, expect, sync_playwright

from django_leases.models import JobAttempt, PaymentJob, Worker

from .conftest import ROOT

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = ROOT / "build" / "screenshots"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM}"),
]


@contextmanager
def chromium_page(base_url: str) -> Iterator[Page]:
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
                base_url=base_url, viewport={"width": 1400, "height": 900}
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
