"""The payment demo: real worker and watcher processes, a crash, a frozen worker, an audit.

`manage.py demo` runs `Demo.run()`. It migrates the database, adds a few hundred payments with
their jobs (checkouts as resumable steps, captures with their webhook, ledger posting or refund
enqueued after them, and some pending payments whose PSP webhook was lost, for the periodic
reconcile sweep to heal), starts `run_lease_worker` processes and a `watch_stuck_jobs` process,
then on purpose SIGKILLs one worker in the middle of a PSP call and freezes another (SIGSTOP)
for longer than its leases, so that it wakes up as a zombie. It shows the jobs settle, then
holds the fake PSP's books against the payments: no payment may be charged twice, no recorded
step run again, no dependent started before its capture completed (`flows.py`).
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

from django.core.management import call_command
from django.db import OperationalError, connection, connections, transaction
from django.db.models import Count, F, Max, OuterRef, Q, QuerySet, Subquery
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from django_leases.conf import leases_settings
from django_leases.models import JobAttempt, JobStep, PaymentJob
from django_leases.schedules import configured
from example_project.payments import psp
from example_project.payments.flows import FlowAudit, audit_flows, held
from example_project.payments.models import Payment
from example_project.payments.routers import BOOKS

MANAGE_PY = Path(__file__).resolve().parents[2] / "manage.py"
KINDS = ("capture", "refund", "reconcile", "checkout", "webhook", "ledger")
# A payment whose capture and refund are both enqueued, the refund after the capture.
CAPTURE_THEN_REFUND = "capture+refund"
# A capture fanning out to a webhook and a ledger posting, both enqueued after it.
FAN_OUT = "capture+webhook+ledger"
# The periodic job that enqueues the reconciles (DJANGO_LEASES["SCHEDULES"] in settings.py).
SWEEP = "reconcile_sweep"
OPEN = ("pending", "waiting", "processing", "review")
CURRENCIES = ("EUR", "USD", "GBP", "CHF")
ADMIN = "http://127.0.0.1:8000/admin/django_leases/paymentjob/"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: unwind, so that the demo stops its children on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class DatabaseUnreachableError(Exception):
    """The demo's database cannot be reached (or does not exist)."""


@dataclass(frozen=True)
class Options:
    jobs: int = 300
    workers: int = 3
    concurrency: int = 3
    ttl: float = 4.0
    heartbeat: float = 1.0
    timeout: float = 300.0
    grace_period: float = 3.0

    @property
    def pause_for(self) -> float:
        """How long the zombie is frozen: long enough for its leases to expire and be acted on."""
        return 2.5 * self.ttl


@dataclass(frozen=True)
class Scope:
    """The rows of this run: a database may hold earlier runs' (or a project's own) rows."""

    payment_floor: int
    job_floor: int

    @classmethod
    def after_existing(cls) -> Scope:
        payments = Payment.objects.aggregate(top=Max("pk"))["top"] or 0
        jobs = PaymentJob.objects.aggregate(top=Max("pk"))["top"] or 0
        return cls(payments, jobs)

    def payments(self) -> QuerySet[Payment]:
        return Payment.objects.filter(pk__gt=self.payment_floor)

    def jobs(self) -> QuerySet[PaymentJob]:
        return PaymentJob.objects.filter(pk__gt=self.job_floor, kind__in=KINDS)

    def sweeps(self) -> QuerySet[PaymentJob]:
        return PaymentJob.objects.filter(pk__gt=self.job_floor, kind=SWEEP)

    def unhealed(self) -> QuerySet[Payment]:
        """Payments still pending: the PSP captured them, the sweep has not healed them yet."""
        return self.payments().filter(status=Payment.Status.PENDING)

    def healed(self) -> int:
        """Payments the sweep's reconcile jobs found captured at the PSP and recorded so."""
        reconciled = self.jobs().filter(kind="reconcile", status=PaymentJob.Status.COMPLETED)
        refs = [int(ref) for ref in reconciled.values_list("payment_id", flat=True)]
        return self.payments().filter(pk__in=refs, status=Payment.Status.CAPTURED).count()

    def attempts(self) -> QuerySet[JobAttempt]:
        return JobAttempt.objects.filter(job_ref__gt=self.job_floor)


