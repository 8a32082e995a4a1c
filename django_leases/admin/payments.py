"""The admin of `PaymentJob`: the job admin with its payment fields, found by payment id."""

from __future__ import annotations

from typing import Any, cast

from django.contrib import admin
from django.db.models import QuerySet
from django.utils.translation import gettext_lazy as _

from django_leases.admin.dependencies import DEPENDENCY_FIELDS
from django_leases.admin.jobs import LEASE_FIELDS, LeasedJobAdmin
from django_leases.models import PaymentJob
from django_leases.querysets import LeaseQuerySet


@admin.register(PaymentJob)
class PaymentJobAdmin(LeasedJobAdmin):
    list_display = [
        "id",
        "status_badge",
        "lease",
        "running_for",
        "kind",
        "payment_id",
        "lock_state",
        "owner",
        "attempts_of_max",
        "heartbeat",
        "last_error_short",
    ]
    search_help_text = _(
        "An exact payment id or idempotency key, or the start of the owner of a processing job."
    )
    search_fields = ("payment_id",)  # shows the search box; search() does the search
    readonly_fields = [
        "kind",
        "payment_id",
        "idempotency_key",
        "lock",
        "lock_position",
        *LEASE_FIELDS,
        "lease",
        "heartbeat",
        *DEPENDENCY_FIELDS,
    ]
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "kind",
                    "payment_id",
                    "idempotency_key",
                    ("lock", "lock_position"),
                    "priority",
                    "payload",
                )
            },
        ),
        *LeasedJobAdmin.fieldsets[1:],
    )

    def search(self, queryset: QuerySet[Any], term: str) -> QuerySet[Any]:
        jobs = cast(LeaseQuerySet[Any], queryset)
        # Three index probes ORed together: the payment id and idempotency key indexes, and the
        # processing-only lease index for the owner. A job that no longer holds a lease is found
        # by its owner in the attempt ledger.
        found = jobs.filter(payment_id=term) | jobs.filter(idempotency_key=term)
        return found | jobs.processing().filter(lease_owner__startswith=term)
