"""A job's dependencies on its change page: the jobs it waits for and the jobs waiting on it,
each with its status, and why a dependent is held (a prerequisite failed or was cancelled);
its group (`enqueue_group()`): a callback's members and how each ended, a member's callback."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from django_leases.admin.display import EMPTY
from django_leases.querysets.groups import ended_members
from django_leases.status import CANCELLED, FAILED, WAITING, JobStatus

DEPENDENCY_FIELDS = ("waits_for_jobs", "waited_on_by", "group")
"""The readonly fields of `DependenciesMixin`, for a job admin's `readonly_fields`."""

HOLDING = (FAILED, CANCELLED)
"""A prerequisite's statuses that hold its dependents until an operator acts."""


class DependenciesMixin:
    """`waits_for_jobs`, `waited_on_by` and `group` for a `LeasedJobAdmin`'s readonly fields."""

    admin_site: admin.AdminSite
    opts: Any

    @admin.display(description=_("waits for"))
    def waits_for_jobs(self, job: Any) -> str:
        """The jobs this one was enqueued after; while it waits, what holds it."""
        if job.group_results is not None:
            return EMPTY  # a group's callback: its members are under "group"
        statuses = self._statuses(job, job.waits_for)
        if not statuses:
            return EMPTY
        listed = self._links(statuses)
        held = [pk for pk, status in statuses.items() if status in HOLDING]
        if job.status == WAITING and held:
            note = gettext(
                "held: a prerequisite failed or was cancelled; requeue it (it then releases "
                "this job when it completes) or cancel this job"
            )
            return format_html('{}<br><span class="dl-badge dl-waiting">{}</span>', listed, note)
        if job.status == WAITING and job.unmet:
            left = gettext("waiting for %(n)d of them") % {"n": job.unmet}
            return format_html('{}<br><span class="dl-badge dl-waiting">{}</span>', listed, left)
        return listed

    @admin.display(description=_("waited on by"))
    def waited_on_by(self, job: Any) -> str:
        """The jobs enqueued after this one: released when it completes."""
        return self._links(self._statuses(job, job.dependents)) or EMPTY

    @admin.display(description=_("group"))
    def group(self, job: Any) -> str:
        """A callback's members, each as it ended (as written on the callback), and how many it
        waits for; a member's callbacks, with their status."""
        if job.group_results is not None:
            ended = {member.pk: member for member in ended_members(job)}
            listed = self._links(self._statuses(job, job.waits_for))
            lines = format_html_join(
                "",
                "<br>#{}: {} {}",
                ((pk, JobStatus(m.status).label, m.last_error[:200]) for pk, m in ended.items()),
            )
            note = gettext("callback of %(n)d members, %(left)d not ended") % {
                "n": len(job.waits_for),
                "left": job.unmet,
            }
            return format_html('{}<br><span class="dl-badge">{}</span>{}', listed, note, lines)
        callbacks = (
            type(job)
            ._default_manager.using(job._state.db)
            .filter(pk__in=job.dependents or [], group_results__isnull=False)
        )
        found = dict(callbacks.values_list("pk", "status"))
        if not found:
            return EMPTY
        return format_html("{} {}", gettext("member of the group of"), self._links(found))

    def _statuses(self, job: Any, pks: list[int] | None) -> dict[int, str]:
        if not pks:
            return {}
        rows = type(job)._default_manager.using(job._state.db).filter(pk__in=pks)
        found = dict(rows.values_list("pk", "status"))
        return {pk: found.get(pk, "") for pk in pks}

    def _links(self, statuses: dict[int, str]) -> str:
        name = f"admin:{self.opts.app_label}_{self.opts.model_name}_change"
        return format_html_join(
            ", ",
            '<a href="{}">#{}</a> ({})',
            (
                (
                    reverse(name, args=[pk], current_app=self.admin_site.name),
                    pk,
                    JobStatus(status).label if status else gettext("pruned"),
                )
                for pk, status in statuses.items()
            ),
        )
