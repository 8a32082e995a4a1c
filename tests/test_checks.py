"""System checks for DJANGO_LEASES: each bad value is reported with a stable id."""

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import django
import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connection, connections
from django.test import override_settings

from django_leases.checks import (
    check_job_model,
    check_ledgers,
    check_settings,
    check_tasks_framework,
)
from django_leases.checks.databases import (
    autovacuum_problems,
    check_autovacuum,
    check_database_clock,
    check_pending_kinds,
    check_sqlite_transaction_mode,
    database_clock_problems,
    sqlite_without_immediate,
)
from django_leases.checks.schedules import check_schedules
from django_leases.conf import DEFAULTS
from django_leases.limits import (
    BATCH_SIZE,
    EXACT_COUNT_LIMIT,
    MAX_ATTEMPTS,
    MAX_DURATION,
    PAYLOAD_BYTES,
)
from django_leases.models import PaymentJob
from django_leases.tables import leased_jobs
from tests.testapp.models import PayoutJob

from .conftest import ROOT, Processes, subprocess_env, wait_for


def ids(**settings: object) -> list[str]:
    with override_settings(DJANGO_LEASES=settings):
        return [message.id for message in check_settings()]


def test_check_settings__defaults_are_clean() -> None:
    assert ids() == []


@override_settings(DJANGO_LEASES=["TTL", 60])
def test_check_settings__not_a_dict() -> None:
    assert [m.id for m in check_settings()] == ["django_leases.E001"]


def test_check_settings__unknown_key_warns() -> None:
    assert ids(TTL=60, HEARTBAET=10) == ["django_leases.W001"]


@pytest.mark.parametrize(
    "value", [0, -5, "60", None, True, float("nan"), float("inf"), 1e300, MAX_DURATION + 1]
)
def test_check_settings__non_positive_non_numeric_or_too_long_duration(value: object) -> None:
    assert "django_leases.E002" in ids(TTL=value)
    assert ids(WATCH_INTERVAL=value) == ["django_leases.E002"]
    assert ids(LONG_RUNNING=value) == ["django_leases.E002"]


def test_check_settings__heartbeat_not_shorter_than_ttl() -> None:
    assert ids(TTL=30, HEARTBEAT=30) == ["django_leases.E003"]
    assert "django_leases.E003" in ids(TTL=30, HEARTBEAT=45.5)
    assert ids(TTL=30, HEARTBEAT=10, NEAR_EXPIRY=10) == []


def test_check_settings__near_expiry_not_shorter_than_ttl_warns() -> None:
    assert ids(TTL=30, HEARTBEAT=10, NEAR_EXPIRY=30) == ["django_leases.W002"]


@pytest.mark.parametrize("value", [0, 2.5, "4", True, 1001])
def test_check_settings__counts_must_be_whole_and_in_range(value: object) -> None:
    assert ids(CONCURRENCY=value) == ["django_leases.E004"]


def test_check_settings__count_bounds_come_from_limits() -> None:
    assert ids(MAX_ATTEMPTS=2**31) == ["django_leases.E004"]
    assert ids(MAX_ATTEMPTS=MAX_ATTEMPTS[1], PRUNE_BATCH_SIZE=BATCH_SIZE[1]) == []
    assert ids(PRUNE_BATCH_SIZE=BATCH_SIZE[1] + 1) == ["django_leases.E004"]


@pytest.mark.parametrize("value", [0, -1, 2.5, "10000", None, True, EXACT_COUNT_LIMIT[1] + 1])
def test_check_settings__admin_exact_count_limit_whole_and_in_range(value: object) -> None:
    assert ids(ADMIN_EXACT_COUNT_LIMIT=value) == ["django_leases.E004"]
    assert ids(ADMIN_EXACT_COUNT_LIMIT=EXACT_COUNT_LIMIT[0]) == []
    assert ids(RETENTION={"completed": 1e300}) == ["django_leases.E007"]


@pytest.mark.parametrize("value", [0, -1, 2.5, "1MiB", None, True, PAYLOAD_BYTES[1] + 1])
def test_check_settings__max_payload_bytes_whole_and_in_range(value: object) -> None:
    assert ids(MAX_PAYLOAD_BYTES=value) == ["django_leases.E004"]
    assert ids(MAX_PAYLOAD_BYTES=PAYLOAD_BYTES[1]) == []


