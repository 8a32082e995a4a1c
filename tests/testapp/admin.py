"""The admin of the project's own job table, as docs/own-table.md shows it."""

from django.contrib import admin

from django_leases.admin import LeasedJobAdmin

from .models import PayoutJob


@admin.register(PayoutJob)
class PayoutJobAdmin(LeasedJobAdmin):
    list_display = [*LeasedJobAdmin.list_display, "recipient"]
    readonly_fields = [*LeasedJobAdmin.readonly_fields, "recipient", "idempotency_key"]
