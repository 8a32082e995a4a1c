"""Queues on more than one database: `enqueue(using=)`, the routers, and a worker, a watcher and
`prune_jobs` per database (`--database`), with real processes on two databases of one server."""

import json
import math
import re
import time
from datetime import timedelta
from typing import Any

import pytest
from django.contrib import admin
from django.db import connections
from django.db.models import F
from django.db.models.functions import Now
from django.test import Client, override_settings
from django.urls import path, reverse

from django_leases import metrics
from django_leases.admin.ledger import JobAttemptAdmin
from django_leases.admin.payments import PaymentJobAdmin
from django_leases.admin.workers import WorkerAdmin
from django_leases.dialects import dialect_of
from django_leases.exceptions import InvalidArgument
from django_leases.models import JobAttempt, JobEvent, PaymentJob, ScheduleState, Worker
from django_leases.schedules import enqueue_due
from django_leases.watcher import StuckWatcher

from .conftest import Processes, finish, read_until, subprocess_env
from .routers import ReplicaRouter
from .test_admin import form_data
from .test_metrics import parse, scrape
from .ticking import tick_of


class OtherJobAdmin(PaymentJobAdmin):
    using = "other"


class OtherWorkerAdmin(WorkerAdmin):
    using = "other"


class OtherAttemptAdmin(JobAttemptAdmin):
    using = "other"


# The other database's queue, on an admin site of its own (docs/scaling.md).
other_admin = admin.AdminSite(name="other_admin")
other_admin.register(PaymentJob, OtherJobAdmin)
other_admin.register(Worker, OtherWorkerAdmin)
other_admin.register(JobAttempt, OtherAttemptAdmin)

urlpatterns = [
    path("metrics/", metrics.queue_metrics),
    path("metrics/other/", metrics.queue_metrics, {"using": "other"}),
    path("admin/", admin.site.urls),
    path("other-admin/", other_admin.urls),
]

pytestmark = [pytest.mark.django_db(databases=["default", "other"], transaction=True)]

Status = PaymentJob.Status
BOTH = ("default", "other")


class OtherRouter:
    """Sends the queue's tables to "other"."""

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return "other" if model._meta.app_label == "django_leases" else None

    db_for_read = db_for_write


def counts() -> dict[str, int]:
    return {alias: PaymentJob.objects.using(alias).count() for alias in BOTH}


def test_enqueue__using_puts_the_job_on_that_database_only() -> None:
    job = PaymentJob.objects.enqueue("noop", {"n": 1}, using="other")
    also = PaymentJob.objects.using("other").enqueue("noop", {"n": 2})
    assert job._state.db == also._state.db == "other"
    assert counts() == {"default": 0, "other": 2}
    assert PaymentJob.objects.using("other").get(pk=job.pk).payload == {"n": 1}


def test_enqueue__locks_and_idempotency_keys_work_on_the_database_chosen() -> None:
    first = PaymentJob.objects.enqueue("noop", payment_id="p1", using="other")
    second = PaymentJob.objects.enqueue("noop", payment_id="p1", using="other")
    keyed = PaymentJob.objects.enqueue("noop", idempotency_key="k", using="other")
    again = PaymentJob.objects.enqueue("noop", idempotency_key="k", using="other")
    on_other = PaymentJob.objects.using("other")
    assert on_other.get(pk=first.pk).status == Status.PENDING
    assert on_other.get(pk=second.pk).status == Status.WAITING
    assert again.pk == keyed.pk and counts() == {"default": 0, "other": 3}
    # The same key on the other database is another job: each database has its own queue.
    assert PaymentJob.objects.enqueue("noop", idempotency_key="k")._state.db == "default"


def test_enqueue__follows_the_routers_when_no_database_is_given() -> None:
    with override_settings(DATABASE_ROUTERS=[OtherRouter()]):
        job = PaymentJob.objects.enqueue("noop", payment_id="p1")
        many = PaymentJob.objects.enqueue_many("noop", [{}, {}])
    assert job._state.db == "other" and {j._state.db for j in many} == {"other"}
    assert counts() == {"default": 0, "other": 3}


@pytest.mark.parametrize("using", ["nope", 3, ""])
def test_enqueue__an_unknown_database_is_refused_and_nothing_is_written(using: Any) -> None:
    with pytest.raises(InvalidArgument, match="using must name a database of DATABASES"):
        PaymentJob.objects.enqueue("noop", using=using)
    with pytest.raises(InvalidArgument, match="using must name a database of DATABASES"):
        PaymentJob.objects.enqueue_many("noop", [{}], using=using)
    assert counts() == {"default": 0, "other": 0}


