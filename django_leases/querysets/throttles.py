"""Throttles: the claims of kinds with a `limit=` or `rate=` (`django_leases.throttles`).

`claim_throttled()` (of `claims`), and the queryset of the per-kind gate rows. A throttled kind is
claimed in a transaction of its own that first writes the kind's gate row: the row lock
(PostgreSQL, MariaDB/MySQL) or the write lock (SQLite) serialises every claimer of that kind,
on every host, until commit. Under it the claim counts what the kind already has running
(live leases) and started (`KindStart` rows within the rate window), claims at most what is
left, and records its starts: the check and the claim are one decision. Each later statement
of the transaction sees what earlier holders of the lock committed (READ COMMITTED takes a new
snapshot per statement; SQLite has one writer), and a lock holder's claim times follow the
previous holder's commit, so the starts of one window are never spread over two decisions.

A gate is held only as long as the server lets a claim wait and idle: the gated transaction
waits at most GATE_WAIT for a lock, then fails with `GateBusy` (its kind is skipped, the others
are claimed), and a session of ours that freezes inside it (a paused or partitioned client) is
closed by the server once it idled GATE_IDLE (PostgreSQL, MariaDB), which lets the gate go.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from django.apps import apps
from django.db import DatabaseError, OperationalError, connections, models, transaction
from django.db.models import Count, Q, Sum
from django.db.models.functions import Now

from django_leases.dialects import dialect_of
from django_leases.exceptions import GateBusy
from django_leases.handlers import throttles
from django_leases.querysets.base import ago, retry_deadlocks
from django_leases.querysets.ledger import J
from django_leases.status import LEASED_STATUSES
from django_leases.throttles import Throttle

if TYPE_CHECKING:
    from django_leases.querysets.reads import LeaseReads


STALE_STARTS = 32
"""Start rows past their window that a claim lets wait before it deletes them all."""

GATE_WAIT = 1.0
"""Seconds a claim waits for a kind's gate (held by another claim for milliseconds, or by a
stalled session) before it skips the kind for this turn."""
GATE_IDLE = 5.0
"""Seconds a session may sit idle inside its gated claim transaction before the server closes
it, releasing the gate: a claim's statements follow each other within milliseconds."""


