"""The settings object: defaults, user values, unknown names, reload on change."""

from datetime import timedelta

import pytest
from django.test import override_settings

from django_leases.conf import DEFAULTS, leases_settings, to_seconds
from django_leases.exceptions import InvalidDuration


def test_leases_settings__defaults() -> None:
    assert leases_settings.TTL == DEFAULTS["TTL"] == 60.0
    assert leases_settings.HEARTBEAT == 20.0
    assert leases_settings.NEAR_EXPIRY == 20.0


def test_leases_settings__user_values_and_reload() -> None:
    with override_settings(DJANGO_LEASES={"TTL": 12}):
        assert leases_settings.TTL == 12
        assert leases_settings.HEARTBEAT == 20.0
    assert leases_settings.TTL == 60.0


def test_leases_settings__unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="Unknown django-leases setting 'TLL'"):
        _ = leases_settings.TLL


def test_leases_settings__stuck_policy_per_kind() -> None:
    with override_settings(DJANGO_LEASES={"STUCK_POLICY_BY_KIND": {"capture": "review"}}):
        assert leases_settings.stuck_policy("capture") == "review"
        assert leases_settings.stuck_policy("webhook") == "retry"


@pytest.mark.parametrize(
    ("value", "seconds"), [(5, 5.0), (0.25, 0.25), (timedelta(minutes=2), 120.0)]
)
def test_to_seconds__accepts_numbers_and_timedeltas(value: object, seconds: float) -> None:
    assert to_seconds(value) == seconds  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -1, "5", None, True, timedelta(0), float("nan")])
def test_to_seconds__rejects_everything_else(value: object) -> None:
    with pytest.raises(InvalidDuration, match="ttl"):
        to_seconds(value, "ttl")  # type: ignore[arg-type]
