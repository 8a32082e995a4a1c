"""Paused kinds: pause a kind (the add form), resume it (an action), and their audit (kind
events), each pause or resume through the queryset's `pause_kind()` / `resume_kind()`, behind
the `django_leases.pause_kind` permission."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from django_leases.admin.display import stamped
from django_leases.admin.mixins import DatabaseMixin, OfferedFiltersMixin, ReadOnlyMixin
from django_leases.handlers import registered_kinds
from django_leases.models import KindEvent, PausedKind
from django_leases.querysets import LeaseQuerySet
from django_leases.querysets.pauses import REASON_LENGTH
from django_leases.tables import leased_jobs

PERMISSION = "django_leases.pause_kind"


class PauseForm(forms.ModelForm):
    """The kind to pause, among the registered ones, and why."""

    kind = forms.ChoiceField(label=_("kind"), choices=())
    reason = forms.CharField(
        label=_("reason"), required=False, max_length=REASON_LENGTH, widget=forms.Textarea
    )

    class Meta:
        model = PausedKind
        fields = ("kind", "reason")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["kind"].choices = [(kind, kind) for kind in registered_kinds()]  # type: ignore[attr-defined]


@admin.register(PausedKind)
class PausedKindAdmin(DatabaseMixin, OfferedFiltersMixin, admin.ModelAdmin):
    """The kinds paused now: "Add" pauses one, the action resumes the selected ones."""

    form = PauseForm
    list_display = ("kind", stamped(PausedKind, "paused_at"), "paused_by", "reason", "job_model")
    actions = ["resume"]

    def jobs(self) -> LeaseQuerySet[Any]:
        return leased_jobs(None, self.using)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSION)

    def has_pause_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(PERMISSION)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return super().has_view_permission(request, obj) or request.user.has_perm(PERMISSION)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # resuming is the action below: it records who and why

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        kind, reason = form.cleaned_data["kind"], form.cleaned_data["reason"]
        if not self.jobs().pause_kind(kind, by=request.user.get_username(), reason=reason):
            self.message_user(
                request, gettext("Kind %(kind)s was paused already.") % {"kind": kind}
            )
        # The admin's success message and the change list read the row the pause wrote.
        written = PausedKind.objects.using(self.jobs().db).filter(
            job_model=self.jobs().model._meta.label_lower, kind=kind
        )
        obj.pk = written.values_list("pk", flat=True).first()

    def log_addition(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None  # the pause is recorded as a kind event, with its reason

    @admin.action(description=_("Resume the selected kinds"), permissions=["pause"])
    def resume(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        jobs = self.jobs()
        by = request.user.get_username()
        label = jobs.model._meta.label_lower
        kinds = [row.kind for row in queryset if row.job_model == label]
        resumed = sum(jobs.resume_kind(kind, by=by) for kind in kinds if kind in registered_kinds())
        self.message_user(
            request,
            ngettext("%(count)d kind resumed.", "%(count)d kinds resumed.", resumed)
            % {"count": resumed},
            messages.SUCCESS,
        )


@admin.register(KindEvent)
class KindEventAdmin(DatabaseMixin, OfferedFiltersMixin, ReadOnlyMixin, admin.ModelAdmin):
    """Every pause and resume of a kind: who, when, why. Append-only."""

    list_display = (stamped(KindEvent, "at"), "kind", "action", "by", "reason", "job_model")
    list_filter = ("action", "kind")
    search_fields = ("kind", "by")
