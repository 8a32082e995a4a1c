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
from django.contrib.auth.models import Permission
from django.db import connection, connections
from django.db.models.functions import Now
from django.test import override_settings
from playwright.sync_api import Page, expect, sync_playwright

from django_leases.admin.payments import PaymentJobAdmin
from django_leases.models import JobAttempt, JobEvent, PaymentJob, QueueMinute, Worker
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


# ---- the audit: permissions per action, the operator events, a payment's timeline -----------

DOCS_IMAGES = ROOT / "docs" / "images"
PASSWORD = "pw-support-1"  # noqa: S105 - a test user's, on a throwaway database
# Each guarded action, the job of `review_queue()` it acts on, and what it then says.
GUARDED = {
    "force_requeue": ("running", "1 job requeued by force"),
    "force_cancel": ("running", "1 job cancelled by force"),
    "resolve_review_completed": ("review", "1 job under review completed"),
    "resolve_review_failed": ("review", "1 job under review failed"),
}


@contextmanager
def wide_page(base_url: str) -> Iterator[Page]:
    """A page of 1440 x 900, an operator's laptop screen."""
    with chromium_page(base_url) as page:
        page.set_viewport_size({"width": 1440, "height": 900})
        yield page


def review_queue() -> dict[str, int]:
    """A running job (payment pay_77) and one under review (pay_78)."""
    made = {}
    for name, payment in (("running", "pay_77"), ("review", "pay_78")):
        made[name] = PaymentJob.objects.enqueue(
            "capture", {"amount": 990}, payment_id=payment, idempotency_key=f"k-{name}"
        ).pk
        # An owner as long as the default's: host name, process id, random part.
        PaymentJob.objects.claim_job(
            made[name], f"app-7.eu-west-1:4821{len(name)}:5f2a9c1d", ttl=600
        )
    PaymentJob.objects.filter(pk=made["review"]).update(lease_until=Now() - timedelta(minutes=1))
    review = PaymentJob.objects.get(pk=made["review"])
    assert PaymentJob.objects.rescue(review, "review", by="watcher")
    return made


def grant(user: Any, *codenames: str) -> None:
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename))


def log_in_as(page: Page, username: str, then: str) -> None:
    page.goto(f"/admin/login/?next={then}")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")


@pytest.mark.slow
@pytest.mark.parametrize("action", list(GUARDED))
def test_admin__each_dangerous_action_needs_its_permission(
    live_server: Any, django_user_model: Any, action: str
) -> None:
    made = review_queue()
    name, done = GUARDED[action]
    support = django_user_model.objects.create_user("support", password=PASSWORD, is_staff=True)
    grant(support, "view_paymentjob", "change_paymentjob")
    lead = django_user_model.objects.create_user("lead", password=PASSWORD, is_staff=True)
    grant(lead, "view_paymentjob", "change_paymentjob", f"{action}_paymentjob")
    options = "select[name=action] option"

    with wide_page(live_server.url) as page:
        log_in_as(page, "support", "/admin/django_leases/paymentjob/")
        expect(page.locator("#result_list tbody tr")).to_have_count(2)
        expect(page.locator(f"{options}[value={action}]")).to_have_count(0)
        expect(page.locator(f"{options}[value=requeue]")).to_have_count(1)
        page.context.clear_cookies()

        log_in_as(page, "lead", "/admin/django_leases/paymentjob/")
        page.check(f"input[name=_selected_action][value='{made[name]}']")
        page.select_option("select[name=action]", action)
        page.click("button[name=index]")  # no reason: refused
        expect(page.locator("ul.messagelist")).to_contain_text("needs a reason")
        page.check(f"input[name=_selected_action][value='{made[name]}']")
        page.select_option("select[name=action]", action)
        page.fill("input[name=reason]", "PSP says the capture went through")
        page.click("button[name=index]")
        if action == "force_cancel":
            expect(page.locator("p.dl-reason")).to_contain_text("PSP says")
            page.click("input[type=submit]")
        expect(page.locator("ul.messagelist")).to_contain_text(done)

    event = JobEvent.objects.get(job_ref=made[name])
    assert (event.by, event.reason) == ("admin:lead", "PSP says the capture went through")


