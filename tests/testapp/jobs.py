"""Handlers the worker tests run. Behaviour is steered by the payload, never by globals."""

import asyncio
import re
import threading
import time
from collections import Counter
from contextlib import ExitStack

from django.db import DataError, connection, transaction
from django.db.backends.signals import connection_created
from django.db.models.functions import Now

from django_leases import LeaseLost, PermanentError, job_handler
from django_leases.models import PaymentJob

from .models import Charge, LockRun


def duration(job, lease) -> float:
    """Seconds this attempt should take: payload "durations" per attempt, or "seconds"."""
    durations = job.payload.get("durations")
    if durations:
        return float(durations[min(lease.attempt, len(durations)) - 1])
    return float(job.payload.get("seconds", 0))


# Connections this process opened, per thread: observed by the "connections" handler.
opened: Counter[int] = Counter()


def count_connection(sender, connection, **kwargs) -> None:
    opened[threading.get_ident()] += 1


connection_created.connect(count_connection)


@job_handler("connections")
def connections_opened(job, lease):
    """Record, as the checkpoint, how many connections this slot thread has opened so far."""
    connection.ensure_connection()
    lease.checkpoint(f"opened={opened[threading.get_ident()]}")


@job_handler("noop")
def noop(job, lease):
    return None


@job_handler("sleep")
def sleep(job, lease):
    """Sleep without looking at the lease, like a blocking PSP call."""
    time.sleep(duration(job, lease))


@job_handler("sleep_long_lease", ttl=90, max_attempts=2)
def sleep_long_lease(job, lease):
    """`sleep` with leases of 90 s, whatever the worker's --ttl, and two attempts by default."""
    time.sleep(duration(job, lease))


@job_handler("recorded")
def recorded(job, lease):
    """Append "pk token owner" to the file `payload["log"]` (outside the database, so that it
    survives a failover that loses commits), then sleep as the payload says."""
    with open(job.payload["log"], "a") as log:
        log.write(f"{job.pk} {lease.token} {lease.owner}\n")
    time.sleep(duration(job, lease))


@job_handler("watches_lease")
def watches_lease(job, lease):
    """Run as long as the payload says, or until the lease is lost; record the run by the
    database clock, with what this holder believed of its lease at the end (as its lock)."""
    run = LockRun.objects.create(job_ref=job.pk, lock="", token=lease.token)
    deadline = time.monotonic() + duration(job, lease)
    while time.monotonic() < deadline and not lease.lost:
        time.sleep(0.05)
    LockRun.objects.filter(pk=run.pk).update(finished_at=Now(), lock=f"lost={lease.lost}")


@job_handler("watches_cancel")
def watches_cancel(job, lease):
    """Reach the payload's checkpoint, if any, then loop on `lease.check()` for as long as the
    payload says; record (as the run's lock) what `check()` raised and what a write got then."""
    if job.payload.get("checkpoint"):
        lease.checkpoint(job.payload["checkpoint"])
    run = LockRun.objects.create(job_ref=job.pk, lock="", token=lease.token)
    deadline = time.monotonic() + duration(job, lease)
    seen = "nothing"
    try:
        while time.monotonic() < deadline:
            lease.check()
            time.sleep(0.02)
    except LeaseLost as exc:
        seen = type(exc).__name__
    try:
        lease.checkpoint("after the check")
        wrote = "written"
    except LeaseLost as exc:
        wrote = type(exc).__name__
    LockRun.objects.filter(pk=run.pk).update(
        finished_at=Now(), lock=f"saw={seen} lost={lease.lost} write={wrote}"
    )


def spanned(job, lease):
    """Record the handler's run by the database clock (a `LockRun`), running as long as the
    payload says. With "polls", it calls `lease.check()` every 10 ms and, once told to stop,
    takes "cleanup" seconds more before it returns; without, it ignores the stop."""
    run = LockRun.objects.create(job_ref=job.pk, lock=job.lock, token=lease.token)
    deadline = time.monotonic() + duration(job, lease)
    while time.monotonic() < deadline:
        if job.payload.get("polls"):
            try:
                lease.check()
            except LeaseLost:
                time.sleep(float(job.payload.get("cleanup", 0)))
                break
        time.sleep(0.01)
    LockRun.objects.filter(pk=run.pk).update(finished_at=Now())