def test_check_settings__policies() -> None:
    assert ids(STUCK_POLICY="ignore") == ["django_leases.E005"]
    assert ids(STUCK_POLICY_BY_KIND={"capture": "maybe"}) == ["django_leases.E006"]
    assert ids(STUCK_POLICY_BY_KIND=["capture"]) == ["django_leases.E006"]
    assert ids(STUCK_POLICY_BY_KIND={"risky": "review"}) == []


def test_check_settings__retention_backoff_and_booleans() -> None:
    assert ids(RETENTION={"done": 5}) == ["django_leases.E007"]
    assert ids(RETENTION={"completed": -1}) == ["django_leases.E007"]
    assert ids(BACKOFF_BASE=10, BACKOFF_MAX=5) == ["django_leases.E008"]
    assert ids(USE_NOTIFY="yes") == ["django_leases.E009"]
    assert ids(LOCK_BY_PAYMENT="yes") == ["django_leases.E009"]
    assert ids(LOCK_BY_PAYMENT=False) == []
    assert ids(TRACING="off") == ["django_leases.E009"]
    assert ids(TRACING=False) == []


def test_check_settings__messages_carry_hints() -> None:
    with override_settings(DJANGO_LEASES={"TTL": -1}):
        (message,) = check_settings()
    assert "TTL" in message.msg and "-1" in message.msg and message.hint


@pytest.mark.django_db  # Django 6's model checks ask SQLite about its JSON support
@override_settings(DJANGO_LEASES={"TTL": 10, "HEARTBEAT": 20})
def test_check_settings__manage_py_check_fails_on_errors() -> None:
    with pytest.raises(SystemCheckError, match="django_leases.E003"):
        call_command("check", databases=[])  # Django 6.1 would ask every database


def test_check_settings__worker_gone_after_needs_two_heartbeats() -> None:
    assert ids(TTL=30, HEARTBEAT=20, WORKER_GONE_AFTER=30) == ["django_leases.E010"]
    assert ids(TTL=30, HEARTBEAT=20, WORKER_GONE_AFTER=40) == []


def test_check_settings__warns_of_a_ttl_longer_than_worker_gone_after() -> None:
    """The docs' own "slow, flaky infrastructure" profile passed: TTL 300, heartbeat 60,
    WORKER_GONE_AFTER 120. A cut-off worker gives its leases up at WORKER_GONE_AFTER."""
    assert ids(TTL=300, HEARTBEAT=60, WORKER_GONE_AFTER=120) == ["django_leases.W012"]
    assert ids(TTL=300, HEARTBEAT=60, WORKER_GONE_AFTER=360) == []
    assert ids(TTL=120, HEARTBEAT=20, WORKER_GONE_AFTER=120) == []


def redactor_hook(exc: BaseException, text: str) -> str:
    return text


def test_check_settings__redact_errors_must_be_an_importable_callable() -> None:
    assert ids(REDACT_ERRORS="tests.test_checks.redactor_hook") == []
    assert ids(REDACT_ERRORS="tests.test_checks.nowhere") == ["django_leases.E012"]
    assert ids(REDACT_ERRORS="no_such_module.hook") == ["django_leases.E012"]
    assert ids(REDACT_ERRORS="tests.test_checks.MAX_DURATION") == ["django_leases.E012"]
    assert ids(REDACT_ERRORS=redactor_hook) == ["django_leases.E012"]


def test_check_sqlite_transaction_mode__warns_without_immediate() -> None:
    assert check_sqlite_transaction_mode() == []  # the test settings have it
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "x.sqlite3"}
    databases = {
        "plain": sqlite,
        "deferred": {**sqlite, "OPTIONS": {"transaction_mode": "DEFERRED"}},
        "immediate": {**sqlite, "OPTIONS": {"transaction_mode": "immediate"}},
        "postgres": {"ENGINE": "django.db.backends.postgresql", "NAME": "x"},
    }
    assert sqlite_without_immediate(databases) == ["plain", "deferred"]


ON_MYSQL = connection.vendor == "mysql"