@dataclass
class Report:
    """What the demo saw; `problems` lists what makes it fail."""

    payments: Counter[str]
    jobs: Counter[str]
    outcomes: Counter[str]
    fenced: int
    outlived_ttl: int
    healed: int
    sweeps: int
    audit: psp.Audit
    refunds_before_capture: int
    """Refunds that started before the capture of their payment was settled."""
    flows: FlowAudit
    seconds: float
    events: list[str]
    logs: Path
    problems: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.audit.double_charges or self.audit.phantom_payments:
            return 2
        return 3 if self.problems else 0


# ---- the child processes -------------------------------------------------------------------


class Child:
    """One `manage.py` subprocess in its own process group, logging to a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logs: Path) -> None:
        self.name = name
        self.log: IO[str] = (logs / f"{name}.log").open("w")
        self.proc = subprocess.Popen(  # noqa: S603 - our own interpreter and manage.py
            [sys.executable, str(MANAGE_PY), *args],
            cwd=MANAGE_PY.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            # Its own group: a terminal's Ctrl-C reaches the demo only, which stops it in order.
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)
        except ProcessLookupError:
            pass


def stop_all(children: list[Child], grace: float) -> None:
    """SIGTERM every child's group, wait `grace` seconds, SIGKILL what is left, reap them all."""
    for child in children:
        child.signal(signal.SIGTERM)
        child.signal(signal.SIGCONT)  # a frozen child must wake up to hear SIGTERM
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        # Also for a leader that exited: anything it left in its group goes too.
        child.signal(signal.SIGKILL)
        child.proc.wait()
        child.log.close()


# ---- the live view -----------------------------------------------------------------------