def test_commands__each_runs_on_its_database_only(processes: Processes) -> None:
    here = [PaymentJob.objects.enqueue("noop") for _ in range(5)]
    there = [PaymentJob.objects.enqueue("noop", using="other") for _ in range(6)]
    # A handler's own lease writes (a checkpoint) go to the database its job was claimed on.
    there.append(PaymentJob.objects.enqueue("risky", using="other"))
    proc = processes.manage("run_lease_worker", "--burst", "--database", "other", "-v", "2")
    out = finish(proc)
    assert proc.returncode == 0, out
    on_other = PaymentJob.objects.using("other")
    assert {on_other.get(pk=job.pk).status for job in there} == {Status.COMPLETED}
    assert JobAttempt.objects.using("other").filter(outcome="completed").count() == 7
    assert on_other.get(pk=there[-1].pk).checkpoint == "psp_called"
    assert Worker.objects.using("other").count() == 1
    # Nothing on the default database was touched: not its jobs, ledger or registry.
    assert {PaymentJob.objects.get(pk=job.pk).status for job in here} == {Status.PENDING}
    assert JobAttempt.objects.count() == 0 and Worker.objects.count() == 0

    proc = processes.manage("run_lease_worker", "--burst", "--database", "default")
    assert finish(proc) is not None and proc.returncode == 0
    assert {PaymentJob.objects.get(pk=job.pk).status for job in here} == {Status.COMPLETED}
    assert JobAttempt.objects.count() == 5
    assert JobAttempt.objects.using("other").count() == 7


def test_watcher__one_per_database_rescues_that_databases_leases(processes: Processes) -> None:
    stuck = {}
    for alias in BOTH:
        job = PaymentJob.objects.enqueue("noop", using=alias)
        [claimed] = PaymentJob.objects.using(alias).claim("gone-worker", ttl=60)
        PaymentJob.objects.using(alias).filter(pk=claimed.pk).update(
            lease_until=Now() - timedelta(seconds=5)
        )
        stuck[alias] = job
    proc = processes.manage("watch_stuck_jobs", "--once", "--database", "other")
    out = finish(proc)
    assert proc.returncode == 0, out
    assert f"job_id={stuck['other'].pk} " in out
    on_other = PaymentJob.objects.using("other").get(pk=stuck["other"].pk)
    assert on_other.status == Status.PENDING
    assert JobAttempt.objects.using("other").get(job_ref=on_other.pk).outcome == "rescued"
    assert PaymentJob.objects.get(pk=stuck["default"].pk).status == Status.PROCESSING


def test_prune_jobs__prunes_the_database_given(processes: Processes) -> None:
    for alias in BOTH:
        job = PaymentJob.objects.enqueue("noop", using=alias)
        PaymentJob.objects.using(alias).filter(pk=job.pk).update(
            status=Status.COMPLETED, completed_at=Now() - timedelta(days=400)
        )
    proc = processes.manage("prune_jobs", "--database", "other")
    out = finish(proc)
    assert proc.returncode == 0, out
    assert counts() == {"default": 1, "other": 0}


@pytest.mark.parametrize("command", ["run_lease_worker", "watch_stuck_jobs", "prune_jobs"])
def test_commands__an_unknown_database_is_one_line_and_exit_1(
    processes: Processes, command: str
) -> None:
    job = PaymentJob.objects.enqueue("noop")
    proc = processes.manage(
        command, "--burst" if command == "run_lease_worker" else "-v1", "--database", "nope"
    )
    out = finish(proc, timeout=30)
    assert proc.returncode == 1, out
    assert "'nope' is not a database of DATABASES (default, other, local, psp)" in out
    assert len(out.strip().splitlines()) == 1
    assert PaymentJob.objects.get(pk=job.pk).status == Status.PENDING


def test_watcher_metrics__gauges_of_the_database_it_watches(processes: Processes) -> None:
    for _ in range(3):
        PaymentJob.objects.enqueue("noop", using="other")
    PaymentJob.objects.enqueue("noop")
    proc = processes.manage(
        "watch_stuck_jobs", "--database", "other", "--metrics-port", "0", "--interval", "60"
    )
    out = read_until(proc, "/metrics")
    match = re.search(r"metrics at (http://127\.0\.0\.1:\d+/metrics)", out)
    assert match, out
    samples = scrape(match.group(1))
    assert samples[("django_leases_jobs", (("kind", "noop"), ("status", "pending")))] == 3
    # Each endpoint names the database and table it serves, for a join in PromQL.
    info = ("database", "other"), ("table", "django_leases_paymentjob")
    assert samples[("django_leases_queue_info", info)] == 1


