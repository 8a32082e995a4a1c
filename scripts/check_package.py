"""The Python half of scripts/check-package: inspect the built files, and drive a throwaway project.

    check_package.py dist DIST_DIR            the sdist, the wheel and their metadata
    check_package.py project DIR MODE [URL]   add django_leases and a `shop` app to a new project
    check_package.py enqueue DIR              enqueue a job (and a task) in that project
    check_package.py verify DIR               the worker ran them; the admin pages answer

MODE is `tasks` (a LeaseBackend in TASKS, with the backport on Django 5.2), `no-backport` (the
same TASKS on Django 5.2 without the backport) or `plain` (no TASKS). Every failure raises
SystemExit with a line that says what is wrong.
"""

import email.parser
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HOME = "https://github.com/django-leases/django-leases"
# Tracked files the sdist leaves out on purpose (see MANIFEST.in); anything else tracked must be in.
NOT_IN_SDIST = (".ci/", "bench/", "scripts/", "requirements/", ".gitignore", ".pre-commit-config")
STATE = "check_package.json"  # what `enqueue` left for `verify`, in the project directory


def fail(message: str) -> None:
    raise SystemExit(f"check-package: FAILED: {message}")


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def check_dist(dist: Path) -> None:
    """Check the sdist's and the wheel's files and the metadata the index will show."""
    import trove_classifiers  # in the tools virtualenv only

    (sdist,) = dist.glob("*.tar.gz")
    (wheel,) = dist.glob("*.whl")
    files = tracked()

    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        shipped = {
            name.removeprefix(f"{top}/") for name in tar.getnames() if tar.getmember(name).isfile()
        }
    generated = {"PKG-INFO", "setup.cfg"} | {n for n in shipped if ".egg-info/" in n}
    expected = {f for f in files if not f.startswith(NOT_IN_SDIST)}
    if shipped - generated != expected:
        fail(
            f"the sdist differs from the tracked files: missing {sorted(expected - shipped)}, "
            f"extra {sorted(shipped - generated - expected)} (edit MANIFEST.in or NOT_IN_SDIST)"
        )

    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        (info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        metadata = email.parser.Parser().parsestr(whl.read(f"{info}/METADATA").decode())
    package = {f for f in files if f.startswith("django_leases/")}
    installed = {n for n in names if not n.startswith(f"{info}/")}
    if installed != package:
        fail(f"the wheel differs from git's django_leases/: {sorted(package ^ installed)}")
    if f"{info}/licenses/LICENSE" not in names:
        fail("the wheel has no license text")

    if metadata["License-Expression"] != "MIT" or metadata.get_all("License-File") != ["LICENSE"]:
        fail("the metadata lacks License-Expression: MIT and License-File: LICENSE")
    if metadata["License"] is not None:
        fail("the metadata still carries the deprecated License field")
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL") or [])
    for label in ("Homepage", "Documentation", "Changelog", "Issues"):
        if not urls.get(label, "").startswith(HOME):
            fail(f"no Project-URL {label} under {HOME}")
    unknown = set(metadata.get_all("Classifier") or []) - trove_classifiers.classifiers
    if unknown:
        fail(f"classifiers the index would refuse: {sorted(unknown)}")
    if 'django-tasks>=0.8; extra == "tasks"' not in (metadata.get_all("Requires-Dist") or []):
        fail("the tasks extra must install django-tasks whatever the Python version")
    check_description(metadata.get_payload(), files)
    print(f"check-package: {sdist.name} and {wheel.name}: files and metadata OK")


def check_description(text: str, files: set[str]) -> None:
    """Every link of the index page is absolute and, when it points into the repository, exists."""
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if not target.startswith("https://"):
            fail(f"the description links {target!r}, which the index cannot resolve")
        path = target.removeprefix(f"{HOME}/blob/main/").split("#")[0]
        if target.startswith(f"{HOME}/blob/main/") and path not in files:
            fail(f"the description links {path}, which is not in the repository")


def description_commands() -> list[str]:
    """Return the management commands the index page tells a user to run."""
    text = (ROOT / "DESCRIPTION.md").read_text()
    return sorted(set(re.findall(r"^python manage\.py (\w+)", text, flags=re.M)))


SETTINGS = """
# Added by scripts/check-package.
INSTALLED_APPS += ["django_leases", "shop"] + EXTRA_APPS
ALLOWED_HOSTS = ["testserver"]
DJANGO_LEASES = {"TTL": 30, "HEARTBEAT": 5, "POLL_INTERVAL": 0.1}
"""
TASKS_SETTINGS = """
TASKS = {"default": {"BACKEND": "django_leases.backends.LeaseBackend", "QUEUES": ["default"]}}
"""
JOBS = """
from django_leases import job_handler


@job_handler("capture")
def capture(job, lease):
    lease.checkpoint("psp_called")
    lease.complete(result={"captured": job.payment_id})
"""
TASKS = """
import django

if django.VERSION >= (6, 0):
    from django.tasks import task
else:
    from django_tasks import task


@task()
def add(a, b):
    return a + b
"""


def write_project(project: Path, mode: str, database_url: str) -> None:
    """Add django_leases, a `shop` app with a handler and a task, and the database, to settings."""
    import django

    backport = mode == "tasks" and django.VERSION < (6, 0)
    settings = project / "smoke" / "settings.py"
    text = settings.read_text() + f"EXTRA_APPS = {['django_tasks'] if backport else []!r}\n"
    text += SETTINGS + (TASKS_SETTINGS if mode != "plain" else "")
    if database_url:
        text += f"DATABASES = {{'default': {database_config(database_url)!r}}}\n"
    else:
        # As check W003 asks of SQLite (Django 5.1+): writers take the lock when they begin.
        text += 'DATABASES["default"]["OPTIONS"] = {"transaction_mode": "IMMEDIATE"}\n'
    settings.write_text(text)
    (project / "shop" / "jobs.py").write_text(JOBS)
    if mode == "tasks":
        (project / "shop" / "tasks.py").write_text(TASKS)


def database_config(url: str) -> dict[str, Any]:
    """Return a PostgreSQL DATABASES entry for `url`, creating the database if it is missing."""
    import psycopg
    from psycopg import sql

    match = re.fullmatch(r"postgres(?:ql)?://(\w+)@([\w.]+):(\d+)/(\w+)", url)
    if match is None:
        fail(f"PACKAGE_CHECK_DATABASE_URL must be postgres://user@host:port/name, got {url!r}")
        raise AssertionError  # unreachable: fail() raises
    user, host, port, name = match.groups()
    with psycopg.connect(f"host={host} port={port} user={user} dbname=postgres") as conn:
        conn.autocommit = True
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": user,
        "HOST": host,
        "PORT": port,
    }