class View:
    """A progress bar with per-status counts on a terminal; a line every few seconds elsewhere."""

    def __init__(self, console: Console, total: int) -> None:
        self.console = console
        self.total = total
        self.started = time.monotonic()
        self._progress: Progress | None = None
        self._last_line = 0.0

    @contextmanager
    def shown(self) -> Iterator[View]:
        if not self.console.is_terminal:
            yield self
            return
        self._progress = Progress(
            TextColumn("[bold]settling payment jobs"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[counts]}"),
            console=self.console,
        )
        self._task = self._progress.add_task("jobs", total=self.total, counts="")
        with self._progress:
            yield self

    def update(self, counts: Counter[str], stuck: int) -> None:
        settled = self.total - sum(counts[status] for status in OPEN)
        parts = [(name, counts[name]) for name in ("pending", "processing")]
        parts += [("stuck", stuck), *((name, counts[name]) for name in ("review", "failed"))]
        if self._progress is not None:
            text = "  ".join(
                f"[{'red' if name in ('stuck', 'failed') and n else 'cyan'}]{name}[/] {n}"
                for name, n in parts
            )
            self._progress.update(self._task, completed=settled, counts=text)
            return
        now = time.monotonic()
        if now - self._last_line >= 5 or settled == self.total:
            self._last_line = now
            detail = ", ".join(f"{name} {n}" for name, n in parts)
            self.console.print(
                f"[{now - self.started:5.1f}s] settled {settled}/{self.total}: {detail}",
                highlight=False,
            )

    def event(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        self.console.print(f"[{elapsed:5.1f}s] {text}", highlight=False)


# ---- the run -------------------------------------------------------------------------------


class Demo:
    """One run of the demo: `run()` returns its report; `interrupt()` cuts it short."""

    def __init__(self, options: Options, console: Console) -> None:
        self.options = options
        self.console = console
        self.children: list[Child] = []
        self.events: list[str] = []
        self.stopping = False
        self._spawning = False
        self._deferred: int | None = None
        self.logs = Path(tempfile.mkdtemp(prefix="leases-demo-"))
        self._workers_started = 0
        # The accidents, in order: "crash", "freeze", "frozen", "thawed", then "done".
        self._step = "crash"
        self._until = 0.0
        self._zombie: Child | None = None

    # -- setup

    def seed(self) -> Scope:
        """Add `jobs` jobs and their payments: mostly captures, some refunds, some checkouts
        (steps), some captures with their refund enqueued after them (one payment, two jobs) or
        with a webhook and a ledger posting (three jobs); and some pending payments whose
        webhook was lost, for the sweep to find and reconcile."""
        scope = Scope.after_existing()
        total = self.options.jobs
        pairs, refunds = round(total * 0.06), round(total * 0.06)
        reconciles, checkouts, fans = round(total * 0.08), round(total * 0.03), round(total * 0.05)
        kinds = ["refund"] * refunds + ["reconcile"] * reconciles + ["checkout"] * checkouts
        kinds += [CAPTURE_THEN_REFUND] * pairs + [FAN_OUT] * fans
        kinds += ["capture"] * (total - len(kinds) - pairs - 2 * fans)
        random.shuffle(kinds)
        initial = {
            "capture": Payment.Status.AUTHORIZED,
            CAPTURE_THEN_REFUND: Payment.Status.AUTHORIZED,
            FAN_OUT: Payment.Status.AUTHORIZED,
            "checkout": Payment.Status.NEW,
            "refund": Payment.Status.CAPTURED,
            "reconcile": Payment.Status.PENDING,
        }
        with transaction.atomic():
            Payment.objects.bulk_create(
                Payment(
                    amount=random.randrange(500, 25_000),  # noqa: S311
                    currency=random.choice(CURRENCIES),  # noqa: S311
                    status=initial[kind],
                )
                for kind in kinds
            )
            payments = list(scope.payments().order_by("pk"))
            for payment, kind in zip(payments, kinds, strict=True):
                self._give_history(payment, kind)
                if kind != "reconcile":  # the sweep enqueues those
                    self._enqueue(payment, kind.split("+"))
        return scope

    @staticmethod
    def _enqueue(payment: Payment, kinds: list[str]) -> None:
        """Enqueue the first of `kinds` for `payment` (locked by its payment, LOCK_BY_PAYMENT),
        and the others after it: each waits until it has completed, and runs at once then,
        beside the others (no lock)."""
        first, *dependents = kinds
        options: dict[str, Any] = {"payment_id": str(payment.pk), "max_attempts": 8}
        payload = {"amount": payment.amount, "currency": payment.currency}
        job = PaymentJob.objects.enqueue(
            first, payload, idempotency_key=f"{first}-{payment.pk}", **options
        )
        for kind in dependents:
            PaymentJob.objects.enqueue(
                kind,
                payload,
                idempotency_key=f"{kind}-{payment.pk}",
                after=[job],
                lock="",
                **options,
            )

    @staticmethod
    def _give_history(payment: Payment, kind: str) -> None:
        """Write what happened before the job: the capture to refund, the lost webhook."""
        ref, amount, currency = str(payment.pk), payment.amount, payment.currency
        if kind == "refund":
            key = f"capture-{payment.pk}"
            result = psp.act_now(psp.CAPTURE, ref, amount, currency, idempotency_key=key)
            Payment.objects.filter(pk=payment.pk).update(psp_reference=result.reference)
        elif kind == "reconcile":
            # The customer paid at checkout, but the PSP's webhook never reached the shop.
            key = f"checkout-{payment.pk}"
            psp.act_now(psp.CAPTURE, ref, amount, currency, idempotency_key=key)

    def _child_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            # example_project.settings reads these; the --ttl and --heartbeat flags win anyway.
            "LEASE_TTL": str(self.options.ttl),
            "LEASE_HEARTBEAT": str(self.options.heartbeat),
            "FAKE_PSP_LATENCY": os.environ.get("FAKE_PSP_LATENCY", "0.4"),
            "FAKE_PSP_STALL_SECONDS": str(2 * self.options.ttl),
        }

    def interrupt(self, signum: int) -> None:
        """Stop the run (from a signal handler), unless it is already stopping its children."""
        if self.stopping:
            return
        if self._spawning:
            self._deferred = signum
            return
        raise Interrupted(signum)

    def _start(self, name: str, *args: str) -> Child:
        # A signal between the fork and the append would leave a child nobody stops: it waits.
        self._spawning = True
        try:
            child = Child(name, list(args), self._child_env(), self.logs)
            self.children.append(child)
        finally:
            self._spawning = False
        if self._deferred is not None:
            raise Interrupted(self._deferred)
        return child

    def start_worker(self) -> Child:
        self._workers_started += 1
        options = self.options
        return self._start(
            f"demo-w{self._workers_started}",
            "run_lease_worker",
            *("--worker-id", f"demo-w{self._workers_started}"),
            *("--ttl", str(options.ttl), "--heartbeat", str(options.heartbeat)),
            *("--concurrency", str(options.concurrency), "--poll-interval", "0.2"),
            *("--grace-period", str(options.grace_period)),
            *(arg for kind in (*KINDS, SWEEP) for arg in ("--kind", kind)),
        )

    def start_watcher(self) -> Child:
        return self._start(
            "demo-watcher", "watch_stuck_jobs", "--interval", "1", "--watcher-id", "demo-watcher"
        )

    # -- the run

    def run(self) -> Report:
        started = time.monotonic()
        try:
            call_command("migrate", interactive=False, verbosity=0)
            call_command("migrate", database=BOOKS, interactive=False, verbosity=0)
        except OperationalError as exc:
            raise DatabaseUnreachableError(f"cannot reach the database: {exc}".strip()) from exc
        self.say(self.intro())
        scope = self.seed()
        view = View(self.console, self.options.jobs)
        try:
            workers = [self.start_worker() for _ in range(self.options.workers)]
            self.start_watcher()
            self.say(
                "started "
                + ", ".join(f"{child.name} (pid {child.pid})" for child in self.children)
                + f"; their logs are in {self.logs}"
            )
            with view.shown():
                settled = self._watch(scope, view, workers)
        finally:
            self.stopping = True
            stop_all(self.children, self.options.grace_period + 5)
        report = self.report(scope, time.monotonic() - started)
        if not settled:
            report.problems.append(
                f"{sum(report.jobs[s] for s in OPEN) - report.flows.held} job(s) still open after "
                f"{self.options.timeout:g}s; see the logs in {self.logs}"
            )
        if report.audit.double_charges:
            report.problems.append(f"{report.audit.double_charges} double charge(s) at the PSP")
        if report.refunds_before_capture:
            report.problems.append(
                f"{report.refunds_before_capture} refund(s) started before their capture settled"
            )
        flows = report.flows
        if flows.step_reruns:
            report.problems.append(f"{flows.step_reruns} PSP call(s) of a step already recorded")
        if flows.started_early:
            report.problems.append(
                f"{flows.started_early} dependent(s) started before their capture"
            )
        if flows.ran_twice:
            report.problems.append(f"{flows.ran_twice} dependent(s) ran twice")
        if report.audit.phantom_payments:
            report.problems.append(
                f"{report.audit.phantom_payments} payment(s) captured or refunded in the shop "
                "but not at the PSP"
            )
        return report

    def intro(self) -> str:
        options = self.options
        sweeps = [schedule.every for schedule in configured() if schedule.kind == SWEEP]
        sweep = f"a reconcile sweep every {sweeps[0]:g}s" if sweeps else "no reconcile sweep"
        return (
            f"{options.jobs} payment jobs on the {connection.vendor} database "
            f"{connection.settings_dict['NAME']}: {options.workers} worker(s) x "
            f"{options.concurrency} slots, TTL {options.ttl:g}s, heartbeat {options.heartbeat:g}s;"
            f" stuck captures are held for '{leases_settings.stuck_policy('capture')}'; {sweep}"
        )

    def say(self, text: str) -> None:
        self.console.print(text, highlight=False)

    def _watch(self, scope: Scope, view: View, workers: list[Child]) -> bool:
        deadline = time.monotonic() + self.options.timeout
        jobs = scope.jobs()
        while time.monotonic() < deadline:
            counts = count_by(jobs, "status")
            # A payment waiting for the sweep is open too; its reconcile job counts once. A job
            # held behind a failed capture waits for an operator: settled, for the demo.
            counts["pending"] += scope.unhealed().count() - counts_of(jobs, "reconcile", OPEN)
            counts["waiting"] -= held(jobs)
            view.update(counts, jobs.expired().count())
            left = sum(counts[status] for status in OPEN)
            self._accidents(scope, view, workers, 1 - left / self.options.jobs, idle=left == 0)
            if left == 0 and self._step == "done":
                return True
            time.sleep(0.25)
        return False

    # -- the accidents

    def _accidents(
        self, scope: Scope, view: View, workers: list[Child], done: float, *, idle: bool
    ) -> None:
        """Crash one worker mid-PSP-call, then freeze another past its leases, then thaw it."""
        now = time.monotonic()
        if self._step == "crash" and idle:
            self._record(view, "every job settled before a worker could be killed")
            self._step = "done"
        elif self._step == "crash" and done >= 0.15:
            victim = workers[0]
            held = self._held(scope, victim.name)
            # Best in a checkout between steps (it resumes after them), else after a PSP call.
            checkouts = [job.pk for job in held if job.kind == "checkout"]
            between_steps = JobStep.objects.filter(job_ref__in=checkouts).exists()
            risky = done >= 0.25 and any(job.checkpoint for job in held)
            if between_steps or risky or done >= 0.5:
                self._kill(victim, held, view)
                workers.remove(victim)
                workers.append(self.start_worker())
                self._step = "freeze"
        elif self._step == "freeze" and (done >= 0.35 or idle):
            zombie = workers[0]
            held = [job for job in self._held(scope, zombie.name) if job.checkpoint]
            if held:
                self._freeze(zombie, held, view)
                self._step, self._until = "frozen", now + self.options.pause_for
            elif idle:
                self._record(view, "every job settled before a worker could be frozen")
                self._step = "done"
        elif self._step == "frozen" and self._zombie and now >= self._until:
            self._zombie.signal(signal.SIGCONT)
            self._record(
                view,
                f"SIGCONT {self._zombie.name}: it wakes up as a zombie; the PSP answers its "
                "calls from the first result, and its writes are refused (fenced out)",
            )
            self._step, self._until = "thawed", now + 3 * self.options.ttl
        elif self._step == "thawed" and self._zombie:
            if now >= self._until or not self._unfenced(scope, self._zombie):
                self._step = "done"

    def _held(self, scope: Scope, owner: str) -> list[PaymentJob]:
        return list(scope.jobs().held_by(owner).order_by("pk"))

    @staticmethod
    def _unfenced(scope: Scope, zombie: Child) -> bool:
        """Whether the zombie still has a lost lease on which it was not yet refused a write."""
        return (
            scope.attempts()
            .filter(owner=zombie.name, fenced_at__isnull=True)
            .exclude(outcome__in=["running", "completed", "failed", "retried", "released"])
            .exists()
        )

    def _kill(self, victim: Child, held: list[PaymentJob], view: View) -> None:
        victim.signal(signal.SIGKILL)
        victim.proc.wait()
        jobs = describe(held)
        self._record(
            view,
            f"SIGKILL {victim.name} (pid {victim.pid}) while it held {jobs}; its leases expire "
            f"within {self.options.ttl:g}s. A new worker takes its place.",
        )

    def _freeze(self, zombie: Child, held: list[PaymentJob], view: View) -> None:
        # A checkout's step holds the write lock while the PSP answers: up to STEP_TIMEOUT.
        for _ in range(100):
            zombie.signal(signal.SIGSTOP)
            if not self._froze_inside_a_write():
                break
            # On SQLite a process frozen mid-transaction would keep the database's write lock
            # and stop everybody: let it finish that write, then freeze it again.
            zombie.signal(signal.SIGCONT)
            time.sleep(0.05)
        self._zombie = zombie
        self._record(
            view,
            f"SIGSTOP {zombie.name} (pid {zombie.pid}) after it called the PSP for "
            f"{describe(held)}, for {self.options.pause_for:g}s (a frozen VM, a long GC pause)",
        )

    @staticmethod
    def _froze_inside_a_write() -> bool:
        files = {connections[alias].settings_dict["NAME"] for alias in ("default", BOOKS)}
        return connection.vendor == "sqlite" and any(map(write_locked, sorted(files)))

    def _record(self, view: View, text: str) -> None:
        self.events.append(text)
        view.event(text)

    # -- the report

    def report(self, scope: Scope, seconds: float) -> Report:
        attempts = scope.attempts()
        return Report(
            payments=count_by(scope.payments(), "status"),
            jobs=count_by(scope.jobs(), "status"),
            outcomes=count_by(attempts, "outcome"),
            fenced=attempts.filter(fenced_at__isnull=False).count(),
            outlived_ttl=attempts.filter(
                outcome="completed",
                ended_at__gt=F("claimed_at") + timedelta(seconds=self.options.ttl),
            ).count(),
            healed=scope.healed(),
            sweeps=scope.sweeps().filter(status=PaymentJob.Status.COMPLETED).count(),
            audit=psp.audit(scope.payments()),
            refunds_before_capture=refunds_before_capture(scope),
            flows=audit_flows(scope.jobs()),
            seconds=seconds,
            events=self.events,
            logs=self.logs,
        )


