"""Configuration errors against outages: what each command does with a database it cannot use.

Real processes against real servers: a database that was never migrated, a login, database or
option the server refuses (one line naming the setting, exit 1), and a server that is down
(waited out by a worker, one line and exit 1 from the commands that run once).
"""

import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import DatabaseError, connection, connections
from django.db.models.functions import Now

from django_leases.models import PaymentJob
from django_leases.outages import misconfiguration

from .conftest import (
    ON_SQLITE,
    Processes,
    database_url,
    finish,
    free_port,
    read_until,
    subprocess_env,
    wait_for,
)

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

ON_MYSQL = (os.environ.get("DATABASE_URL") or "").startswith("mysql")
NEEDS_SERVER = pytest.mark.skipif(ON_SQLITE, reason="SQLite has no server, logins or options")
ONE_SHOT = [["watch_stuck_jobs", "--once"], ["prune_jobs"]]
COMMANDS = [["run_lease_worker", "--burst", "--poll-interval", "0.1"], *ONE_SHOT]


def run(processes: Processes, command: list[str], env: dict[str, str]) -> str:
    """Run a command to its exit within 60 s; return its output (stdout and stderr)."""
    proc = processes.manage(*command, env=env)
    out = finish(proc, timeout=60)
    assert proc.returncode == 1, out
    return out


def assert_one_line(out: str, *texts: str) -> None:
    assert out.startswith("CommandError: database 'default' "), out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    for text in texts:
        assert text in out, out


@pytest.fixture
def empty_database() -> Iterator[str]:
    """The NAME of an empty database on the server under test (a new SQLite file)."""
    if ON_SQLITE:
        path = Path(str(connection.settings_dict["NAME"])).with_name(
            f"empty-{secrets.token_hex(4)}.sqlite3"
        )
        yield str(path)
        path.unlink(missing_ok=True)
        return
    name = f"{connection.settings_dict['NAME']}_empty"[:60]
    quoted = connection.ops.quote_name(name)
    with connection.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {quoted}")
        cursor.execute(f"CREATE DATABASE {quoted}")
    yield name
    with connection.cursor() as cursor:
        cursor.execute(f"DROP DATABASE IF EXISTS {quoted}")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda args: args[0])
def test_commands__an_unmigrated_database_is_one_line_and_exit_1(
    processes: Processes, empty_database: str, command: list[str]
) -> None:
    out = run(processes, command, subprocess_env(LEASES_TEST_DB_NAME=empty_database))
    assert_one_line(
        out,
        "is not migrated",
        "django_leases_paymentjob",
        'run "manage.py migrate --database default"',
    )


@pytest.fixture
def wrong_password() -> Iterator[str]:
    """DATABASE_URL of a MariaDB/MySQL user created for the test, with a wrong password."""
    user = f"leases_{secrets.token_hex(4)}"
    with connection.cursor() as cursor:
        cursor.execute("CREATE USER %s@%s IDENTIFIED BY %s", [user, "%", "right-password"])
    yield database_url(user=user, password="wrong-password")  # noqa: S106
    with connection.cursor() as cursor:
        cursor.execute("DROP USER %s@%s", [user, "%"])


def refused_settings(case: str) -> tuple[dict[str, str], list[str]]:
    """The environment of a command whose settings the server refuses, and the texts its one
    line must hold."""
    nobody = f"nobody_{secrets.token_hex(4)}"
    nowhere = f"nowhere_{secrets.token_hex(4)}"
    if case == "unknown user":
        return {"DATABASE_URL": database_url(user=nobody)}, [
            "['USER']",
            "Access denied for user" if ON_MYSQL else f'role "{nobody}" does not exist',
        ]
    if case == "unknown database":
        return {"LEASES_TEST_DB_NAME": nowhere}, [
            "['NAME']",
            "1049" if ON_MYSQL else f'database "{nowhere}" does not exist',
        ]
    if ON_MYSQL:  # the init_command of tests/settings.py, with a time zone the server lacks
        return {"LEASES_TEST_SESSION_TZ": "Nowhere/Zone"}, ["['OPTIONS']", "1298"]
    return {"DATABASE_URL": database_url() + "?options=-c%20leases_nonsense%3Don"}, [
        "['OPTIONS']",
        'unrecognized configuration parameter "leases_nonsense"',
    ]


