"""Ticks of a schedule passing by the database clock, and the jobs of its ticks running and being
pruned: what the schedule tests and the model-based test do between passes."""

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta

from django.db import connections
from django.db.models.functions import Now

from django_leases.lease import Lease
from django_leases.models import PaymentJob, ScheduleState
from django_leases.schedules import Schedule, configured, enqueue_due

TTL = 600


def tick_of(key: str) -> int:
    """Return the tick of a schedule job's key, `schedule:<name>:<tick>:<mac>`."""
    return int(key.split(":")[2])


def of_series(schedule: Schedule, key: str) -> bool:
    """Tell whether `key` is the key of a tick of `schedule`'s series (not of an earlier
    definition of the same name)."""
    if not key.startswith(f"schedule:{schedule.name}:"):
        return False
    tick = key.split(":")[2]
    # `schedule:<name>:now:<request>`: a job an operator ran now (`run_now()`), not a tick's.
    return tick.lstrip("-").isdigit() and key == schedule.key(int(tick))


def begin() -> None:
    """Start each configured schedule's series, then let one tick pass: the next pass enqueues
    the current tick. (A new schedule starts at its next tick: its first pass enqueues none.)"""
    assert enqueue_due() == []
    for schedule in configured():
        ticks_pass(schedule, 1)


def ticks_pass(schedule: Schedule, count: int) -> None:
    """Move what `schedule` recorded `count` ticks into the past: its state row's tick and its
    jobs' keys and `run_at`, as if `count` ticks of the database clock had passed since.

    The way the suite lets time pass (as a lease runs out by moving `lease_until` back): ticks
    of about 115 days (`every=10**7`), or a cron schedule's yearly fire times, never pass by
    themselves while a test runs. A negative `count` moves them into the future: the database
    clock went back. A cron schedule's records move from fire time to fire time.
    """
    name, every, cron, tz = schedule.series
    state = ScheduleState.objects.filter(name=name, every=every, cron=cron, tz=tz)
    for pk, tick, start in state.values_list("pk", "last_tick", "start_tick"):
        ScheduleState.objects.filter(pk=pk).update(
            last_tick=moved(schedule, tick, count),
            start_tick=None if start is None else moved(schedule, start, count),
        )
    jobs = PaymentJob.objects.filter(idempotency_key__startswith=f"schedule:{name}:")
    mine = [row for row in jobs.values_list("pk", "idempotency_key") if of_series(schedule, row[1])]
    # Lowest tick first (highest into the future): each key moves past every key not moved yet,
    # never onto one (the unique index).
    rows = sorted(mine, key=lambda row: tick_of(row[1]))
    for pk, key in rows if count > 0 else reversed(rows):
        tick = moved(schedule, tick_of(key), count)
        PaymentJob.objects.filter(pk=pk).update(
            idempotency_key=schedule.key(tick), run_at=schedule.start(tick)
        )


def moved(schedule: Schedule, tick: int, count: int) -> int:
    """Return the tick `count` ticks before `tick` (after it, for a negative `count`)."""
    if not schedule.cron:
        return tick - count
    for _ in range(abs(count)):
        other = schedule.previous(tick) if count > 0 else next(schedule.fires_after(tick))
        assert other is not None
        tick = other
    return tick


def run(job: PaymentJob, *, fail: bool = False) -> None:
    """Run `job` to its end through a real claim: completed, or failed for good (a failed
    tick's job, which the default RETENTION keeps 30 days)."""
    claimed = PaymentJob.objects.claim_job(job.pk, "ticker-test", ttl=TTL)
    assert claimed is not None
    lease = Lease(claimed, ttl=TTL)
    if fail:
        assert lease.fail("psp down", permanent=True) == "failed"
    else:
        lease.complete()


def prune_finished(statuses: tuple[str, ...] = ("completed",)) -> dict[str, int]:
    """Age every finished job by a day (database clock) and prune those of `statuses`, as
    `prune_jobs` with a retention shorter than a tick does; the others stay."""
    PaymentJob.objects.exclude(completed_at=None).update(completed_at=Now() - timedelta(days=1))
    return PaymentJob.objects.prune(dict.fromkeys(statuses, 3600))


