"""System checks for DJANGO_LEASES: each bad value is reported with a stable id."""

import sys

import django
import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test import override_settings

from django_leases.checks import check_settings, check_tasks_framework


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


@pytest.mark.parametrize("value", [0, -5, "60", None, True, float("nan"), float("inf")])
def test_check_settings__non_positive_or_non_numeric_duration(value: object) -> None:
    assert "django_leases.E002" in ids(TTL=value)


def test_check_settings__heartbeat_not_shorter_than_ttl() -> None:
    assert ids(TTL=30, HEARTBEAT=30) == ["django_leases.E003"]
    assert "django_leases.E003" in ids(TTL=30, HEARTBEAT=45.5)
    assert ids(TTL=30, HEARTBEAT=10, NEAR_EXPIRY=10) == []


def test_check_settings__near_expiry_not_shorter_than_ttl_warns() -> None:
    assert ids(TTL=30, HEARTBEAT=10, NEAR_EXPIRY=30) == ["django_leases.W002"]


@pytest.mark.parametrize("value", [0, 2.5, "4", True])
def test_check_settings__counts_must_be_whole_and_positive(value: object) -> None:
    assert ids(CONCURRENCY=value) == ["django_leases.E004"]


def test_check_settings__policies() -> None:
    assert ids(STUCK_POLICY="ignore") == ["django_leases.E005"]
    assert ids(STUCK_POLICY_BY_KIND={"capture": "maybe"}) == ["django_leases.E006"]
    assert ids(STUCK_POLICY_BY_KIND=["capture"]) == ["django_leases.E006"]
    assert ids(STUCK_POLICY_BY_KIND={"capture": "review"}) == []


def test_check_settings__retention_backoff_and_booleans() -> None:
    assert ids(RETENTION={"done": 5}) == ["django_leases.E007"]
    assert ids(RETENTION={"completed": -1}) == ["django_leases.E007"]
    assert ids(BACKOFF_BASE=10, BACKOFF_MAX=5) == ["django_leases.E008"]
    assert ids(USE_NOTIFY="yes") == ["django_leases.E009"]


def test_check_settings__messages_carry_hints() -> None:
    with override_settings(DJANGO_LEASES={"TTL": -1}):
        (message,) = check_settings()
    assert "TTL" in message.msg and "-1" in message.msg and message.hint


@pytest.mark.django_db  # Django 6's model checks ask SQLite about its JSON support
@override_settings(DJANGO_LEASES={"TTL": 10, "HEARTBEAT": 20})
def test_check_settings__manage_py_check_fails_on_errors() -> None:
    with pytest.raises(SystemCheckError, match="django_leases.E003"):
        call_command("check")


def test_check_settings__worker_gone_after_needs_two_heartbeats() -> None:
    assert ids(HEARTBEAT=20, WORKER_GONE_AFTER=30) == ["django_leases.E010"]
    assert ids(HEARTBEAT=20, WORKER_GONE_AFTER=40) == []


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
