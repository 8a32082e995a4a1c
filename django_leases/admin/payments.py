"""The admin of `PaymentJob`: the job admin with its payment fields, found by payment id, and
each payment's timeline (`timeline/?payment_id=...`)."""

from __future__ import annotations

from typing import Any, cast

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.translation import gettext_lazy as _

from django_leases.admin.dependencies import DEPENDENCY_FIELDS
from django_leases.admin.display import EMPTY, stamp
from django_leases.admin.jobs import LEASE_FIELDS, LeasedJobAdmin
from django_leases.models import PaymentJob
from django_leases.querysets import LeaseQuerySet
from django_leases.timeline import payment_timeline


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
        "timeline_link",
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
                    ("payment_id", "timeline_link"),
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

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        timeline = path(
            "timeline/",
            self.admin_site.admin_view(self.timeline_view),
            name="{}_{}_timeline".format(*info),
        )
        return [timeline, *super().get_urls()]

    @admin.display(description=_("timeline"))
    def timeline_link(self, job: PaymentJob) -> str:
        if not job.payment_id:
            return EMPTY
        url = reverse("admin:django_leases_paymentjob_timeline", current_app=self.admin_site.name)
        query = urlencode({"payment_id": job.payment_id})
        return format_html('<a href="{}?{}">{}</a>', url, query, _("every job of this payment"))

    def timeline_view(self, request: HttpRequest) -> HttpResponse:
        """Every job of one payment, its attempts, heartbeats, steps and operator events on one
        time axis (`timeline.payment_timeline()`), to the second."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        payment_id = request.GET.get("payment_id", "").strip()
        found = payment_timeline(self.all_rows(), payment_id) if payment_id else None
        rows = (
            []
            if found is None
            else [{"entry": entry, "at": stamp(entry.at, found.now)} for entry in found.entries]
        )
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Payment timeline"),
            "payment_id": payment_id,
            "timeline": found if found and found.jobs else None,
            "rows": rows,
        }
        return TemplateResponse(request, "admin/django_leases/timeline.html", context)