class DatabaseClock:
    """The clock of one connection's database session, stopped at a moment a test sets: a cron
    schedule's fire times are dates of the calendar (a DST change comes twice a year), which no
    move of its records reaches, as `ticks_pass()` does for ticks.

    What the session's `Now()` reads, the way each database lets a session have a clock of its
    own: MariaDB/MySQL's `SET timestamp`; on PostgreSQL functions `now()` and
    `statement_timestamp()` that a schema ahead of `pg_catalog` in the search path puts in front
    of the built-in ones; on SQLite a `strftime()` of the connection (SQLite's `'now'` is read
    in the calling process) that answers the stopped time for `'now'` and passes anything else
    on to SQLite's own. Column defaults keep the real clock on PostgreSQL.
    """

    def __init__(self, alias: str = "default") -> None:
        self.connection = connections[alias]
        self.moment: datetime | None = None
        self._builtin: sqlite3.Connection | None = None

    def set(self, moment: datetime) -> None:
        """Stop the session's clock at `moment` (aware)."""
        self.moment = moment.astimezone(UTC)
        vendor = self.connection.vendor
        with self.connection.cursor() as cursor:
            if vendor == "mysql":
                cursor.execute("SET @@session.timestamp = %s", [self.moment.timestamp()])
            elif vendor == "postgresql":
                cursor.execute("CREATE SCHEMA IF NOT EXISTS leases_test_clock")
                for function in ("now", "statement_timestamp"):
                    cursor.execute(
                        f"CREATE OR REPLACE FUNCTION leases_test_clock.{function}() "
                        "RETURNS timestamptz LANGUAGE sql STABLE AS "
                        "$$ SELECT pg_catalog.current_setting('leases_test.clock')::timestamptz $$"
                    )
                cursor.execute(
                    "SELECT set_config('leases_test.clock', %s, false)", [self.moment.isoformat()]
                )
                cursor.execute('SET search_path = "$user", public, leases_test_clock, pg_catalog')
            else:
                raw = self.connection.connection
                assert raw is not None
                # Now(); a lease's end, 'now' and its TTL. Defined twice: replacing a function
                # of the connection (not a built-in one) expires the statements prepared with
                # the old one, which the connection's statement cache holds on to.
                for arguments in (2, 3, 2, 3):
                    raw.create_function("strftime", arguments, self._strftime)

    def reset(self) -> None:
        """Give the session the database's own clock back."""
        self.moment = None
        vendor = self.connection.vendor
        if vendor == "sqlite":
            # SQLite cannot drop a function that stands in for a built-in one (the built-in
            # does not come back): only a new connection has its own strftime() again. So the
            # clock needs a test without a transaction around it (transaction=True).
            assert not self.connection.in_atomic_block, "use django_db(transaction=True)"
            self.connection.close()
            return
        with self.connection.cursor() as cursor:
            if vendor == "mysql":
                cursor.execute("SET @@session.timestamp = DEFAULT")
            else:
                cursor.execute("RESET search_path")

    def _strftime(self, fmt: str, value: str, *modifiers: str) -> str:
        if value.lower() == "now":
            assert self.moment is not None
            value = self.moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        if self._builtin is None:
            self._builtin = sqlite3.connect(":memory:")
        marks = ", ".join("?" * (2 + len(modifiers)))
        row = self._builtin.execute(f"SELECT strftime({marks})", (fmt, value, *modifiers))  # noqa: S608 - placeholders only
        result: str = row.fetchone()[0]
        return result


@contextmanager
def database_clock(alias: str = "default") -> Iterator[DatabaseClock]:
    """Yield the clock of `alias`'s session to set; its own clock comes back afterwards."""
    clock = DatabaseClock(alias)
    try:
        yield clock
    finally:
        clock.reset()
