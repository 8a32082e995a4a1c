"""What the job, ledger and worker admins share: read-only rows and indexed search."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.http import HttpRequest

from django_leases.limits import JOB_ID


class ReadOnlyMixin:
    """Nothing is added, changed or deleted here: the rows are written by the lease layer."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class IndexedSearchMixin:
    """Search with `search(queryset, term)`, lookups an index serves, instead of Django's
    icontains on every search field, which scans the whole table."""

    def search(self, queryset: QuerySet[Any], term: str) -> QuerySet[Any]:
        raise NotImplementedError

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        term = search_term.strip()
        return (self.search(queryset, term) if term else queryset), False


def job_id(term: str) -> int | None:
    """Return `term` as a job id if it is one: ASCII digits within the BIGINT range."""
    # Not str.isdigit() alone: it is true for "²" and other digits int() refuses. The length
    # bound keeps int() from parsing (or refusing) thousands of digits.
    if not term.isascii() or not term.isdigit() or len(term) > len(str(JOB_ID[1])):
        return None
    number = int(term)
    return number if JOB_ID[0] <= number <= JOB_ID[1] else None
