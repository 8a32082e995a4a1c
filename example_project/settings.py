"""Settings of the payment demo. The database is DATABASE_URL, or a SQLite file by default."""

from pathlib import Path

import environ

from example_project.dbconfig import books_database, database_from_env

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()

SECRET_KEY = env("SECRET_KEY", default="django-insecure-demo-only-never-in-production")
DEBUG = env.bool("DEBUG", default=True)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_leases",
    "example_project.payments",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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
WSGI_APPLICATION = "example_project.wsgi.application"

DATABASES = {"default": database_from_env(env, BASE_DIR / "db.sqlite3")}
# The fake PSP's books, apart from the shop's transactions (payments/routers.py).
DATABASES["psp"] = books_database(DATABASES["default"])
DATABASE_ROUTERS = ["example_project.payments.routers.PspRouter"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
if DATABASES["default"]["ENGINE"].endswith("mysql"):
    # MariaDB/MySQL build the lease indexes without their WHERE condition (status leads each
    # index, so claims still read one range); Django 6 warns about that on every command.
    SILENCED_SYSTEM_CHECKS = ["models.W037"]

USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
USE_I18N = True
STATIC_URL = "static/"

LEASE_TTL = env.float("LEASE_TTL", default=60.0)
DJANGO_LEASES = {
    "TTL": LEASE_TTL,
    "HEARTBEAT": env.float("LEASE_HEARTBEAT", default=20.0),
    # 20 s with the default TTL; the demo's short leases need a shorter one.
    "NEAR_EXPIRY": min(20.0, LEASE_TTL / 3),
    "STUCK_POLICY_BY_KIND": {"capture": "review"},
    # Heal payments the PSP captured while the shop shows them pending (payments/jobs.py). Every
    # 2 s for the demo; a shop would sweep every few minutes.
    "SCHEDULES": {
        "reconcile-sweep": {
            "kind": "reconcile_sweep",
            "every": env.float("RECONCILE_SWEEP_EVERY", default=2.0),
        }
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"django_leases": {"handlers": ["console"], "level": "INFO", "propagate": False}},
}