class KindGateQuerySet(models.QuerySet[Any]):
    """One row per job table and throttled kind: what its claims lock, and their starts."""

    def lock(self, job_model: type[models.Model], kind: str) -> None:
        """Lock the gate row of `kind` on `job_model`'s table until commit (creating it the
        first time), waiting at most GATE_WAIT, and bound the transaction's idle time by
        GATE_IDLE (`bounded()` undoes what outlives the transaction).

        Raises:
            GateBusy: the gate was held past GATE_WAIT.
        """
        connection = connections[self.db]
        dialect = dialect_of(connection)
        bounds = dialect.gate_bounds(connection, wait=GATE_WAIT, idle=GATE_IDLE)
        row = self.of(job_model, kind)
        try:
            if bounds is not None:
                with connection.cursor() as cursor:
                    cursor.execute(*bounds)
            # An UPDATE, not SELECT FOR UPDATE: SQLite has no row locks, and only a write takes
            # its write lock at once (a read first would fail to upgrade under a concurrent
            # writer).
            if not row.update(last_claim_at=Now()):
                # ON CONFLICT DO NOTHING / INSERT IGNORE: a racing first claim creates it too.
                label = job_model._meta.label_lower
                self.bulk_create([self.model(job_model=label, kind=kind)], ignore_conflicts=True)
                row.update(last_claim_at=Now())
        except OperationalError as exc:
            if dialect.gate_busy(exc):
                raise GateBusy(kind) from exc
            raise

    @contextmanager
    def bounded(self) -> Iterator[None]:
        """Around a gated transaction: give the session back what `lock()`'s bounds changed
        beyond the transaction (MariaDB/MySQL's session values)."""
        try:
            yield
        finally:
            connection = connections[self.db]
            restore = dialect_of(connection).gate_bounds_restored(connection)
            # A session the error ended has nothing to restore.
            if restore is not None and connection.connection is not None:
                with suppress(DatabaseError), connection.cursor() as cursor:
                    cursor.execute(*restore)

    def holders(self, job_model: type[models.Model], kind: str) -> str:
        """Say which sessions hold the gate of `kind` on `job_model`'s table, as the database
        tells it, for the log of a claim that waited for it too long."""
        connection = connections[self.db]
        table = connection.ops.quote_name(self.model._meta.db_table)
        label = job_model._meta.label_lower
        statement = dialect_of(connection).gate_holders(table, job_model=label, kind=kind)
        if statement is None:
            return "another connection, holding the database's write lock"
        try:
            with connection.cursor() as cursor:
                cursor.execute(*statement)
                names = [column[0] for column in cursor.description]
                rows = cursor.fetchall()
        except DatabaseError as exc:
            return f"its holder could not be read ({' '.join(str(exc).split())})"
        if not rows:
            return "its holder has let go since"
        return "; ".join(
            " ".join(f"{name}={shown_value(value)}" for name, value in zip(names, row, strict=True))
            for row in rows
        )

    def of(self, job_model: type[models.Model], kind: str) -> KindGateQuerySet:
        """The gate row of `kind` on `job_model`'s table."""
        return self.filter(job_model=job_model._meta.label_lower, kind=kind)

    def started(self, gate: int, window: float) -> tuple[int, int]:
        """Return the jobs started through `gate` within the last `window` seconds of the
        database clock, and how many older start rows wait to be deleted."""
        counts = self._starts(gate).aggregate(
            fresh=Sum("count", filter=Q(at__gt=ago(window)), default=0),
            stale=Count("pk", filter=Q(at__lte=ago(window))),
        )
        return int(counts["fresh"]), int(counts["stale"])

    def record_starts(self, gate: int, count: int, window: float, *, stale: int) -> None:
        """Record `count` jobs started through `gate` now; delete the rows past `window`."""
        starts = self._starts(gate)
        # In batches: a row past the window only costs the next counts a row each.
        if stale >= STALE_STARTS:
            starts.filter(at__lte=ago(window)).delete()
        # `at` from the clock of this statement, after the claim's (and its ledger's): a start
        # is never recorded earlier than its attempt's `claimed_at`.
        starts.create(gate_id=gate, count=count, at=Now())

    def _starts(self, gate: int) -> models.QuerySet[Any]:
        # The model of `KindGate.starts`: models.py is built on this package, never imported.
        starts: Any = self.model._meta.get_field("starts").related_model
        return starts._default_manager.using(self.db).filter(gate_id=gate)


@retry_deadlocks
def claim_throttled(
    qs: LeaseReads[J], kind: str, throttle: Throttle, limit: int, take: Callable[[int], list[J]]
) -> list[J]:
    """Claim at most `limit` jobs of `kind` with `take(room)`, within its throttle."""
    gates = kind_gates(qs.db)
    with gates.bounded(), transaction.atomic(using=qs.db):
        gates.lock(qs.model, kind)
        room, stale, gate = limit, 0, 0
        if throttle.limit is not None:
            live = qs.filter(kind=kind, status__in=LEASED_STATUSES, lease_until__gte=Now()).count()
            room = min(room, throttle.limit - live)
        if throttle.rate is not None and room > 0:
            count, window = throttle.rate
            gate = int(gates.of(qs.model, kind).values_list("pk", flat=True).get())
            fresh, stale = gates.started(gate, window)
            room = min(room, count - fresh)
        if room <= 0:
            return []
        jobs = take(room)
        if throttle.rate is not None and jobs:
            gates.record_starts(gate, len(jobs), throttle.rate[1], stale=stale)
    return jobs


def kind_gates(using: str) -> KindGateQuerySet:
    """Return the gate rows on `using`: the database of the job table they throttle."""
    # From the app registry: models.py is built on this package, never imported by it.
    gates: Any = apps.get_model("django_leases", "KindGate")
    return cast(KindGateQuerySet, gates._default_manager.db_manager(using).all())


def shown_value(value: Any) -> str:
    """A value of a gate holder's row, as a log line shows it: one line, text quoted."""
    if isinstance(value, datetime):
        return value.isoformat()
    return repr(value) if isinstance(value, str | bytes) else str(value)


def throttles_of(kinds: list[str] | None) -> dict[str, Throttle]:
    """Return the throttles of `kinds` (None: every kind), in the order claims lock them."""
    known = throttles()
    if not known:
        return {}
    wanted = sorted(known) if kinds is None else sorted(set(kinds) & known.keys())
    return {kind: known[kind] for kind in wanted}
