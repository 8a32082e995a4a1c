"""Each database's differences for the lease layer, chosen once per connection.

Django's own pattern (`connection.ops`, one `operations.py` per backend): `dialect_of(connection)`
picks the `Dialect` of the connection's backend the first time it is asked and keeps it beside
that connection. One module per database owns its statements and runs them: `postgresql.py`
(with `postgresql_statements.py` and the prepared claim's `postgresql_prepared.py`),
`sqlite.py`, `mysql.py` (with `mysql_statements.py`): the claim and completions, NOTIFY and
LISTEN, row estimates, cursors, network options and the server's statement timeout, deadlock
and configuration error codes, the fencing clock, the INSERT's words. `base.py` holds the
`Dialect` base, what a database without statements of its own does (the ORM's, the
specification); `statements.py`, `insert.py` and `merge.py` what every database's statements
share. Nowhere else in the package is the backend named.
"""

from weakref import WeakKeyDictionary

from django.core.exceptions import ImproperlyConfigured
from django.db import NotSupportedError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.utils import load_backend

from django_leases.dialects.base import Dialect, Jobs
from django_leases.dialects.mysql import MySQL
from django_leases.dialects.postgresql import PostgreSQL
from django_leases.dialects.sqlite import SQLite

__all__ = ["Dialect", "Jobs", "deadlocked", "dialect_of", "dialect_of_engine", "named"]

DIALECTS: dict[str, Dialect] = {d.name: d for d in (PostgreSQL(), SQLite(), MySQL())}
"""The dialect of each backend Django names (`connection.vendor`)."""

_chosen: WeakKeyDictionary[BaseDatabaseWrapper, Dialect] = WeakKeyDictionary()


def dialect_of(connection: BaseDatabaseWrapper) -> Dialect:
    """Return the dialect of `connection`, chosen at its first use and kept beside it.

    Raises:
        NotSupportedError: for a backend django-leases does not run on.
    """
    chosen = _chosen.get(connection)
    if chosen is None:
        chosen = _chosen[connection] = named(connection.vendor)
    return chosen


def dialect_of_engine(engine: str) -> Dialect | None:
    """Return the dialect of the backend `engine` names (a DATABASES entry's ENGINE), without
    a connection; None for a backend django-leases does not run on, or that does not load."""
    try:
        vendor = load_backend(engine).DatabaseWrapper.vendor
    except ImproperlyConfigured:
        return None
    return DIALECTS.get(vendor)


def named(name: str) -> Dialect:
    """Return the dialect of the backend Django calls `name` ("postgresql", "sqlite", "mysql").

    Raises:
        NotSupportedError: for a backend django-leases does not run on.
    """
    try:
        return DIALECTS[name]
    except KeyError:
        raise NotSupportedError(f"django-leases does not run on {name}") from None


def deadlocked(exc: BaseException, vendor: str) -> bool:
    """Whether the `vendor` database rolled the transaction back to break a deadlock or lock
    wait (`Dialect.deadlocked`)."""
    return named(vendor).deadlocked(exc)
