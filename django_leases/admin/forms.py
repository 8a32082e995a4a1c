"""The change form of a pending job: the bounds of `enqueue()`, the same on every database, and
no input that the page cannot answer with a form error."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.forms.fields import InvalidJSONInput
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_leases.conf import leases_settings
from django_leases.exceptions import InvalidArgument, InvalidPayload
from django_leases.limits import (
    JSON_INT,
    MAX_ERROR_LENGTH,
    MAX_JSON_DEPTH,
    PRIORITY,
    check_int,
    check_json,
    check_json_size,
)


class PayloadField(forms.JSONField):
    """A payload as JSON text: empty (or `null`) is `{}`, as `enqueue(payload=None)` stores it;
    text that cannot be parsed is a form error; a page re-rendered shows the text as posted."""

    def __init__(self, **kwargs: Any) -> None:
        # The model field's callable default would render the initial value in a hidden input
        # and compare the edit with what that input posts back, not with the job: a request
        # without it would have a cleared payload taken for unchanged. There is no add form;
        # the initial value is the job's.
        kwargs["show_hidden_initial"] = False
        super().__init__(**kwargs)

    def to_python(self, value: Any) -> Any:
        try:
            payload = super().to_python(value)
        except RecursionError:
            # json.loads() recurses once per level: far past MAX_JSON_DEPTH, it cannot answer.
            raise ValidationError(
                gettext("The payload is nested deeper than %(depth)d levels.")
                % {"depth": MAX_JSON_DEPTH},
                code="invalid",
            ) from None
        except ValidationError:
            raise
        except ValueError:
            # An integer of thousands of digits: Python refuses to convert it (and it would be
            # out of range anyway).
            raise ValidationError(
                gettext("The payload has an integer outside %(low)d to %(high)d.")
                % {"low": JSON_INT[0], "high": JSON_INT[1]},
                code="invalid",
            ) from None
        return {} if payload is None else payload

    def bound_data(self, data: Any, initial: Any) -> Any:
        if self.disabled or data is None:
            return super().bound_data(data, initial)
        # As posted: parsed and dumped again, a lone surrogate escape would become a character
        # that no page can encode, and a deep nesting would fail again.
        return InvalidJSONInput(data)

    def prepare_value(self, value: Any) -> Any:
        text = super().prepare_value(value)
        if isinstance(text, InvalidJSONInput):
            return text
        try:
            text.encode()
        except UnicodeEncodeError:
            # A lone surrogate in a row written around enqueue(): shown as its JSON escape.
            return json.dumps(value, cls=self.encoder)
        return text


class LeasedJobForm(forms.ModelForm):
    """The change form: the bounds of `enqueue()`, the same on every database (SQLite would
    store a priority PostgreSQL refuses), and why the operator edits (required for a payload)."""

    reason = forms.CharField(
        label=_("reason"),
        required=False,
        max_length=MAX_ERROR_LENGTH,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text=_("Kept in the job's operator events and history; required to edit a payload."),
    )

    class Meta:
        field_classes = {"payload": PayloadField}

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        if "payload" in self.changed_data and not cleaned.get("reason", "").strip():
            self.add_error("reason", gettext("Say why the payload is changed."))
        return cleaned

    def clean_payload(self) -> Any:
        payload = self.cleaned_data["payload"]
        try:
            check_json(payload, "payload")
            check_json_size(payload, "payload", leases_settings.MAX_PAYLOAD_BYTES)
        except InvalidPayload as exc:
            raise ValidationError(str(exc)) from None
        return payload

    def clean_priority(self) -> Any:
        priority = self.cleaned_data["priority"]
        try:
            check_int(priority, "priority", PRIORITY)
        except InvalidArgument as exc:
            raise ValidationError(str(exc)) from None
        return priority
