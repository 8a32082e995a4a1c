"""The NOTIFY that announces enqueued jobs to the workers listening on PostgreSQL: its channel,
and when an enqueue sends it (in its own INSERT outside a transaction, else once per kind at the
transaction's commit)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from django.db import connections, models, transaction

from django_leases.conf import leases_settings
from django_leases.dialects import dialect_of

if TYPE_CHECKING:
    from django_leases.querysets.reads import LeaseReads


def notify_channel(model: type[models.Model]) -> str:
    """Return the LISTEN/NOTIFY channel on which enqueues of `model` are announced."""
    return f"django_leases_{model._meta.db_table}"[:63]


def announced_by_insert(qs: LeaseReads[Any], kind: str) -> tuple[str, str] | None:
    """The (channel, message) that an INSERT outside any transaction of Django's announces
    itself, or None: the database has no NOTIFY, USE_NOTIFY is off, or the INSERT is part of
    a transaction (`notify()` announces its kinds once, at its commit)."""
    connection = connections[qs.db]
    if connection.in_atomic_block or not notifies(connection):
        return None
    return notify_channel(qs.model), kind


def notifies(connection: Any) -> bool:
    """Whether enqueues on `connection` are announced: its database has NOTIFY, and USE_NOTIFY."""
    return dialect_of(connection).notifies and leases_settings.USE_NOTIFY


def notify(qs: LeaseReads[Any], kind: str) -> None:
    """Announce a new job of `kind` to the listening workers: once per kind and
    transaction, when it commits (at once outside a transaction)."""
    connection = connections[qs.db]
    if not notifies(connection):
        return
    channel = notify_channel(qs.model)
    if not connection.in_atomic_block:
        _send_notify(qs.db, channel, kind)
        return
    # Django replaces the list of commit hooks at each commit, rollback and savepoint
    # rollback: the kinds noted beside that very list are the ones whose NOTIFY is still
    # due. After a savepoint rollback a kind may be announced twice, never not at all.
    noted = getattr(connection, "_leases_notified", None)
    if noted is None or noted[0] is not connection.run_on_commit:
        noted = (connection.run_on_commit, set[tuple[str, str]]())
        connection._leases_notified = noted  # type: ignore[attr-defined]
    if (channel, kind) not in noted[1]:
        noted[1].add((channel, kind))
        hook = partial(_send_notify, qs.db, channel, kind)
        transaction.on_commit(hook, using=qs.db, robust=True)


def _send_notify(alias: str, channel: str, kind: str) -> None:
    # After the commit, in autocommit: listeners can see the job when they hear of it.
    connection = connections[alias]
    with connection.cursor() as cursor:
        cursor.execute(*dialect_of(connection).notify(channel, kind))
