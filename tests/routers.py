"""Database routers of the tests, importable by worker subprocesses (`LEASES_TEST_ROUTERS`)."""

from typing import Any


class ReplicaRouter:
    """The usual read/write split of the queue's tables: reads from a replica, writes to the
    primary. The "replica" is the database "other", which replicates nothing, so a write sent
    to it (or a read that a write depends on) shows."""

    def db_for_read(self, model: type[Any], **hints: Any) -> str | None:
        return "other" if model._meta.app_label == "django_leases" else None

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return "default" if model._meta.app_label == "django_leases" else None