def setup(project: Path) -> None:
    import django

    sys.path.insert(0, str(project))
    os.environ["DJANGO_SETTINGS_MODULE"] = "smoke.settings"
    django.setup()


def enqueue(project: Path) -> None:
    """Enqueue one job, and one task where the project has tasks; remember their ids."""
    setup(project)
    from django_leases.models import PaymentJob

    job = PaymentJob.objects.enqueue(
        "capture", payment_id="42", idempotency_key=f"cap-{os.getpid()}"
    )
    state = {"job": job.pk, "task": None}
    if (project / "shop" / "tasks.py").exists():
        from shop.tasks import add  # type: ignore[import-not-found]

        state["task"] = add.enqueue(2, 3).id
    (project / STATE).write_text(json.dumps(state))


def verify(project: Path) -> None:
    """Check what the worker wrote, and the admin pages through Django's test client."""
    setup(project)
    from django.contrib.auth import get_user_model
    from django.test import Client

    from django_leases.models import JobAttempt, PaymentJob

    state = json.loads((project / STATE).read_text())
    job = PaymentJob.objects.get(pk=state["job"])
    outcomes = list(JobAttempt.objects.filter(job_ref=job.pk).values_list("outcome", flat=True))
    if (job.status, job.result, outcomes) != ("completed", {"captured": "42"}, ["completed"]):
        fail(f"the job did not complete: {job.status} {job.result!r} {outcomes}")
    if state["task"] is not None:
        from shop.tasks import add

        result = add.get_backend().get_result(state["task"])
        if (result.status, result.return_value) != ("SUCCESSFUL", 5):
            fail(f"the task did not run: {result.status} {result.return_value!r}")

    user, _ = get_user_model().objects.get_or_create(username="check-package", is_superuser=True)
    user.is_staff = True
    user.save()
    client = Client()
    client.force_login(user)
    pages = {
        "/admin/": "Leased jobs",
        "/admin/django_leases/paymentjob/": "Stuck (lease expired)",
        "/admin/django_leases/paymentjob/overview/": "Queue overview",
        f"/admin/django_leases/paymentjob/{job.pk}/change/": "psp_called",
        "/admin/django_leases/jobattempt/": "check-package",
    }
    for url, text in pages.items():
        response = client.get(url)
        if response.status_code != 200 or text not in response.content.decode():
            fail(f"admin page {url}: status {response.status_code}, {text!r} not on the page")
    print(f"check-package: job {job.pk} completed, task {state['task']}, {len(pages)} admin pages")


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "dist":
        check_dist(Path(args[0]))
    elif command == "commands":
        print(" ".join(description_commands()))
    elif command == "project":
        write_project(Path(args[0]), args[1], args[2] if len(args) > 2 else "")
    elif command == "enqueue":
        enqueue(Path(args[0]))
    elif command == "verify":
        verify(Path(args[0]))
    else:
        fail(f"unknown command {command!r}")
