from django.contrib import admin

from example_project.payments.models import FakePspCharge, Payment


@admin.register(Payment)
class PaymentAdmin(admin.ModelAdmin):
    list_display = ["id", "amount", "currency", "status", "psp_reference", "updated_at"]
    list_filter = ["status", "currency"]
    search_fields = ["=id", "psp_reference"]


@admin.register(FakePspCharge)
class FakePspChargeAdmin(admin.ModelAdmin):
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

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