@pytest.fixture
def session_zone_plus_two() -> Iterator[None]:
    """Give the test's own connection a session time zone of +02:00; the server is untouched."""
    statement = {
        "mysql": "SET time_zone = %s",
        "postgresql": "SET TIME ZONE %s",
    }.get(connection.vendor)
    if statement is not None:
        with connection.cursor() as cursor:
            cursor.execute(statement, ["+02:00"])
    yield
    if statement is not None:
        with connection.cursor() as cursor:
            cursor.execute(statement, ["+00:00"])


@pytest.mark.django_db
def test_database_clock_problems__none_on_utc() -> None:
    assert database_clock_problems("default") == []
    assert check_database_clock(databases=["default"]) == []


@pytest.mark.django_db
@pytest.mark.usefixtures("session_zone_plus_two")
def test_database_clock_problems__session_zone_not_utc() -> None:
    problems = database_clock_problems("default")
    if not ON_MYSQL:
        # PostgreSQL's now() is a timestamptz and SQLite's clock is UTC: the zone is harmless.
        assert problems == []
        return
    assert len(problems) == 1
    assert "'+02:00'" in problems[0] and "+7200 s from UTC" in problems[0]
    assert "SET time_zone = '+00:00'" in problems[0]
    assert [m.id for m in check_database_clock(databases=["default"])] == ["django_leases.E013"]


CLOCK_COMMANDS = [
    ["check", "--database", "default"],
    ["run_lease_worker", "--burst"],
    ["watch_stuck_jobs", "--once"],
]


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not ON_MYSQL, reason="only MariaDB/MySQL have a session zone that moves NOW()")
@pytest.mark.parametrize("command", CLOCK_COMMANDS, ids=lambda args: args[0])
def test_commands__refuse_a_session_zone_that_is_not_utc(
    processes: Processes, command: list[str]
) -> None:
    from django_leases.models import JobAttempt, PaymentJob

    job = PaymentJob.objects.enqueue("noop")
    env = subprocess_env(LEASES_TEST_SESSION_TZ="+02:00")
    proc = processes.manage(*command, env=env)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, out
    assert "session time zone is '+02:00'" in out, out
    if command[0] == "check":
        assert "django_leases.E013" in out
    else:
        assert out.startswith("CommandError: database 'default': "), out
        assert len(out.strip().splitlines()) == 1, out
    job.refresh_from_db()
    assert (job.status, job.attempts) == ("pending", 0)
    assert not JobAttempt.objects.exists()


@pytest.mark.concurrency
@pytest.mark.django_db(transaction=True)
def test_commands__start_on_a_utc_session(processes: Processes) -> None:
    proc = processes.manage("check", "--database", "default")
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert "E013" not in out, out


def current_setting(name: str) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_setting(%s)", [name])
        return cursor.fetchone()[0]


@contextmanager
def server_setting(name: str, value: str) -> Iterator[None]:
    """Set a reloadable PostgreSQL setting server-wide (ALTER SYSTEM), then reset it."""
    admin = connections.create_connection("default")
    admin.ensure_connection()
    admin.connection.autocommit = True  # ALTER SYSTEM cannot run in a transaction block
    try:
        with admin.connection.cursor() as cursor:
            cursor.execute(f"ALTER SYSTEM SET {name} = {value}")
            cursor.execute("SELECT pg_reload_conf()")
        wait_for(lambda: current_setting(name) == value, timeout=10)
        yield
    finally:
        with admin.connection.cursor() as cursor:
            cursor.execute(f"ALTER SYSTEM RESET {name}")
            cursor.execute("SELECT pg_reload_conf()")
        admin.close()


@pytest.mark.django_db
@pytest.mark.skipif(connection.vendor != "postgresql", reason="autovacuum is PostgreSQL's")
@pytest.mark.parametrize("running", ["on", "off"])
def test_check_autovacuum__warns_while_the_server_runs_none(running: str) -> None:
    with server_setting("autovacuum", running):
        problems = autovacuum_problems("default")
        messages = check_autovacuum(databases=["default"])
    if running == "on":
        assert (problems, messages) == ([], [])
    else:
        assert problems == [
            "database 'default': autovacuum is off; claims slow down with every "
            "job processed until a VACUUM of the job table."
        ]
        assert [m.id for m in messages] == ["django_leases.W008"]
        assert "VACUUM the job and ledger tables" in str(messages[0].hint)