def test_worker_metrics__name_the_database_the_worker_serves(processes: Processes) -> None:
    proc = processes.manage(
        "run_lease_worker", "--database", "other", "--metrics-port", "0", "--poll-interval", "0.2"
    )
    out = read_until(proc, "/metrics")
    match = re.search(r"metrics at (http://127\.0\.0\.1:\d+/metrics)", out)
    assert match, out
    samples = scrape(match.group(1))
    info = ("database", "other"), ("table", "django_leases_paymentjob")
    assert samples[("django_leases_queue_info", info)] == 1
    assert not [key for key in samples if key[0] == "django_leases_queue_info" and key[1] != info]


@pytest.mark.urls("tests.test_databases")
def test_queue_metrics__the_urlconf_chooses_the_database(client: Any) -> None:
    for _ in range(2):
        PaymentJob.objects.enqueue("noop", using="other")
    PaymentJob.objects.enqueue("noop")
    samples = parse(client.get("/metrics/other/").content.decode())
    assert samples[("django_leases_jobs", (("kind", "noop"), ("status", "pending")))] == 2
    info = ("database", "other"), ("table", "django_leases_paymentjob")
    assert samples[("django_leases_queue_info", info)] == 1
    default = parse(client.get("/metrics/").content.decode())
    assert default[("django_leases_jobs", (("kind", "noop"), ("status", "pending")))] == 1
    info = ("database", "default"), ("table", "django_leases_paymentjob")
    assert default[("django_leases_queue_info", info)] == 1


def admin_url(site: str, name: str, *args: Any) -> str:
    return reverse(f"admin:django_leases_{name}", args=args, current_app=site)


@pytest.mark.urls("tests.test_databases")
def test_admin__a_site_per_database_lists_counts_edits_and_acts_on_its_queue_only(
    admin_client: Client,
) -> None:
    here = PaymentJob.objects.enqueue("noop", {"on": "default"})
    there = PaymentJob.objects.enqueue("noop", {"on": "other"}, using="other")
    run = PaymentJob.objects.enqueue("capture", using="other")
    claimed = PaymentJob.objects.using("other").claim_job(run.pk, "w-other", ttl=60)
    assert claimed is not None
    Worker.objects.using("other").create(worker_id="w-other", hostname="h", pid=1)
    assert admin_url("other_admin", "paymentjob_changelist").startswith("/other-admin/")

    def listed(site: str) -> set[int]:
        response = admin_client.get(admin_url(site, "paymentjob_changelist"))
        assert response.status_code == 200
        return {job.pk for job in response.context["cl"].result_list}

    assert (listed("admin"), listed("other_admin")) == ({here.pk}, {there.pk, run.pk})
    overview = admin_client.get(admin_url("other_admin", "paymentjob_overview")).context
    assert (overview["overview"].total.n, [w.worker_id for w, _ in overview["workers"]]) == (
        2,
        ["w-other"],
    )
    assert (
        admin_client.get(admin_url("admin", "paymentjob_overview")).context["overview"].total.n == 1
    )
    # The change form reads the job and its attempt ledger from the other database.
    page = admin_client.get(admin_url("other_admin", "paymentjob_change", run.pk))
    (ledger,) = [f for f in page.context["inline_admin_formsets"] if "attempt" in f.formset.prefix]
    assert [form.instance.owner for form in ledger.formset.forms] == ["w-other"]
    assert claimed.lease_token == ledger.formset.forms[0].instance.token
    workers = admin_client.get(admin_url("other_admin", "worker_changelist"))
    assert [w.worker_id for w in workers.context["cl"].result_list] == ["w-other"]
    attempts = admin_client.get(admin_url("other_admin", "jobattempt_changelist"))
    assert [a.job_ref for a in attempts.context["cl"].result_list] == [run.pk]
    assert f'href="/other-admin/django_leases/paymentjob/{run.pk}/change/"' in (
        attempts.content.decode()
    )
    # An edit and an action write to the other database only.
    saved = admin_client.post(
        admin_url("other_admin", "paymentjob_change", there.pk), form_data(priority="7")
    )
    assert saved.status_code == 302
    admin_client.post(
        admin_url("other_admin", "paymentjob_changelist"),
        {"action": "cancel", "_selected_action": [there.pk], "post": "yes"},
    )
    on_other = PaymentJob.objects.using("other").get(pk=there.pk)
    assert (on_other.priority, on_other.status) == (7, Status.CANCELLED)
    assert PaymentJob.objects.filter(pk=here.pk).values_list("priority", "status").get() == (
        0,
        Status.PENDING,
    )


