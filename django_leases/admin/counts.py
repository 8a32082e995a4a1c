"""Counts the admin shows without reading the whole table: exact up to
`DJANGO_LEASES["ADMIN_EXACT_COUNT_LIMIT"]`, estimated or "more than" beyond it, and labelled so."""

from __future__ import annotations

from functools import cached_property
from typing import Any, cast

from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.utils.formats import number_format
from django.utils.html import format_html
from django.utils.translation import gettext, ngettext

from django_leases import stats
from django_leases.querysets import LeaseQuerySet


def tally_text(tally: stats.Tally) -> str:
    """Return `tally` as text: an exact count as it is; an estimate as "≈ 1,200,000" (two
    significant digits), a lower bound as "more than 10,000"."""
    if tally.how == stats.EXACT:
        return str(tally.n)
    if tally.how == stats.ESTIMATED:
        rounded = round(tally.n, 2 - len(str(tally.n)))
        return "≈ " + number_format(rounded, force_grouping=True)
    return gettext("more than %(n)s") % {"n": number_format(tally.n, force_grouping=True)}


def tally_html(tally: stats.Tally) -> str:
    """Return `tally` as the admin shows it: `tally_text()`, with a tooltip saying where a count
    that is not exact comes from."""
    if tally.how == stats.EXACT:
        return str(tally.n)
    if tally.how == stats.ESTIMATED:
        title = gettext("estimated from the database's statistics")
    else:
        title = gettext("counting stops there, so that the page stays fast")
    return format_html('<span class="dl-approx" title="{}">{}</span>', title, tally_text(tally))


class CountingPaginator(Paginator):
    """Count the list up to `limit`: beyond it, the whole table is the database's estimate
    (`estimated_count()`), a filtered list "more than `limit`", so no page counts the table."""

    def __init__(self, object_list: Any, per_page: int, *args: Any, limit: int) -> None:
        super().__init__(object_list, per_page, *args)
        self.limit = limit

    @cached_property
    def tally(self) -> stats.Tally:
        jobs = cast(LeaseQuerySet[Any], self.object_list)
        # Only an unfiltered list is the table the statistics describe.
        estimate = None if jobs.query.has_filters() else jobs.estimated_count
        return stats.tally(jobs, self.limit, estimate)

    @cached_property
    def count(self) -> int:
        # One row past the limit: enough pages to page on, never a page of unknown size.
        return self.tally.n + (self.tally.how == stats.MORE_THAN)


class CountingChangeList(ChangeList):
    """The changelist of a `CountingPaginator`."""

    paginator: CountingPaginator

    @property
    def labelled(self) -> LabelledCount:
        """This changelist, its count labelled: for Django's own templates (pagination,
        actions)."""
        return LabelledCount(self)

    def selection_note_all(self) -> str | None:
        """The actions' "All N selected", its count labelled; None when the count is exact
        (Django's own then stands)."""
        tally = self.paginator.tally
        if tally.how == stats.EXACT:
            return None
        note = ngettext("%(total_count)s selected", "All %(total_count)s selected", tally.n)
        return note % {"total_count": tally_text(tally)}


class LabelledCount:
    """A changelist whose `result_count` is its paginator's count as the admin shows it (see
    `tally_html()`): given to Django's own admin templates, of whichever Django version, in
    place of the changelist."""

    def __init__(self, changelist: CountingChangeList) -> None:
        self.changelist = changelist

    def __getattr__(self, name: str) -> Any:
        return getattr(self.changelist, name)

    @property
    def result_count(self) -> int | str:
        tally = self.changelist.paginator.tally
        return tally.n if tally.how == stats.EXACT else tally_html(tally)