job_handler("spanned")(spanned)
job_handler("spanned_timeout", timeout=1)(spanned)


@job_handler("boom")
def boom(job, lease):
    raise RuntimeError(job.payload.get("message", "boom"))


@job_handler("permanent")
def permanent(job, lease):
    raise PermanentError("card declined")


@job_handler("charge")
def charge(job, lease):
    """Sleep, then record a charge and complete the job in one transaction."""
    time.sleep(duration(job, lease))
    with lease.atomic():
        Charge.objects.create(job_ref=job.pk, token=lease.token, owner=lease.owner)


@job_handler("locked_step")
def locked_step(job, lease):
    """Record this execution's start and finish by the database clock, sleeping in between."""
    run = LockRun.objects.create(job_ref=job.pk, lock=job.lock, token=lease.token)
    time.sleep(duration(job, lease))
    LockRun.objects.filter(pk=run.pk).update(finished_at=Now())


@job_handler("group_callback")
def group_callback(job, lease):
    """Record this execution's start, and complete with how each member of the group ended."""
    LockRun.objects.create(job_ref=job.pk, lock=job.lock, token=lease.token)
    lease.complete([member._asdict() for member in lease.group()])


@job_handler("risky")
def risky(job, lease):
    """Reach the risky checkpoint, then take as long as the payload says."""
    lease.checkpoint("psp_called")
    time.sleep(duration(job, lease))


def ask_the_psp(job):
    return job.payload.get("psp_says", "completed")


@job_handler("risky_reconciled", reconcile=ask_the_psp)
def risky_reconciled(job, lease):
    lease.checkpoint("psp_called")
    time.sleep(duration(job, lease))


def quote_the_card(job):
    """A reconcile hook whose query fails with a database error that quotes the card: on
    PostgreSQL a value out of range, on MariaDB/MySQL an incorrect integer value holding a quote
    (SQLite's messages quote no value)."""
    value = job.payload["value"]
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SELECT %s::integer", [value])
        else:
            table = connection.ops.quote_name(PaymentJob._meta.db_table)
            update = "UPDATE <table> SET priority = %s WHERE id = %s"
            cursor.execute(update.replace("<table>", table), [value, job.pk])
            insert = "INSERT INTO <table> (id) SELECT id FROM <table> WHERE id = %s"
            cursor.execute(insert.replace("<table>", table), [job.pk])


@job_handler("risky_unreconcilable", reconcile=quote_the_card)
def risky_unreconcilable(job, lease):
    lease.checkpoint("psp_called")
    time.sleep(duration(job, lease))


def hang(job):
    """A reconcile hook that never answers (a PSP call without a timeout), after it says, with a
    `Charge` row, that it was called."""
    Charge.objects.create(job_ref=job.pk, token=0, owner="reconcile hook")
    time.sleep(3600)


@job_handler("risky_hanging", reconcile=hang)
def risky_hanging(job, lease):
    lease.checkpoint("psp_called")


def refuse(job):
    raise RuntimeError("the PSP refused the lookup")


@job_handler("risky_refused", reconcile=refuse)
def risky_refused(job, lease):
    lease.checkpoint("psp_called")


@job_handler("self_fail")
def self_fail(job, lease):
    """Record the failure itself, then return."""
    lease.fail("declined by the PSP", permanent=True)


# ---- faults of the handler's own making: whatever it raises ends that attempt only ----------


class Interrupted(BaseException):
    """A BaseException that is not an Exception, like KeyboardInterrupt."""


LongNamedError = type("Long" + "N" * 300 + "Error", (Exception,), {})


@job_handler("exits")
def exits(job, lease):
    raise SystemExit(3)


@job_handler("interrupted")
def interrupted(job, lease):
    raise Interrupted("stop right there")


@job_handler("long_named_error")
def long_named_error(job, lease):
    raise LongNamedError("a class name longer than the ledger's column")


@job_handler("unstorable_error")
def unstorable_error(job, lease):
    """An error whose text no column stores as it is: a NUL and a lone surrogate."""
    raise RuntimeError("card\x00 declined \udc80")


