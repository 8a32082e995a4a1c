"""The fake PSP's books in a database of their own, `BOOKS`, as a real PSP's are.

Its calls then commit apart from the shop's transactions: a call made inside a step
(`lease.step()` runs the step in a transaction) is booked whether or not the step commits.
On PostgreSQL and MariaDB/MySQL `BOOKS` is the shop's database reached by a connection of its
own; beside a SQLite shop it is a file of its own (`dbconfig.books_database()`), since a
SQLite transaction locks the whole file and the step's would hold the PSP's write back.
"""

from typing import Any

from django.conf import settings

BOOKS = "psp"
BOOK_MODELS = {"fakepspcharge", "fakepspcall"}


def separate_books() -> bool:
    """Whether the books are a database apart from the shop's: a SQLite file of their own.

    Told by the engine, not by comparing names: a test run renames each database as it
    creates it."""
    return str(settings.DATABASES[BOOKS]["ENGINE"]).endswith("sqlite3")


class PspRouter:
    """Send the fake PSP's models to `BOOKS`, and migrate them there alone when it is apart."""

    def _route(self, model: Any) -> str | None:
        is_books = model._meta.app_label == "payments" and model._meta.model_name in BOOK_MODELS
        return BOOKS if is_books else None

    def db_for_read(self, model: Any, **hints: Any) -> str | None:
        return self._route(model)

    def db_for_write(self, model: Any, **hints: Any) -> str | None:
        return self._route(model)

    def allow_migrate(
        self, db: str, app_label: str, model_name: str | None = None, **hints: Any
    ) -> bool | None:
        if not separate_books():
            return None
        is_books = app_label == "payments" and model_name in BOOK_MODELS
        if db == BOOKS:
            return is_books
        return False if is_books else None
