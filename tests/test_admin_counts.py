"""The admin's counts: exact up to ADMIN_EXACT_COUNT_LIMIT, estimated or "more than" beyond it,
and labelled so, on the overview and the job changelist."""

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_leases import stats
from django_leases.admin.counts import tally_html
from django_leases.dialects import mysql_statements
from django_leases.models import PaymentJob
from django_leases.stats import ESTIMATED, EXACT, MORE_THAN, Tally

from .conftest import ON_SQLITE

CHANGELIST = "admin:django_leases_paymentjob_changelist"
OVERVIEW = "admin:django_leases_paymentjob_overview"
# Jobs per status in the tests that go past the limit.
ROWS = {"completed": 1200, "failed": 300, "pending": 150, "review": 5}
ESTIMATE_TITLE = "estimated from the database&#x27;s statistics"


def load(rows: dict[str, int], *, analyze: bool = False) -> None:
    """Insert `rows` jobs per status; with `analyze`, refresh the database's statistics
    (PostgreSQL, MariaDB), as autovacuum or a DBA would on a table that grew. MariaDB's ANALYZE
    TABLE commits: only a `transaction=True` test may ask for it."""
    PaymentJob.objects.bulk_create(
        PaymentJob(kind="capture", status=status) for status, n in rows.items() for _ in range(n)
    )
    if analyze and not ON_SQLITE:
        table = connection.ops.quote_name(PaymentJob._meta.db_table)
        analyze = "ANALYZE TABLE" if connection.vendor == "mysql" else "ANALYZE"
        with connection.cursor() as cursor:
            cursor.execute(f"{analyze} {table}")
            if connection.vendor == "mysql":
                cursor.fetchall()


def assert_estimate(tally: Tally, truth: int, limit: int) -> None:
    """An estimate within a factor of two of the truth where the database keeps statistics;
    on SQLite, which keeps none, "more than `limit`"."""
    if ON_SQLITE:
        assert tally == Tally(limit, MORE_THAN)
    else:
        assert tally.how == ESTIMATED
        assert truth / 2 <= tally.n <= truth * 2, (tally, truth)


# ---- below the limit: exact ----------------------------------------------------------------


@pytest.mark.django_db
def test_overview__exact_below_the_limit(admin_client: Client) -> None:
    load({"completed": 40, "failed": 3, "pending": 7})
    response = admin_client.get(reverse(OVERVIEW))
    data = response.context["overview"]
    assert data.by_status["completed"] == Tally(40)
    assert data.by_status["pending"] == Tally(7) and data.by_status["waiting"] == Tally(0)
    assert data.total == Tally(50)
    html = response.content.decode()
    assert 'id="dl-count-completed">40<' in html and 'class="dl-approx"' not in html


@pytest.mark.django_db
def test_changelist__exact_below_the_limit(admin_client: Client) -> None:
    load({"completed": 250, "pending": 5})
    for params, expected in (({}, 255), ({"status": "completed"}, 250)):
        response = admin_client.get(reverse(CHANGELIST), params)
        cl = response.context["cl"]
        assert (cl.result_count, cl.paginator.tally) == (expected, Tally(expected))
        html = response.content.decode()
        assert f"{expected} payment jobs" in html and 'class="dl-approx"' not in html


# ---- beyond the limit: estimated, or "more than" -----------------------------------------


@pytest.mark.django_db(transaction=True)
def test_overview__finished_statuses_estimated_beyond_the_limit(
    admin_client: Client, settings: Any
) -> None:
    settings.DJANGO_LEASES = {"ADMIN_EXACT_COUNT_LIMIT": 100}
    load(ROWS, analyze=True)
    response = admin_client.get(reverse(OVERVIEW))
    data = response.context["overview"]
    assert_estimate(data.by_status["completed"], ROWS["completed"], 100)
    assert_estimate(data.by_status["failed"], ROWS["failed"], 100)
    # A live status moves too fast for statistics: it is only said to be beyond the limit.
    assert data.by_status["pending"] == Tally(100, MORE_THAN)
    assert data.by_status["review"] == Tally(5) and data.by_status["cancelled"] == Tally(0)
    assert data.total.how == (MORE_THAN if ON_SQLITE else ESTIMATED)
    html = response.content.decode()
    assert 'id="dl-count-review">5<' in html
    assert 'id="dl-count-pending"><span class="dl-approx" title="' in html
    assert ">more than 100</span>" in html
    if not ON_SQLITE:
        completed = tally_html(data.by_status["completed"])
        assert f'id="dl-count-completed">{completed}<' in html
        assert f'title="{ESTIMATE_TITLE}">≈ ' in completed