@job_handler("huge_database_error")
def huge_database_error(job, lease):
    """Raise PostgreSQL's refusal of a value as it quotes it, whole: the card, then
    `payload["newlines"]` newlines (runs that the redaction's patterns once read quadratically)."""
    value = job.payload["card"] + "\n" * job.payload["newlines"]
    raise DataError(f'invalid input syntax for type integer: "{value}"')


@job_handler("leaves_transaction_open")
def leaves_transaction_open(job, lease):
    """Write a charge with autocommit off and return without committing."""
    transaction.set_autocommit(False)
    Charge.objects.create(job_ref=job.pk, token=lease.token, owner="never committed")


@job_handler("hangs", timeout=1.5)
def hangs(job, lease):
    """Block (past the kind's timeout, if the payload says so), then record a charge."""
    time.sleep(duration(job, lease))
    with lease.atomic():
        Charge.objects.create(job_ref=job.pk, token=lease.token, owner=lease.owner)


# ---- async handlers ---------------------------------------------------------------------------


@job_handler("async_charge")
async def async_charge(job, lease):
    """Await, then record a charge and complete the job in one transaction."""
    await asyncio.sleep(duration(job, lease))
    await lease.aatomic(Charge.objects.create, job_ref=job.pk, token=lease.token, owner=lease.owner)


@job_handler("async_record")
async def async_record(job, lease):
    """Record a charge with Django's async ORM; the worker completes the job."""
    await lease.acheckpoint("started")
    await asyncio.sleep(duration(job, lease))
    await Charge.objects.acreate(job_ref=job.pk, token=lease.token, owner=lease.owner)


@job_handler("async_boom")
async def async_boom(job, lease):
    await asyncio.sleep(0)
    raise RuntimeError(job.payload.get("message", "async boom"))


@job_handler("async_permanent")
async def async_permanent(job, lease):
    await asyncio.sleep(0)
    raise PermanentError("card declined")


@job_handler("async_hangs", timeout=1)
async def async_hangs(job, lease):
    """Await far past the timeout: the worker cancels it; the charge below is never written."""
    await asyncio.sleep(60)
    await Charge.objects.acreate(job_ref=job.pk, token=lease.token, owner="after the timeout")


@job_handler("async_watches_cancel")
async def async_watches_cancel(job, lease):
    """Await as long as the payload says; record (as the run's lock) whether the worker
    cancelled the coroutine, and what the lease said then."""
    run = await LockRun.objects.acreate(job_ref=job.pk, lock="", token=lease.token)
    try:
        await asyncio.sleep(duration(job, lease))
    except asyncio.CancelledError:
        await LockRun.objects.filter(pk=run.pk).aupdate(
            finished_at=Now(), lock=f"coroutine cancelled lease.cancelled={lease.cancelled}"
        )
        raise
    await LockRun.objects.filter(pk=run.pk).aupdate(finished_at=Now(), lock="not cancelled")


@job_handler("async_blocks_its_loop", timeout=1)
async def async_blocks_its_loop(job, lease):
    """Block the event loop itself, so that it cannot be cancelled."""
    time.sleep(duration(job, lease))


async def _write_charge(job, lease):
    await Charge.objects.acreate(job_ref=job.pk, token=lease.token, owner=lease.owner)


@job_handler("returns_coroutine")
def returns_coroutine(job, lease):
    """A plain function that hands back a coroutine from a helper: the worker awaits it."""
    return _write_charge(job, lease)


@job_handler("leaky")
def leaky(job, lease):
    """Insert a job whose idempotency key already exists: the IntegrityError quotes the card."""
    PaymentJob.objects.create(kind="noop", idempotency_key=job.payload["card"])


# ---- a project's own job table (testapp.PayoutJob): kinds prefixed with its name ---------------


@job_handler("payout.send")
def send_payout(job, lease):
    """Sleep as the payload says, then record the payout and complete the job together."""
    time.sleep(duration(job, lease))
    with lease.atomic():
        Charge.objects.create(job_ref=job.pk, token=lease.token, owner=f"payout:{lease.owner}")