@NEEDS_SERVER
@pytest.mark.parametrize("case", ["unknown user", "unknown database", "refused option"])
@pytest.mark.parametrize("command", COMMANDS, ids=lambda args: args[0])
def test_commands__settings_the_server_refuses_are_one_line_naming_the_setting(
    processes: Processes, command: list[str], case: str
) -> None:
    job = PaymentJob.objects.enqueue("noop")
    env, texts = refused_settings(case)
    out = run(processes, command, subprocess_env(**env))
    assert_one_line(out, "refused the connection settings", *texts)
    job.refresh_from_db()
    assert (job.status, job.attempts) == ("pending", 0)


@NEEDS_SERVER
@pytest.mark.skipif(not ON_MYSQL, reason="PostgreSQL's logins here are trusted: see PgBouncer's")
@pytest.mark.parametrize("command", COMMANDS, ids=lambda args: args[0])
def test_commands__a_wrong_password_is_one_line_naming_user_and_password(
    processes: Processes, wrong_password: str, command: list[str]
) -> None:
    out = run(processes, command, subprocess_env(DATABASE_URL=wrong_password))
    assert_one_line(out, "Access denied", "['USER'] and ['PASSWORD']")


@NEEDS_SERVER
def test_prune_jobs__a_database_that_is_down_is_one_line_and_exit_1(processes: Processes) -> None:
    out = run(
        processes, ["prune_jobs"], subprocess_env(DATABASE_URL=database_url(port=free_port()))
    )
    assert out.startswith("CommandError: database unavailable: "), out
    assert len(out.strip().splitlines()) == 1, out


@NEEDS_SERVER
def test_misconfiguration__an_outage_is_none_and_a_refused_login_names_the_setting() -> None:
    def error(**settings: object) -> DatabaseError:
        conn = connections.create_connection("default")
        conn.settings_dict = {**conn.settings_dict, **settings}
        try:
            conn.ensure_connection()
        except DatabaseError as exc:
            return exc
        finally:
            conn.close()
        pytest.fail(f"connected with {settings}")

    assert misconfiguration(error(PORT=free_port()), "default") is None
    refused = misconfiguration(error(NAME=f"nowhere_{secrets.token_hex(4)}"), "default")
    assert refused is not None and "fix DATABASES['default']['NAME']" in refused


ON_POSTGRESQL = (os.environ.get("DATABASE_URL") or "").startswith("postgres")
RETRY = re.compile(r"database unavailable during the start: .*; retrying in ([0-9.]+)s$")


@NEEDS_SERVER
def test_worker__backs_off_from_a_database_that_is_down_and_says_so_once(
    processes: Processes,
) -> None:
    down = subprocess_env(DATABASE_URL=database_url(port=free_port()))
    proc = processes.manage(
        "run_lease_worker", "--burst", "--poll-interval", "0.2", "-v", "2", env=down
    )
    out = read_until(proc, "database unavailable during the start: ")
    delays = []
    while len(delays) < 4:
        line = read_until(proc, "; retrying in ").splitlines()[-1]
        out += line
        match = RETRY.search(line)
        assert match is not None, line
        delays.append(float(match[1]))
    # Backed off and tried again, not given up on: an outage ends by itself. Each try waits
    # longer (the ceiling doubles, the draw is from its upper half), and the outage is said
    # once, on one line, whatever the driver's message holds.
    assert delays == sorted(delays) and delays[-1] >= 4 * delays[0], delays
    assert proc.poll() is None
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    out += finish(proc)
    warnings = [line for line in out.splitlines() if "database unavailable during" in line]
    assert len([w for w in warnings if "retrying in" not in w]) == 1, out
    # libpq's message is of two lines.
    assert "\tIs the server running" not in out, out