@pytest.mark.django_db
@pytest.mark.skipif(connection.vendor == "postgresql", reason="SQLite and MariaDB/MySQL")
def test_check_autovacuum__nothing_to_ask_elsewhere() -> None:
    assert autovacuum_problems("default") == []
    assert check_autovacuum(databases=["default"]) == []


LEASE_TASKS = {"default": {"BACKEND": "django_leases.backends.LeaseBackend"}}


@pytest.mark.parametrize("tasks", [LEASE_TASKS, {}])
def test_check_tasks_framework__backport_missing(
    monkeypatch: pytest.MonkeyPatch, tasks: dict[str, object]
) -> None:
    with override_settings(TASKS=tasks), monkeypatch.context() as patch:
        patch.setitem(sys.modules, "django_tasks", None)  # as if it were not installed
        messages = check_tasks_framework()
    needed = bool(tasks) and django.VERSION < (6, 0)  # Django 6 has the framework built in
    assert [message.id for message in messages] == (["django_leases.E018"] if needed else [])
    assert all('"django-leases[tasks]"' in message.hint for message in messages)


def test_check_tasks_framework__backport_or_django_6_present() -> None:
    with override_settings(TASKS=LEASE_TASKS):
        assert check_tasks_framework() == []


# ---- JOB_MODEL and the job models' ledgers ---------------------------------------------------


@pytest.mark.parametrize(
    "label", ["django_leases.PaymentJob", "testapp.PayoutJob", "testapp.BareJob"]
)
def test_check_job_model__a_concrete_leased_job_model_is_clean(label: str) -> None:
    with override_settings(DJANGO_LEASES={"JOB_MODEL": label}):
        assert check_job_model() == []
        assert check_settings() == []


@pytest.mark.parametrize(
    ("label", "problem"),
    [
        ("PayoutJob", "is not of the form 'app_label.ModelName'"),
        ("testapp.payout.Job", "is not of the form 'app_label.ModelName'"),
        (42, "is not of the form 'app_label.ModelName'"),
        ("shop.PayoutJob", "is not an installed model"),
        ("testapp.Charge", "is not a concrete subclass of"),
        ("django_leases.JobAttempt", "is not a concrete subclass of"),
    ],
)
def test_check_job_model__reports_what_is_no_job_table(label: object, problem: str) -> None:
    with override_settings(DJANGO_LEASES={"JOB_MODEL": label}):
        (message,) = check_job_model()
    assert message.id == "django_leases.E030"
    assert message.msg.startswith(f"DJANGO_LEASES['JOB_MODEL'] {label!r} {problem}")


def test_check_ledgers__every_installed_job_model_is_clean() -> None:
    assert check_ledgers() == []


@pytest.mark.parametrize(
    ("attempt_model", "problem"),
    [
        ("PayoutAttempt", "must be None or 'app_label.ModelName'"),
        ("testapp.Nope", "'testapp.Nope' is not an installed model"),
        ("testapp.Charge", "'testapp.Charge' is not a concrete subclass of"),
        (
            "django_leases.JobAttempt",
            "'django_leases.JobAttempt' has no nullable foreign key `job` to testapp.PayoutJob",
        ),
    ],
)
def test_check_ledgers__reports_a_ledger_of_another_kind(
    monkeypatch: pytest.MonkeyPatch, attempt_model: str, problem: str
) -> None:
    monkeypatch.setattr(PayoutJob, "attempt_model", attempt_model)
    (message,) = check_ledgers()
    assert (message.id, message.obj) == ("django_leases.E031", PayoutJob)
    assert message.msg.startswith(f"testapp.PayoutJob.attempt_model {problem}")


def test_leased_jobs__default_follows_job_model() -> None:
    assert leased_jobs().model is PaymentJob
    with override_settings(DJANGO_LEASES={"JOB_MODEL": "testapp.PayoutJob"}):
        assert leased_jobs().model is PayoutJob


def schedule_ids(**schedules: object) -> list[str]:
    with override_settings(DJANGO_LEASES={"SCHEDULES": schedules}):
        return [message.id for message in check_schedules()]