# ---- batched acknowledgements ----------------------------------------------------------------


@job_handler("noop_batch", ack="batch")
def noop_batch(job, lease):
    """Return at once (the worker buffers the completion), or fail if the payload says so."""
    if job.payload.get("fail"):
        raise RuntimeError("psp 502")


@job_handler("atomic_batch", ack="batch")
def atomic_batch(job, lease):
    """Record a charge and complete the job in one transaction: nothing left to batch."""
    with lease.atomic():
        Charge.objects.create(job_ref=job.pk, token=lease.token, owner=lease.owner)


@job_handler("sleep_batch", ack="batch")
def sleep_batch(job, lease):
    """Sleep as long as the payload says, then return: the worker buffers the completion."""
    time.sleep(duration(job, lease))


STEPS = ("authorize", "capture", "notify")


def provider_call(job, lease, name: str) -> dict:
    """One step's work: a call to the provider (a line in the file `payload["log"]`, outside the
    database, as the provider's own books), then a Charge written in the step's transaction. On
    the first attempt, sleeps `payload["seconds"]` after the call if it is step
    `payload["pause_in"]`: a crash or a pause then falls between the answer and the record."""
    key = lease.step_key(name)
    with open(job.payload["log"], "a") as log:
        log.write(f"{name} {key} {lease.token}\n")
    if lease.attempt == 1 and job.payload.get("pause_in") == name:
        time.sleep(float(job.payload["seconds"]))
    Charge.objects.create(job_ref=job.pk, token=lease.token, owner=name)
    return {"step": name, "key": key, "token": lease.token}


@job_handler("stepped")
def stepped(job, lease):
    """authorize -> capture -> notify as resumable steps; on the first attempt, sleeps
    `payload["seconds"]` after the step `payload["pause_after"]` is recorded."""
    for name in STEPS:
        lease.step(name, provider_call, job, lease, name)
        if lease.attempt == 1 and job.payload.get("pause_after") == name:
            time.sleep(float(job.payload["seconds"]))


def pause(job) -> None:
    """Write the job's id to `payload["marker"]`, then sleep `payload["seconds"]`."""
    with open(job.payload["marker"], "w") as marker:
        marker.write(str(job.pk))
    time.sleep(float(job.payload["seconds"]))


def after_the_release(job):
    """A statement wrapper that pauses (`pause()`) right after the UPDATE that counts this job's
    completion for its dependents (`endings.release_dependents()`), before the commit."""

    def wrapper(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        # Its SET counts one more prerequisite met: `"unmet" = ("table"."unmet" - %s)`.
        if sql.lstrip().upper().startswith("UPDATE") and re.search(r'[`"]unmet[`"] = \(', sql):
            pause(job)
        return result

    return wrapper


@job_handler("releases_then_pauses")
def releases_then_pauses(job, lease):
    """Record a LockRun and complete in `lease.atomic()`. On the first attempt, pause
    (`pause()`) where `payload["pause"]` says: "before_commit", inside the completing
    transaction right after it released the dependents; "after_commit", right after it
    committed."""
    where = job.payload.get("pause") if lease.attempt == 1 else None
    with ExitStack() as stack:
        if where == "before_commit":
            stack.enter_context(connection.execute_wrapper(after_the_release(job)))
        with lease.atomic():
            LockRun.objects.create(job_ref=job.pk, lock="", token=lease.token)
            if where == "after_commit":
                transaction.on_commit(lambda: pause(job))


@job_handler("traced")
def traced(job, lease):
    """Record the span current in the handler (a `LockRun` whose `lock` is its trace and span
    id), run a span of its own inside it, and raise on as many attempts as the payload's "fail"
    says."""
    # Here, not at the top: a worker process of tests/test_tracing.py runs without opentelemetry.
    from opentelemetry import trace

    ids = trace.get_current_span().get_span_context()
    LockRun.objects.create(
        job_ref=job.pk, lock=f"{ids.trace_id:032x}-{ids.span_id:016x}", token=lease.token
    )
    with trace.get_tracer("tests").start_as_current_span("charge the card"):
        if lease.attempt <= job.payload.get("fail", 0):
            raise ValueError("card declined")