@contextmanager
def read_only_sessions() -> Iterator[dict[str, str]]:
    """Make every new session of the test database read-only, as a hot standby's are; yield
    the environment of a process that opens such sessions. PostgreSQL: the database's
    `default_transaction_read_only` (reset at the end; sessions open before keep writing).
    MariaDB/MySQL: the process's sessions only, through its init_command (the server-wide
    `read_only` would stop every other database of the server)."""
    if not ON_POSTGRESQL:
        yield subprocess_env(LEASES_TEST_INIT_COMMAND="SET SESSION TRANSACTION READ ONLY")
        return
    name = connection.ops.quote_name(str(connection.settings_dict["NAME"]))
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER DATABASE {name} SET default_transaction_read_only = on")
    try:
        yield subprocess_env()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER DATABASE {name} RESET default_transaction_read_only")


@NEEDS_SERVER
def test_worker__waits_out_a_read_only_database_and_carries_on(processes: Processes) -> None:
    job = PaymentJob.objects.enqueue("noop")
    with read_only_sessions() as env:
        proc = processes.manage("run_lease_worker", "--poll-interval", "0.1", "-v", "2", env=env)
        out = read_until(proc, "database unavailable during registration: ")
        out += read_until(proc, "; retrying in ")
        assert "read-only" in out or "READ ONLY" in out, out
        assert proc.poll() is None
        job.refresh_from_db()
        assert (job.status, job.attempts) == ("pending", 0)
        if not ON_POSTGRESQL:
            # Its sessions stay read-only: what this shows is that it waits, without a crash.
            proc.terminate()
            assert proc.wait(timeout=30) == 0, finish(proc)
            return
    # Writes are allowed again: the worker's next session takes them and it carries on.
    out += read_until(proc, "database available again after ", timeout=60)
    wait_for(lambda: PaymentJob.objects.filter(pk=job.pk, status="completed").exists())
    proc.terminate()
    assert proc.wait(timeout=30) == 0
    out += finish(proc)
    assert "Traceback" not in out, out
    warnings = [line for line in out.splitlines() if "database unavailable during" in line]
    assert len([w for w in warnings if "retrying in" not in w]) == 1, out


@NEEDS_SERVER
@pytest.mark.parametrize("command", ONE_SHOT, ids=lambda args: args[0])
def test_commands__a_read_only_database_is_one_line_and_exit_1(
    processes: Processes, command: list[str]
) -> None:
    """The commands that run once report a read-only database as the outage it is (exit 1,
    documented in their --help): cron runs them again."""
    stuck = PaymentJob.objects.enqueue("noop")
    [claimed] = PaymentJob.objects.claim("gone-worker", ttl=60)
    PaymentJob.objects.filter(pk=claimed.pk).update(lease_until=Now() - timedelta(seconds=5))
    old = PaymentJob.objects.enqueue("noop")
    PaymentJob.objects.filter(pk=old.pk).update(
        status="completed", completed_at=Now() - timedelta(days=400)
    )
    with read_only_sessions() as env:
        out = run(processes, command, env)
    assert out.startswith("CommandError: database unavailable: "), out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out, out
    assert PaymentJob.objects.get(pk=stuck.pk).status == "processing"
    assert PaymentJob.objects.filter(pk=old.pk).exists()


@NEEDS_SERVER
@pytest.mark.parametrize("command", COMMANDS, ids=lambda args: args[0])
def test_commands__a_connection_option_the_driver_refuses_is_one_line_and_exit_1(
    processes: Processes, command: list[str]
) -> None:
    """PostgreSQL: an sslmode libpq does not know; MariaDB/MySQL: an init_command that is not
    SQL. Configuration errors, not outages."""
    if ON_POSTGRESQL:
        env = subprocess_env(DATABASE_URL=database_url() + "?sslmode=nonsense")
        texts = ["['OPTIONS']", "invalid sslmode value"]
    else:
        env = subprocess_env(LEASES_TEST_INIT_COMMAND="SET leases nonsense")
        texts = ["['OPTIONS']", "1064"]
    out = run(processes, command, env)
    assert_one_line(out, "refused the connection settings", *texts)