def test_schedules__each_database_gets_one_job_per_tick(processes: Processes) -> None:
    """SCHEDULES run on every database a watcher or worker serves, each with its own record of
    the last tick: two watchers on each database enqueue one job per database, not one in all."""
    every = 10**7  # a tick boundary every 116 days; the span read below holds one when it falls
    schedules = {"SCHEDULES": {"sweep": {"kind": "noop", "every": every}}}
    env = subprocess_env(LEASES_TEST_SETTINGS=json.dumps(schedules))
    first = math.floor(time.time() / every)
    # Started a tick ago on each database (a new schedule starts at its next tick).
    with override_settings(DJANGO_LEASES=schedules):
        for database in ("default", "other"):
            assert enqueue_due(database) == []
            ScheduleState.objects.using(database).update(last_tick=F("last_tick") - 1)
    for database in ("default", "other", "default", "other"):
        proc = processes.manage("watch_stuck_jobs", "--once", "--database", database, env=env)
        out = finish(proc)
        assert proc.returncode == 0, out
    last = math.floor(time.time() / every)
    for database in ("default", "other"):
        keys = PaymentJob.objects.using(database).values_list("idempotency_key", flat=True)
        ticks = sorted(tick_of(key) for key in keys)
        # One job per tick the watchers saw: one in all, unless a tick began between two runs.
        assert ticks and ticks == list(range(ticks[0], last + 1)), (database, keys)
        assert first <= ticks[0], (database, keys)
        assert ScheduleState.objects.using(database).count() == 1


@pytest.mark.django_db(databases=["default", "local"], transaction=True)
def test_two_backends__each_connection_leases_by_its_own_dialect_and_a_worker_serves_each(
    processes: Processes,
) -> None:
    """One project, one queue on the suite's database (PostgreSQL or MariaDB in their runs) and
    one on SQLite: each connection claims, renews and completes through its own dialect, in one
    process and in a worker per database."""
    local = PaymentJob.objects.using("local")
    here = {PaymentJob.objects.enqueue("noop").pk for _ in range(3)}
    there = {PaymentJob.objects.enqueue("noop", using="local").pk for _ in range(4)}
    names = {alias: dialect_of(connections[alias]).name for alias in ("default", "local")}
    assert names == {"default": connections["default"].vendor, "local": "sqlite"}
    for jobs in (PaymentJob.objects.all(), local.all(), PaymentJob.objects.all(), local.all()):
        (job,) = jobs.claim("both", ttl=30)
        keys = {(job.pk, job.lease_token)}
        assert jobs.heartbeat("both", keys, ttl=30) == keys
        jobs.complete(job.pk, "both", job.lease_token)
    done = {"status": Status.COMPLETED}
    assert (PaymentJob.objects.filter(**done).count(), local.filter(**done).count()) == (2, 2)
    assert (JobAttempt.objects.count(), JobAttempt.objects.using("local").count()) == (2, 2)

    workers = [
        processes.manage("run_lease_worker", "--burst", "--database", alias, "--worker-id", alias)
        for alias in ("default", "local")
    ]
    for proc in workers:
        out = finish(proc)
        assert proc.returncode == 0, out
    assert set(PaymentJob.objects.filter(**done).values_list("pk", flat=True)) == here
    assert set(local.filter(**done).values_list("pk", flat=True)) == there
    assert list(Worker.objects.values_list("worker_id", flat=True)) == ["default"]
    assert list(Worker.objects.using("local").values_list("worker_id", flat=True)) == ["local"]
    ran = JobAttempt.objects.using("local").filter(outcome="completed", owner="local").count()
    assert ran == len(there) - 2


def stale(*jobs: PaymentJob) -> None:
    PaymentJob.objects.using("default").filter(pk__in=[j.pk for j in jobs]).update(
        lease_until=Now() - timedelta(seconds=5)
    )


def on_default(job: PaymentJob) -> str:
    return PaymentJob.objects.using("default").values_list("status", flat=True).get(pk=job.pk)


def nothing_on_the_replica() -> None:
    assert PaymentJob.objects.using("other").count() == 0
    assert JobAttempt.objects.using("other").count() == 0
    assert JobEvent.objects.using("other").count() == 0
    assert Worker.objects.using("other").count() == 0