@pytest.mark.django_db(transaction=True)
def test_changelist__whole_table_estimated_filtered_list_capped(
    admin_client: Client, settings: Any
) -> None:
    settings.DJANGO_LEASES = {"ADMIN_EXACT_COUNT_LIMIT": 100}
    load(ROWS, analyze=True)
    total = sum(ROWS.values())
    # The limit never goes below "Show all"'s 200 rows: a list counted shorter loads whole.
    response = admin_client.get(reverse(CHANGELIST))
    cl = response.context["cl"]
    assert_estimate(cl.paginator.tally, total, 200)
    assert len(cl.result_list) == 100 and cl.multi_page and not cl.can_show_all
    html = response.content.decode()
    assert 'class="showall"' not in html
    if ON_SQLITE:
        assert ">more than 200</span> payment jobs" in html
    else:
        assert f'title="{ESTIMATE_TITLE}">≈ ' in html and "</span> payment jobs" in html

    response = admin_client.get(reverse(CHANGELIST), {"status": "completed", "p": "2"})
    cl = response.context["cl"]
    assert cl.paginator.tally == Tally(200, MORE_THAN) and cl.result_count == 201
    assert len(cl.result_list) == 100
    assert {job.status for job in cl.result_list} == {"completed"}
    html = response.content.decode()
    assert ">more than 200</span> payment jobs" in html
    # The actions' "select all" says the same, in both of its places.
    assert 'Select all <span class="dl-approx"' in html and "All more than 200 selected" in html


# ---- the pieces ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_capped_count__reads_no_further_than_the_cap() -> None:
    load({"completed": 30})
    jobs = PaymentJob.objects.all()
    assert jobs.capped_count(10) == 11
    assert jobs.capped_count(30) == jobs.capped_count(100) == 30
    assert jobs.filter(status="pending").capped_count(10) == 0


@pytest.mark.django_db
def test_estimated_count__none_without_statistics_else_the_planners() -> None:
    estimate = PaymentJob.objects.estimated_count("completed")
    if ON_SQLITE:
        assert estimate is None and PaymentJob.objects.estimated_count() is None
    else:
        assert isinstance(estimate, int) and estimate >= 0


def test_mysql_status_estimate__the_table_less_the_others_past_innodbs_half_table_cap() -> None:
    # As MariaDB 10.11 estimated 1M completed jobs beside 2,000 live ones: half the table.
    assert mysql_statements.status_estimate(497_062, 2_100, 994_125) == 992_025
    assert mysql_statements.status_estimate(497_063, 2_100, 994_125) == 992_025
    # A minority status is estimated directly; its complement is the capped one.
    assert mysql_statements.status_estimate(1_000, 497_062, 994_125) == 1_000
    assert mysql_statements.status_estimate(0, 0, 0) == 0


def test_tally__sum_is_as_uncertain_as_its_least_certain_part() -> None:
    assert Tally.sum([Tally(3), Tally(4)]) == Tally(7)
    assert Tally.sum([Tally(3), Tally(10, MORE_THAN)]) == Tally(13, MORE_THAN)
    assert Tally.sum([Tally(10, MORE_THAN), Tally(900, ESTIMATED)]) == Tally(910, ESTIMATED)
    assert Tally.sum([]) == Tally(0, EXACT)


def test_tally_html__labels_what_is_not_exact() -> None:
    assert tally_html(Tally(1234)) == "1234"
    assert tally_html(Tally(1_234_567, ESTIMATED)) == (
        f'<span class="dl-approx" title="{ESTIMATE_TITLE}">≈ 1,200,000</span>'
    )
    assert tally_html(Tally(45, ESTIMATED)).endswith(">≈ 45</span>")
    assert tally_html(Tally(10_000, MORE_THAN)).endswith(">more than 10,000</span>")


@pytest.mark.django_db
def test_tally__stale_estimate_below_the_limit_says_more_than() -> None:
    load({"completed": 30})
    jobs = PaymentJob.objects.all()
    assert stats.tally(jobs, 10, lambda: 5) == Tally(10, MORE_THAN)
    assert stats.tally(jobs, 10, lambda: None) == Tally(10, MORE_THAN)
    assert stats.tally(jobs, 10, lambda: 500) == Tally(500, ESTIMATED)
    assert stats.tally(jobs, 30, lambda: 500) == Tally(30)