def test_check_schedules__valid_schedules_are_clean() -> None:
    assert schedule_ids() == []
    assert (
        schedule_ids(
            beat={"kind": "noop", "every": 60},
            sweep={"kind": "noop", "every": timedelta(hours=1), "payload": {"n": 1}},
            once={"kind": "noop", "every": 1.5, "catch_up": False},
        )
        == []
    )


@pytest.mark.parametrize("schedules", [[("beat", {"kind": "noop", "every": 60})], "beat", None])
def test_check_schedules__not_a_dict(schedules: object) -> None:
    with override_settings(DJANGO_LEASES={"SCHEDULES": schedules}):
        messages = check_schedules()
    assert [m.id for m in messages] == ["django_leases.E025"]
    assert "DJANGO_LEASES['SCHEDULES'] must be a dict" in messages[0].msg


@pytest.mark.parametrize("entry", [None, 60, ["noop", 60]])
def test_check_schedules__entry_not_a_dict(entry: object) -> None:
    assert schedule_ids(beat=entry) == ["django_leases.E025"]


@pytest.mark.parametrize("name", ["", "a:b", "x" * 101, 7])
def test_check_schedules__bad_name(name: object) -> None:
    with override_settings(DJANGO_LEASES={"SCHEDULES": {name: {"kind": "noop", "every": 60}}}):
        assert [m.id for m in check_schedules()] == ["django_leases.E025"]


def test_check_schedules__names_differing_only_in_case() -> None:
    entry = {"kind": "noop", "every": 60}
    assert schedule_ids(Sweep=entry, sweep=entry, other=entry) == ["django_leases.E025"]


def test_check_schedules__unknown_key_warns() -> None:
    with override_settings(
        DJANGO_LEASES={"SCHEDULES": {"beat": {"kind": "noop", "every": 60, "evry": 5}}}
    ):
        messages = check_schedules()
    assert [m.id for m in messages] == ["django_leases.W005"]
    assert "'evry'" in messages[0].msg and "beat" in messages[0].msg


@pytest.mark.parametrize("kind", [None, 5, "", "k" * 101, "a\x00b"])
def test_check_schedules__missing_or_bad_kind(kind: object) -> None:
    entry = {"every": 60} if kind is None else {"kind": kind, "every": 60}
    assert schedule_ids(beat=entry) == ["django_leases.E026"]


@pytest.mark.parametrize(
    "every", [None, 0, -1, "60", True, float("nan"), 0.5, timedelta(0), MAX_DURATION + 1]
)
def test_check_schedules__every_not_a_positive_duration(every: object) -> None:
    entry = {"kind": "noop", "every": every}
    with override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": entry}}):
        messages = check_schedules()
    assert [m.id for m in messages] == ["django_leases.E027"]
    assert "['every']" in messages[0].msg


def test_check_schedules__cron_schedules_are_clean() -> None:
    assert (
        schedule_ids(
            weekdays={"kind": "noop", "cron": "30 2 * * 1-5", "tz": "Europe/Berlin"},
            utc={"kind": "noop", "cron": "*/15 * * * *", "catch_up": False},
            named={"kind": "noop", "cron": "0 9 L * mon-fri", "tz": "America/New_York"},
        )
        == []
    )


@pytest.mark.parametrize(
    ("cron", "says"),
    [
        ("61 * * * *", "not a valid cron expression (bad minute)"),
        ("* * * *", "must have 5 fields, got 4"),
        ("*/15 * * * * *", "must have 5 fields, got 6"),
        ("0 0 31 2 *", "not a valid cron expression"),
        ("* * */20 * 1L", "matches no time in the next 50 years"),
        ("", "must be a string of 1-200 characters"),
        ("* " * 101, "must be a string of 1-200 characters"),
        (None, "must be a string"),
        (30, "must be a string"),
    ],
)
def test_check_schedules__invalid_cron(cron: object, says: str) -> None:
    with override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": {"kind": "noop", "cron": cron}}}):
        messages = check_schedules()
    assert [m.id for m in messages] == ["django_leases.E034"]
    assert "DJANGO_LEASES['SCHEDULES']['beat']['cron']" in messages[0].msg
    assert says in messages[0].msg