def refunds_before_capture(scope: Scope) -> int:
    """Count the refunds whose first attempt started before their payment's capture job reached
    its final status, by the database clock (the ledger's `claimed_at`)."""
    jobs = scope.jobs()
    capture = jobs.filter(kind="capture", payment_id=OuterRef("payment_id"))
    first_claim = JobAttempt.objects.filter(job_ref=OuterRef("pk")).order_by("claimed_at")
    refunds = jobs.filter(
        kind="refund", payment_id__in=jobs.filter(kind="capture").values("payment_id")
    ).annotate(
        settled=Subquery(capture.values("completed_at")[:1]),
        started=Subquery(first_claim.values("claimed_at")[:1]),
    )
    early = Q(settled__isnull=True) | Q(started__lt=F("settled"))
    return refunds.filter(early, started__isnull=False).count()


def write_locked(path: str) -> bool:
    """Whether a process holds the write lock of the SQLite file `path`."""
    probe = sqlite3.connect(path, timeout=0.2)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError:
        return True
    finally:
        probe.close()


def count_by(queryset: QuerySet[Any], column: str) -> Counter[str]:
    return Counter(dict(queryset.order_by().values_list(column).annotate(n=Count("pk"))))


def counts_of(jobs: QuerySet[PaymentJob], kind: str, statuses: tuple[str, ...]) -> int:
    return jobs.filter(kind=kind, status__in=statuses).count()


