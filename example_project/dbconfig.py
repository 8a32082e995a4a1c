"""DATABASES from DATABASE_URL, tuned for many worker processes on each backend."""

import copy
from pathlib import Path
from typing import Any

import environ


def database_from_env(env: environ.Env, default_sqlite: Path) -> dict[str, Any]:
    """Return the default database: DATABASE_URL, or a SQLite file next to the project."""
    return database_from_url(env.str("DATABASE_URL", default="") or f"sqlite:///{default_sqlite}")


def database_from_url(url: str) -> dict[str, Any]:
    """Return the database of `url`, tuned for its backend."""
    db = environ.Env.db_url_config(url)
    # Workers are long-lived: keep their connections (one per thread) instead of reconnecting
    # on every loop round, which costs more than the claim itself.
    db.setdefault("CONN_MAX_AGE", None)
    engine = db["ENGINE"]
    if engine.endswith("sqlite3"):
        db.setdefault("OPTIONS", {}).update(
            {
                # Writers queue for the database lock instead of failing at once.
                "timeout": 30,
                # WAL lets readers (the admin, the watcher) run beside the single writer.
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
                # Every transaction takes the write lock when it starts, so none fails halfway
                # trying to upgrade a read lock while another process writes.
                "transaction_mode": "IMMEDIATE",
            }
        )
    elif engine.endswith("mysql"):
        db.setdefault("OPTIONS", {}).update(
            {
                "charset": "utf8mb4",
                "isolation_level": "read committed",
                # Django stores UTC; NOW() must be UTC too, whatever the server's time zone.
                "init_command": "SET time_zone = '+00:00'",
            }
        )
        db.setdefault("TEST", {}).update({"CHARSET": "utf8mb4", "COLLATION": "utf8mb4_unicode_ci"})
    elif engine.endswith("postgresql"):
        db.setdefault("OPTIONS", {})
    return db


def books_database(shop: dict[str, Any]) -> dict[str, Any]:
    """Return the fake PSP's database beside the shop's `shop` (see payments/routers.py): the
    same database by a connection of its own, or, beside a SQLite file, a file of its own."""
    books = copy.deepcopy(shop)
    if shop["ENGINE"].endswith("sqlite3"):
        path = Path(shop["NAME"])
        books["NAME"] = str(path.with_name(f"{path.stem}-psp{path.suffix}"))
    return books