@override_settings(DATABASE_ROUTERS=[ReplicaRouter()])
def test_routers__every_lease_transition_writes_where_the_routers_send_writes() -> None:
    """Under a read/write-split router every transition of `Model.objects`, its reads that
    decide the write included, runs on `db_for_write`; the replica ("other") stays empty."""
    jobs = PaymentJob.objects
    enqueued = [jobs.enqueue("noop") for _ in range(7)] + [jobs.enqueue("risky")]
    claimed = jobs.claim("w1", ttl=60, limit=8)
    assert len(claimed) == 8 and {job._state.db for job in claimed} == {"default"}
    done, failed, released, cancelled, forced, expired, marked, risky = claimed
    keys = {(job.pk, job.lease_token) for job in claimed}
    assert jobs.heartbeat("w1", keys, ttl=60) == keys
    jobs.checkpoint(risky.pk, "w1", risky.lease_token, "psp_called")
    jobs.complete(done.pk, "w1", done.lease_token)
    assert jobs.fail(failed.pk, "w1", failed.lease_token, "declined") == Status.PENDING
    jobs.release(released.pk, "w1", released.lease_token)
    assert jobs.filter(pk=cancelled.pk).cancel(by="op") == 1
    assert jobs.filter(pk=forced.pk).requeue(force=True, by="op") == 1
    stale(expired, marked, risky)
    risky.refresh_from_db(using="default")  # the checkpoint the rescue restates
    assert jobs.filter(pk=expired.pk).release_stuck(by="op") == 1
    assert jobs.filter(pk=marked.pk).mark_failed(reason="by hand", by="op") == 1
    assert jobs.rescue(risky, "review", by="watcher")
    assert jobs.filter(pk=risky.pk).resolve_review("failed", by="op") == 1
    assert jobs.filter(pk=risky.pk).requeue(by="op") == 1
    # The cancelled job's holder is running it: stopping until it acknowledges (release rule).
    assert [on_default(job) for job in enqueued] == [
        Status.COMPLETED,
        Status.PENDING,
        Status.PENDING,
        Status.STOPPING,
        Status.PENDING,
        Status.PENDING,
        Status.FAILED,
        Status.PENDING,
    ]
    assert JobAttempt.objects.using("default").count() == 8
    nothing_on_the_replica()


@override_settings(DATABASE_ROUTERS=[ReplicaRouter()])
def test_routers__the_watcher_rescues_on_the_write_database() -> None:
    job = PaymentJob.objects.enqueue("noop")
    [claimed] = PaymentJob.objects.claim("gone-worker", ttl=60)
    stale(claimed)
    [action] = StuckWatcher().run_once()
    assert action.pk == job.pk and on_default(job) == Status.PENDING
    nothing_on_the_replica()


@pytest.mark.urls("tests.test_databases")
@pytest.mark.parametrize(
    ("action", "status"),
    [
        ("cancel", Status.CANCELLED),
        ("force_cancel", Status.STOPPING),  # running: stopping until its holder returns
        ("requeue", Status.PENDING),
        ("force_requeue", Status.PENDING),
        ("release_stuck", Status.PENDING),
        ("mark_failed", Status.FAILED),
    ],
)
def test_routers__admin_actions_write_where_the_routers_send_writes(
    admin_client: Client, action: str, status: str
) -> None:
    job = PaymentJob.objects.enqueue("noop")
    if action != "cancel":
        PaymentJob.objects.claim("w1", ttl=60)
    if action in ("requeue", "release_stuck", "mark_failed"):
        stale(job)
    url = admin_url("admin", "paymentjob_changelist")
    with override_settings(DATABASE_ROUTERS=[ReplicaRouter()]):
        # The reason the dangerous actions need (force requeue, force cancel, mark failed).
        chosen = {"action": action, "_selected_action": [job.pk], "reason": "router test"}
        asked = admin_client.post(url, chosen)
        done = admin_client.post(url, {**chosen, "post": "yes"})
    assert asked.status_code in (200, 302) and done.status_code == 302
    assert on_default(job) == status
    nothing_on_the_replica()


def test_routers__a_worker_under_a_read_write_split_router_works_on_the_write_database(
    processes: Processes,
) -> None:
    jobs = [PaymentJob.objects.enqueue("noop") for _ in range(3)] + [
        PaymentJob.objects.enqueue("risky")
    ]
    env = subprocess_env(LEASES_TEST_ROUTERS="tests.routers.ReplicaRouter")
    proc = processes.manage("run_lease_worker", "--burst", env=env)
    out = finish(proc)
    assert proc.returncode == 0, out
    assert {on_default(job) for job in jobs} == {Status.COMPLETED}
    risky = JobAttempt.objects.using("default").get(job_ref=jobs[-1].pk)
    assert risky.checkpoint == "psp_called"
    nothing_on_the_replica()
