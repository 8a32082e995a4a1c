"""What the job, ledger and worker admins share: the database shown, read-only rows and indexed
search."""

from __future__ import annotations

from typing import Any, cast

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from django_leases.limits import JOB_ID


class DatabaseMixin:
    """The database an admin shows: `using`, or the routers' choice if None (Django's way of
    exposing several databases in its admin). To show a second database's queue, register
    subclasses with `using = "ALIAS"` on an `AdminSite` of their own."""

    using: str | None = None

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        rows: QuerySet[Any] = super().get_queryset(request)  # type: ignore[misc]
        return rows if self.using is None else rows.using(self.using)

    def all_rows(self) -> QuerySet[Any]:
        """Every row of the admin's model on its database, without the list's annotations."""
        model: Any = self.model  # type: ignore[attr-defined]
        return cast(QuerySet[Any], model._default_manager.db_manager(self.using).all())


class ReadOnlyMixin:
    """Nothing is added, changed or deleted here: the rows are written by the lease layer."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class OfferedFiltersMixin:
    """Filter the list by the admin's own filters only: a URL lookup of any other field
    (`?payload__icontains=`, `?id__regex=`) is refused with HTTP 400 (Django's
    `DisallowedModelAdminLookup`) instead of running a full scan, or a query the database
    rejects, for anyone who may view the list."""

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        model: Any = self.model  # type: ignore[attr-defined]
        for offered in self.list_filter:  # type: ignore[attr-defined]
            # A field with a filter class of its own: ("field", FieldListFilter).
            spec = offered[0] if isinstance(offered, tuple) else offered
            if isinstance(spec, type) and issubclass(spec, admin.SimpleListFilter):
                if lookup == spec.parameter_name:
                    return True  # the filter itself decides what a value means
            elif isinstance(spec, str) and lookup == f"{spec}__exact":
                # A field's own filter offers its choices; any other value matches nothing
                # and would only reach the database.
                choices = model._meta.get_field(spec).flatchoices
                return not choices or value in {str(choice) for choice, _ in choices}
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