def describe(jobs: list[PaymentJob]) -> str:
    if not jobs:
        return "no job"
    return ", ".join(
        f"{job.kind} job {job.pk}" + (f" (at {job.checkpoint})" if job.checkpoint else "")
        for job in jobs
    )


def render(report: Report, console: Console, database_url: str | None) -> None:
    """Print the summary table, what happened, and where to look next."""
    jobs, outcomes, audit = report.jobs, report.outcomes, report.audit
    table = Table(title="django-leases payment demo", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("count", justify="right")
    table.add_column("what it means")
    payments = ", ".join(f"{status} {n}" for status, n in sorted(report.payments.items()))
    table.add_row("payments", str(report.payments.total()), payments)
    table.add_row("jobs completed", str(jobs["completed"]), "")
    table.add_row(
        "jobs failed",
        str(jobs["failed"]),
        "PermanentError (the PSP rejected the capture), or no attempt left",
    )
    open_jobs = sum(jobs[status] for status in OPEN)
    if open_jobs:
        table.add_row("jobs still open", str(open_jobs), "pending, processing or under review")
    table.add_row(
        "rescued",
        str(outcomes["lease_lost"] + outcomes["rescued"]),
        f"leases that expired: {outcomes['lease_lost']} taken over by a worker, "
        f"{outcomes['rescued']} returned by the watcher",
    )
    table.add_row(
        "held for review",
        str(outcomes["review"]),
        "captures that expired after calling the PSP, settled by its reconcile hook",
    )
    table.add_row(
        "fenced-out attempts",
        str(report.fenced),
        "a holder came back after losing its lease; its write was refused",
    )
    table.add_row(
        "kept by heartbeats",
        str(report.outlived_ttl),
        "attempts that ran longer than the TTL and kept their lease",
    )
    table.add_row(
        "healed by the sweep",
        str(report.healed),
        f"pending payments the PSP had captured (lost webhook), found by {report.sweeps} "
        "periodic sweep(s) and reconciled",
    )
    table.add_row(
        "idempotent replays",
        str(audit.replays),
        "PSP calls answered from an earlier result: no money moved",
    )
    flows = report.flows
    table.add_row(
        "checkout steps",
        str(flows.steps_recorded),
        f"authorize, capture, notify, each recorded once; {flows.resumed} checkout(s) resumed "
        f"in a later attempt, skipping {flows.steps_skipped} recorded step(s)",
    )
    table.add_row(
        "step re-runs",
        str(flows.step_reruns),
        "PSP calls of a step already recorded, from a later attempt; "
        f"{flows.step_replays} call(s) of a step not yet recorded answered from its key",
    )
    table.add_row(
        "follow-ups",
        str(flows.follow_ups),
        f"webhooks and ledger postings run after their capture, {flows.ran_twice} twice; "
        f"{flows.held} job(s) held behind a failed capture for an operator",
    )
    table.add_row(
        "before their capture",
        str(report.refunds_before_capture + flows.started_early),
        "refunds, webhooks and ledger postings enqueued after= a capture that started "
        "before it completed",
    )
    style = "bold red" if audit.double_charges else "bold green"
    table.add_row(
        "double charges",
        f"[{style}]{audit.double_charges}[/]",
        "at the fake PSP: a payment charged twice, or charged without the shop knowing",
    )
    console.print(table)
    console.print("What happened:", style="bold")
    for event in report.events:
        console.print(f"  - {event}", highlight=False)
    # This interpreter (the README's .venv/bin/python): a bare `python` lacks the demo's packages.
    python = os.path.relpath(sys.executable)
    manage = f"{sys.executable if python.startswith('..') else python} manage.py"
    if database_url:
        manage = f"DATABASE_URL={database_url} {manage}"
    console.print(
        f"Took {report.seconds:.0f}s. Worker and watcher logs: {report.logs}\n"
        f"See every job and its attempt ledger in the admin: {manage} createsuperuser, "
        f"{manage} runserver, then {ADMIN}",
        highlight=False,
    )
    if not report.problems:
        console.print(
            f"OK: every payment settled, double charges: {audit.double_charges}.",
            style="bold green",
        )