@pytest.mark.slow
def test_admin__audit_list_timeline_and_a_readable_job_list(
    live_server: Any, admin_user: Any
) -> None:
    made = review_queue()
    PaymentJob.objects.filter(pk=made["running"]).update(
        last_error="ConnectionError: PSP gateway timed out after 30 s (attempt 1 of 5, retrying)"
    )
    refund = PaymentJob.objects.enqueue("refund", {"amount": 990}, payment_id="pay_78").pk
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)

    with wide_page(live_server.url) as page:
        log_in(page, "/admin/django_leases/paymentjob/")
        rows = page.locator("#result_list tbody tr")
        expect(rows).to_have_count(3)
        page.screenshot(path=SCREENSHOTS / "job-list-1440.png", full_page=True)
        # At 1440 px nothing is cut: the table fits the page, and the owner, attempts, last
        # heartbeat and last error cells show their whole text on one line or wrap.
        assert page.evaluate("document.documentElement.scrollWidth") <= 1440
        results = page.locator("#changelist .results")
        widths = "r => [r.scrollWidth, r.clientWidth]"
        assert results.evaluate("r => r.scrollWidth <= r.clientWidth"), results.evaluate(widths)
        running = rows.filter(has_text="pay_77")
        right = results.evaluate("r => r.getBoundingClientRect().right")
        for column in ("owner", "attempts_of_max", "heartbeat", "last_error_short"):
            cell = running.locator(f"td.field-{column}")
            assert cell.evaluate("c => c.scrollWidth <= c.clientWidth"), column
            assert cell.evaluate("c => c.getBoundingClientRect().right") <= right, column
        expect(running.locator("td.field-heartbeat")).to_contain_text(
            re.compile(r"\d\d:\d\d:\d\d\s+\d+ s ago")
        )

        page.check(f"input[name=_selected_action][value='{made['review']}']")
        page.select_option("select[name=action]", "resolve_review_failed")
        page.fill("input[name=reason]", "PSP: capture declined, card expired")
        page.click("button[name=index]")
        expect(page.locator("ul.messagelist")).to_contain_text("1 job under review failed")
        page.goto(f"/admin/django_leases/paymentjob/{refund}/change/")
        page.fill("textarea[name=payload]", '{"amount": 500}')
        page.fill("textarea[name=reason]", "partial refund agreed with the customer")
        page.click("input[name=_save]")
        expect(page.locator("ul.messagelist")).to_contain_text("was changed successfully")

        page.goto("/admin/django_leases/jobevent/")
        events = page.locator("#result_list tbody tr")
        expect(events).to_have_count(2)
        expect(events.first).to_contain_text("partial refund agreed")
        expect(events.first).to_contain_text("payload: {'amount': 990} → {'amount': 500}")
        expect(page.locator("#changelist-filter")).to_contain_text("Review resolved: failed")
        page.screenshot(path=DOCS_IMAGES / "operator-events.png", full_page=True)

        page.goto(f"/admin/django_leases/paymentjob/{made['review']}/history/")
        expect(page.locator("#change-history")).to_contain_text("PSP: capture declined")

        page.goto(f"/admin/django_leases/paymentjob/{made['review']}/change/")
        page.get_by_role("link", name="every job of this payment").click()
        timeline = page.locator("#dl-timeline tbody tr")
        expect(timeline.first).to_contain_text("enqueued")
        expect(page.locator("#dl-timeline")).to_contain_text(
            "attempt 1 claimed by app-7.eu-west-1:48216"
        )
        expect(page.locator("#dl-timeline")).to_contain_text("Held for review by the watcher")
        expect(page.locator("#dl-timeline")).to_contain_text(
            "Review resolved: failed by admin:admin"
        )
        expect(page.locator("#dl-timeline")).to_contain_text("Edited (priority or payload)")
        page.screenshot(path=DOCS_IMAGES / "payment-timeline.png", full_page=True)

    assert PaymentJob.objects.get(pk=made["review"]).status == "failed"
    assert PaymentJob.objects.get(pk=refund).payload == {"amount": 500}
