"""Django settings of the benchmarks: the example project, plus each peer queue that is installed.

Every system runs with DEBUG off (no query log) and logging at WARNING, so none of them pays for
per-job log lines that the others do not write.
"""

import os
from importlib.util import find_spec

from example_project.settings import *  # noqa: F403
from example_project.settings import DATABASES, DJANGO_LEASES
from example_project.settings import INSTALLED_APPS as BASE_APPS

DEBUG = False
WORKERS = int(os.environ.get("BENCH_WORKERS", "4"))

# Worker loops call close_old_connections() each round (run_lease_worker, db_worker, django-q2),
# which with Django's default CONN_MAX_AGE = 0 means a new connection per round. Long-running
# workers are deployed with persistent connections, so that is the default here; the
# BENCH_CONN_MAX_AGE environment variable ("none" = forever, or seconds) changes it.
_max_age = os.environ.get("BENCH_CONN_MAX_AGE", "none")
DATABASES["default"]["CONN_MAX_AGE"] = None if _max_age.lower() == "none" else int(_max_age)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True

# Prepared statements (PostgreSQL with psycopg 3): Django leaves them off unless OPTIONS has a
# "prepare_threshold"; BENCH_PREPARE_THRESHOLD (executions of a statement before psycopg
# prepares it, e.g. 5) sets it for every Django-based system alike.
if os.environ.get("BENCH_PREPARE_THRESHOLD") and DATABASES["default"]["ENGINE"].endswith(
    "postgresql"
):
    DATABASES["default"].setdefault("OPTIONS", {})["prepare_threshold"] = int(
        os.environ["BENCH_PREPARE_THRESHOLD"]
    )

# LISTEN/NOTIFY wake-ups of idle workers (PostgreSQL only); BENCH_USE_NOTIFY=0 switches them
# off, so workers find new jobs by polling alone (wakeup_latency.py compares the two).
DJANGO_LEASES = {**DJANGO_LEASES, "USE_NOTIFY": os.environ.get("BENCH_USE_NOTIFY", "1") != "0"}

# Completions of an ack="batch" kind a worker writes in one statement (throughput.py's --batch
# for its django-leases-batch system); unset: the library's default.
if "BENCH_ACK_BATCH" in os.environ:
    DJANGO_LEASES["ACK_BATCH_SIZE"] = int(os.environ["BENCH_ACK_BATCH"])

# OpenTelemetry tracing (with the otel extra installed); BENCH_TRACING=0 switches it off, for
# the before/after measurements of docs/observability.md. Unset: the library's default.
if "BENCH_TRACING" in os.environ:
    DJANGO_LEASES["TRACING"] = os.environ["BENCH_TRACING"] != "0"

# App -> the modules that must be importable for it to be installed. The peers are compared on
# PostgreSQL only (procrastinate's migrations need it), so they are left out on other databases.
# The django-tasks database backend needs the django_tasks backport on Django 5.2 only (Django 6
# has the Tasks framework in core).
ON_POSTGRESQL = DATABASES["default"]["ENGINE"].endswith("postgresql")
PEER_APPS = {
    "procrastinate.contrib.django": ("procrastinate",),
    "django_q": ("django_q",),
    "django_tasks": ("django_tasks", "django_tasks_db"),
    "django_tasks_db": ("django_tasks_db",),
}
# A worker process loads only its own system's app (throughput.py sets BENCH_PEERS to it, or to
# nothing for django-leases): importing every peer cost each Django worker ~0.18 s of start-up
# CPU on this machine, a share of a short drain that no deployment would pay. Unset (migrations,
# enqueues): every peer that is importable.
_PEERS = os.environ.get("BENCH_PEERS")
INSTALLED_APPS = [
    *BASE_APPS,
    *(
        app
        for app, modules in PEER_APPS.items()
        if ON_POSTGRESQL
        and all(find_spec(module) for module in modules)
        and (_PEERS is None or app in _PEERS.split(","))
    ),
    "bench",
]

if "django_tasks_db" in INSTALLED_APPS:
    TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}

# django-q2 with its ORM broker: one cluster of WORKERS worker processes. save_limit=0 keeps
# every success row (the drain is measured on them) instead of pruning to the last 250.
Q_CLUSTER = {
    "name": "bench",
    "orm": "default",
    "workers": WORKERS,
    "save_limit": 0,
    "timeout": 60,
    "retry": 120,
    "log_level": "WARNING",
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
}
