"""What holds back the removal of dead rows, judged and told before the queue slows down.

A session idle in a transaction, a long `pg_dump` or analytics query, a standby's
hot_standby_feedback, an abandoned replication slot or prepared transaction pins PostgreSQL's
xmin horizon (on MariaDB/MySQL, an old transaction holds InnoDB's purge back): vacuum removes
none of the row versions completed jobs leave behind, and each claim walks more of them (see
docs/operations.md, "What holds vacuum back"). `oldest_pin()` reads the oldest pin in one
statement of the dialect's (`sql.horizon`); a pin is past its bound (`HorizonPin.pinned`) once it
is HORIZON_WARN_AFTER seconds old or, where it has no start time (a replication slot, a
standby's feedback), HORIZON_WARN_XIDS transactions old. The watcher logs it (`HorizonLog`), the
gauges and the admin's overview show it, and `check --database` warns of it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from django.db import DatabaseError, connections

from django_leases.conf import leases_settings
from django_leases.dialects import dialect_of

logger = logging.getLogger("django_leases.watcher")

LOG_EVERY = 300.0
"""Seconds between two warnings of the watcher about the same pin."""


@dataclass(frozen=True)
class HorizonPin:
    """The oldest holder of the horizon: its `source` (session, replication slot, prepared
    transaction; transaction on MariaDB/MySQL), its `name` (a pid, a slot's name, a gid, a
    thread id), what else the database tells of it, how long ago it started (None: unknown)
    and how many transactions old it is (PostgreSQL only)."""

    source: str
    name: str
    detail: str
    seconds: float | None
    xids: int | None

    @property
    def pinned(self) -> bool:
        """Whether it is past its bound (HORIZON_WARN_AFTER seconds, else HORIZON_WARN_XIDS)."""
        if self.seconds is not None:
            return self.seconds >= leases_settings.HORIZON_WARN_AFTER
        return self.xids is not None and self.xids >= leases_settings.HORIZON_WARN_XIDS

    def describe(self) -> str:
        """E.g. "session 4242 (psql, root, 10.0.0.5, idle in transaction), for 612 s,
        48113 transactions old"."""
        parts = [f"{self.source} {self.name}" + (f" ({self.detail})" if self.detail else "")]
        if self.seconds is not None:
            parts.append(f"for {self.seconds:.0f} s")
        if self.xids is not None:
            parts.append(f"{self.xids} transactions old")
        return ", ".join(parts)


def oldest_pin(alias: str) -> HorizonPin | None:
    """The oldest pin of database `alias`'s horizon; None where nothing pins, where the
    database has no horizon (SQLite), or where the session may not read it (MariaDB/MySQL
    without the PROCESS privilege)."""
    connection = connections[alias]
    statement = dialect_of(connection).horizon_pin()
    if statement is None:
        return None
    try:
        # A refusal (MariaDB/MySQL's missing PROCESS privilege) leaves a transaction usable.
        with connection.cursor() as cursor:
            cursor.execute(*statement)
            row = cursor.fetchone()
    except DatabaseError as exc:
        logger.debug("could not read what holds the horizon on %r: %s", alias, exc)
        return None
    if row is None:
        return None
    source, name, detail, seconds, xids = row
    return HorizonPin(
        source=str(source),
        name=str(name),
        detail=str(detail or ""),
        seconds=None if seconds is None else float(seconds),
        xids=None if xids is None else int(xids),
    )


class HorizonLog:
    """The watcher's warning of a pin past its bound: once when it is first seen, then every
    LOG_EVERY seconds while the same holder pins."""

    def __init__(self) -> None:
        self._last: tuple[str, str] | None = None
        self._logged_at = -float("inf")

    def look(self, alias: str) -> HorizonPin | None:
        """Read database `alias`'s oldest pin and warn of it if it is past its bound; return it."""
        pin = oldest_pin(alias)
        if pin is None or not pin.pinned:
            self._last = None
            return pin
        holder = (pin.source, pin.name)
        if holder != self._last or time.monotonic() - self._logged_at >= LOG_EVERY:
            logger.warning(
                "the vacuum horizon of database %r is pinned by %s: the rows completed jobs "
                "leave behind cannot be removed while it lasts, and claims slow down as they "
                "pile up. End it, or bound such sessions (idle_in_transaction_session_timeout, "
                "statement timeouts)",
                alias,
                pin.describe(),
            )
            self._last, self._logged_at = holder, time.monotonic()
        return pin