@pytest.mark.parametrize("tz", ["Mars/Olympus", "europe/berlin", "../etc/passwd", "", None, 1])
def test_check_schedules__unknown_tz(tz: object) -> None:
    entry = {"kind": "noop", "cron": "30 2 * * *", "tz": tz}
    with override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": entry}}):
        messages = check_schedules()
    assert [m.id for m in messages] == ["django_leases.E035"]
    assert "['tz'] must be the name of a time zone" in messages[0].msg


@pytest.mark.parametrize(
    "tz", ["localtime", "Factory", "posixrules", "posix/Europe/Berlin", "right/UTC"]
)
def test_check_schedules__tz_of_the_host_not_the_iana_database(tz: str) -> None:
    """Names a host's zone directory holds beside the IANA zones: fire times in them would
    depend on each host ("localtime" is its own zone), so two hosts could enqueue two jobs."""
    entry = {"kind": "noop", "cron": "30 2 * * *", "tz": tz}
    with override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": entry}}):
        [message] = check_schedules()
    assert message.id == "django_leases.E035"
    assert "\n" not in message.msg and f"got {tz!r}" in message.msg
    assert "'localtime'" in message.hint and "'Europe/Berlin'" in message.hint


@pytest.mark.parametrize("tz", ["Europe/Berlin", "UTC", "America/New_York", "Etc/UTC"])
def test_check_schedules__iana_tz_is_fine(tz: str) -> None:
    entry = {"kind": "noop", "cron": "30 2 * * *", "tz": tz}
    with override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": entry}}):
        assert check_schedules() == []


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ({"kind": "noop"}, "has neither"),
        ({"kind": "noop", "every": 60, "cron": "30 2 * * *"}, "has both"),
    ],
)
def test_check_schedules__both_or_neither_of_every_and_cron(
    entry: dict[str, object], says: str
) -> None:
    with override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": entry}}):
        messages = check_schedules()
    assert [m.id for m in messages] == ["django_leases.E036"]
    assert f"must have exactly one of 'every' and 'cron', {says}" in messages[0].msg


def test_check_schedules__tz_without_cron() -> None:
    entry = {"kind": "noop", "every": 60, "tz": "Europe/Berlin"}
    with override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": entry}}):
        messages = check_schedules()
    assert [m.id for m in messages] == ["django_leases.E037"]
    assert "has 'tz' without 'cron'" in messages[0].msg


@pytest.mark.parametrize("payload", [{"at": object()}, {"n": float("inf")}, {"ids": {1, 2}}])
def test_check_schedules__payload_not_json(payload: object) -> None:
    assert schedule_ids(beat={"kind": "noop", "every": 60, "payload": payload}) == [
        "django_leases.E028"
    ]


def test_check_schedules__kind_without_handler_warns() -> None:
    with override_settings(
        DJANGO_LEASES={"SCHEDULES": {"beat": {"kind": "no-such-kind", "every": 60}}}
    ):
        messages = check_schedules()
    assert [m.id for m in messages] == ["django_leases.W006"]
    assert "'no-such-kind'" in messages[0].msg and "pile up" in messages[0].msg


@pytest.mark.parametrize("catch_up", ["yes", 1, None])
def test_check_schedules__catch_up_not_a_bool(catch_up: object) -> None:
    assert schedule_ids(beat={"kind": "noop", "every": 60, "catch_up": catch_up}) == [
        "django_leases.E029"
    ]


def test_check_schedules__period_longer_than_retention_is_fine() -> None:
    """W007 is retired: pruning no longer makes a tick run again."""
    entry = {"kind": "noop", "every": 8 * 86400}
    with override_settings(
        DJANGO_LEASES={"SCHEDULES": {"beat": entry}, "RETENTION": {"completed": 60}}
    ):
        assert check_schedules() == []


def test_check_schedules__reported_by_manage_py_check() -> None:
    with override_settings(DJANGO_LEASES={"SCHEDULES": {"beat": {"kind": "noop"}}}):
        with pytest.raises(SystemCheckError, match="E036"):
            call_command("check", databases=[])


