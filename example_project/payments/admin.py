from django.contrib import admin

from example_project.payments.models import FakePspCall, FakePspCharge, Followup, Payment


@admin.register(Payment)
class PaymentAdmin(admin.ModelAdmin):
    list_display = ["id", "amount", "currency", "status", "psp_reference", "updated_at"]
    list_filter = ["status", "currency"]
    search_fields = ["=id", "psp_reference"]


class BooksAdmin(admin.ModelAdmin):
    """The fake PSP's books: read only, as a PSP's dashboard is."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(FakePspCharge)
class FakePspChargeAdmin(BooksAdmin):
    list_display = [
        "reference",
        "operation",
        "payment_ref",
        "amount",
        "currency",
        "outcome",
        "replays",
        "created_at",
    ]
    list_filter = ["operation", "outcome"]
    search_fields = ["=payment_ref", "idempotency_key", "reference"]


@admin.register(FakePspCall)
class FakePspCallAdmin(BooksAdmin):
    list_display = ["idempotency_key", "operation", "replayed", "metadata", "created_at"]
    list_filter = ["operation", "replayed"]
    search_fields = ["idempotency_key"]


@admin.register(Followup)
class FollowupAdmin(admin.ModelAdmin):
    list_display = ["kind", "payment", "job_ref", "payment_status", "amount", "created_at"]
    list_filter = ["kind", "payment_status"]
    search_fields = ["=payment__id", "=job_ref"]
