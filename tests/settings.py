"""Test settings: the same suite runs on SQLite, PostgreSQL or MariaDB by DATABASE_URL."""

import copy
from pathlib import Path

import django
import environ

from example_project.dbconfig import books_database, database_from_env, database_from_url

env = environ.Env()
BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "tests-only"  # noqa: S105
DEBUG = False
ALLOWED_HOSTS = ["*"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_leases",
    "tests.testapp",
    # The payment demo (`manage.py demo`), which tests/test_demo.py runs on the test database.
    "example_project.payments",
]
if django.VERSION < (6, 0):
    INSTALLED_APPS.append("django_tasks")  # the backport of Django 6's Tasks framework
TASKS = {
    "default": {
        "BACKEND": "django_leases.backends.LeaseBackend",
        "QUEUES": ["default", "emails"],
        "OPTIONS": {"MAX_ATTEMPTS": 2},
    }
}
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# SQLite tests use a file, not memory: worker subprocesses must open the same database.
# Inside this checkout (build/ is ignored by git), so two checkouts never share a test database.
_sqlite = Path(
    env("LEASES_TEST_SQLITE", default=str(BASE_DIR / "build" / "test-db" / "leases.sqlite3"))
)
_sqlite.parent.mkdir(parents=True, exist_ok=True)
DATABASES = {"default": database_from_env(env, _sqlite)}
# Worker subprocesses spawned by the tests connect to the test database by this name.
if env("LEASES_TEST_DB_NAME", default=""):
    DATABASES["default"]["NAME"] = env("LEASES_TEST_DB_NAME")
# A primary and its standby (tests/pgcluster.py): libpq's two-host form, which connects to
# whichever of them takes writes, as a project behind a failover manager would.
if env("LEASES_TEST_DB_HOSTS", default=""):
    DATABASES["default"]["HOST"] = env("LEASES_TEST_DB_HOSTS")
    DATABASES["default"]["PORT"] = env("LEASES_TEST_DB_PORTS")
    DATABASES["default"].setdefault("OPTIONS", {})["target_session_attrs"] = "read-write"
# Worker subprocesses of the connection tests run with Django's default CONN_MAX_AGE = 0.
if env("LEASES_TEST_CONN_MAX_AGE", default=""):
    DATABASES["default"]["CONN_MAX_AGE"] = env.int("LEASES_TEST_CONN_MAX_AGE")
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["default"].setdefault("TEST", {})["NAME"] = str(
        _sqlite.with_name("test_" + _sqlite.name)
    )

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
if DATABASES["default"]["ENGINE"].endswith("mysql"):
    # The database clock tests start processes whose session time zone is not UTC.
    if env("LEASES_TEST_SESSION_TZ", default=""):
        DATABASES["default"]["OPTIONS"]["init_command"] = (
            f"SET time_zone = '{env('LEASES_TEST_SESSION_TZ')}'"
        )
    # The outage tests start processes whose sessions are read-only, or whose init_command the
    # server refuses.
    if env("LEASES_TEST_INIT_COMMAND", default=""):
        DATABASES["default"]["OPTIONS"]["init_command"] = env("LEASES_TEST_INIT_COMMAND")
    # MariaDB/MySQL build the lease indexes without their WHERE condition (status leads each
    # index, so claims still read one range); Django 6 warns about that on every command.
    SILENCED_SYSTEM_CHECKS = ["models.W037"]
# A second database on the same server (SQLite: a second file), for the tests of queues on more
# than one database; created only for the tests that ask for it. Worker subprocesses reach its
# test database by LEASES_TEST_OTHER_DB_NAME.
DATABASES["other"] = copy.deepcopy(DATABASES["default"])
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["other"]["NAME"] = str(_sqlite.with_name("other_" + _sqlite.name))
    DATABASES["other"]["TEST"]["NAME"] = str(_sqlite.with_name("test_other_" + _sqlite.name))
else:
    DATABASES["other"]["NAME"] = f"{database_from_env(env, _sqlite)['NAME']}_other"
if env("LEASES_TEST_OTHER_DB_NAME", default=""):
    DATABASES["other"]["NAME"] = env("LEASES_TEST_OTHER_DB_NAME")
# A SQLite file beside whatever the suite runs on, for the tests of one project with queues on two
# backends (PostgreSQL or MariaDB and SQLite); its worker subprocesses reach it by
# LEASES_TEST_LOCAL_DB_NAME.
DATABASES["local"] = database_from_url(f"sqlite:///{_sqlite.with_name('local_' + _sqlite.name)}")
DATABASES["local"]["TEST"] = {"NAME": str(_sqlite.with_name("test_local_" + _sqlite.name))}
if env("LEASES_TEST_LOCAL_DB_NAME", default=""):
    DATABASES["local"]["NAME"] = env("LEASES_TEST_LOCAL_DB_NAME")
# The demo's fake PSP keeps its books apart (example_project/payments/routers.py): the same test
# database by a connection of its own, or on SQLite a test file of its own, which the demo's
# subprocesses reach by LEASES_TEST_PSP_DB_NAME.
DATABASES["psp"] = books_database(DATABASES["default"])
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["psp"]["TEST"] = {"NAME": str(_sqlite.with_name("test_psp_" + _sqlite.name))}
else:
    DATABASES["psp"]["TEST"] = {"MIRROR": "default"}
if env("LEASES_TEST_PSP_DB_NAME", default=""):
    DATABASES["psp"]["NAME"] = env("LEASES_TEST_PSP_DB_NAME")
# Worker subprocesses of the router tests get their routers through the environment.
DATABASE_ROUTERS = [
    "example_project.payments.routers.PspRouter",
    *env.list("LEASES_TEST_ROUTERS", default=[]),
]
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Worker and watcher subprocesses of a test get its settings through the environment.
DJANGO_LEASES: dict[str, object] = env.json("LEASES_TEST_SETTINGS", default={})
# Worker subprocesses of the tracing tests write their spans to this file, one JSON a line.
if env("LEASES_TEST_SPANS_FILE", default=""):
    from tests.spans import export_to_file

    export_to_file(env("LEASES_TEST_SPANS_FILE"))
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_leases": {"handlers": ["console"], "level": "INFO", "propagate": False}},
}