@pytest.mark.parametrize(
    ("by_kind", "hint"),
    [
        ({"riskyy": "review"}, "Did you mean 'risky'? "),
        ({"RISKY": "review", "risky": "retry"}, "Did you mean 'risky'? "),
        ({"zzzz": "review"}, "Use the kind of a @job_handler"),
    ],
)
def test_check_settings__warns_of_policy_for_no_registered_kind(
    by_kind: dict[str, str], hint: str
) -> None:
    with override_settings(DJANGO_LEASES={"STUCK_POLICY_BY_KIND": by_kind}):
        (message,) = check_settings()
    assert message.id == "django_leases.W009"
    unknown = next(kind for kind in by_kind if kind != "risky")
    assert f"names {unknown!r}" in message.msg and "STUCK_POLICY ('retry')" in message.msg
    assert message.hint.startswith(hint)


def test_check_settings__policy_for_registered_kinds_passes() -> None:
    assert ids(STUCK_POLICY_BY_KIND={"risky": "review", "risky_reconciled": "review"}) == []
    assert ids(STUCK_POLICY="review", STUCK_POLICY_BY_KIND={}) == []


# ---- the documented ids ---------------------------------------------------------------------

PACKAGE = ROOT / "django_leases"
CONFIGURATION = ROOT / "docs" / "configuration.md"
# A check id as the docs write it: django_leases.E012, E012, or a range E025–E029.
DOC_ID = re.compile(r"(\w+\.)?\b([EW])(\d{3})\b(?:\s*[–-]\s*(?:\2)?(\d{3})\b)?")


def documented_ids(text: str) -> set[str]:
    """Return the django-leases check ids `text` names, ranges expanded (never models.W037)."""
    found = set()
    for prefix, level, first, last in DOC_ID.findall(text):
        if prefix not in ("", "django_leases."):
            continue
        found.update(f"{level}{n:03d}" for n in range(int(first), int(last or first) + 1))
    return found


def code_ids() -> set[str]:
    """Return the ids of every check message the package can report."""
    return {
        match
        for path in PACKAGE.rglob("*.py")
        for match in re.findall(r"""id=["']django_leases\.([EW]\d{3})["']""", path.read_text())
    }


def table(heading: str) -> list[list[str]]:
    """Return the rows of the first table under `heading` of docs/configuration.md, cells
    stripped."""
    text = CONFIGURATION.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def named_settings(text: str) -> set[str]:
    return set(re.findall(r"`([A-Z][A-Z_]+)\b", text)) & set(DEFAULTS)


# Ids no check reports any more, named as retired in docs/configuration.md (never reused).
RETIRED = {"W007"}


def test_docs__every_check_id_exists_and_is_in_the_table() -> None:
    checks_table = {documented_ids(row[0]).pop() for row in table("System checks")}
    assert checks_table == code_ids()
    assert not RETIRED & code_ids()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        unknown = documented_ids(path.read_text()) - code_ids() - RETIRED
        assert not unknown, f"{path.name} names {sorted(unknown)}, which no check reports"


def test_docs__settings_and_check_rows_name_each_other() -> None:
    """A setting's "checks" cell names exactly the ids whose row in the System checks table
    names that setting."""
    rows = {documented_ids(row[0]).pop(): row[2] for row in table("System checks")}
    for name, *_, checks in table("Settings"):
        setting = name.strip("`")
        claimed = documented_ids(checks)
        about = {id_ for id_, text in rows.items() if setting in named_settings(text)}
        assert claimed == about, f"{setting}: its row says {sorted(claimed)}"


@pytest.mark.django_db
def test_pending_kinds__warns_of_pending_jobs_no_handler_runs() -> None:
    PaymentJob.objects.enqueue("slep")
    PaymentJob.objects.enqueue("sleep")
    done = PaymentJob.objects.enqueue("gone_kind")
    PaymentJob.objects.filter(pk=done.pk).update(status=PaymentJob.Status.COMPLETED)

    (message,) = check_pending_kinds(databases=["default"])

    assert message.id == "django_leases.W014"
    assert "pending jobs of kind 'slep'" in message.msg
    assert message.hint.startswith("Did you mean 'sleep'?")
    assert check_pending_kinds(databases=[]) == []
