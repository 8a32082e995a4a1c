"""What holds back the removal of dead rows: each database's read of its oldest pin.

PostgreSQL's vacuum cannot remove a row version that a session's snapshot or transaction id,
a replication slot or a prepared transaction may still see (the "xmin horizon"); InnoDB's purge
cannot remove undo records an open transaction's read view needs. While one is pinned, every
completed job leaves dead entries at the front of the claim's index range, and each claim walks
more of them. Each statement returns one row, the oldest pin, as (source, name, detail,
seconds, xids): seconds since it started where that is known, its transaction-id age on
PostgreSQL; no row when nothing pins.
"""

from __future__ import annotations

from typing import Any

Params = dict[str, Any]


def postgresql_pin() -> tuple[str, Params]:
    """The oldest of: sessions of this database (or walsenders: a standby's
    hot_standby_feedback) holding a snapshot or a transaction id, replication slots, prepared
    transactions. Other roles' sessions show only with pg_read_all_stats (pg_monitor)."""
    sql = """
        SELECT source, name, detail, seconds, xids FROM (
            SELECT 'session' AS source, pid::text AS name,
                concat_ws(', ', NULLIF(application_name, ''), usename::text,
                    client_addr::text, state) AS detail,
                CASE WHEN backend_type = 'walsender' THEN NULL ELSE EXTRACT(EPOCH FROM
                    clock_timestamp() - COALESCE(xact_start, backend_start))::float8 END
                    AS seconds,
                GREATEST(age(backend_xmin), age(backend_xid))::bigint AS xids
            FROM pg_stat_activity
            WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
                AND pid <> pg_backend_pid()
                AND (datname = current_database() OR backend_type = 'walsender')
            UNION ALL
            SELECT 'replication slot', slot_name::text,
                concat_ws(', ', slot_type, CASE WHEN active THEN 'active' ELSE 'inactive' END),
                NULL, age(xmin)::bigint
            FROM pg_replication_slots WHERE xmin IS NOT NULL
            UNION ALL
            SELECT 'prepared transaction', gid, owner::text,
                EXTRACT(EPOCH FROM clock_timestamp() - prepared)::float8,
                age(transaction)::bigint
            FROM pg_prepared_xacts WHERE database = current_database()
        ) AS pins
        ORDER BY xids DESC
        LIMIT 1
    """
    return sql, {}


def mysql_pin() -> tuple[str, Params]:
    """The oldest InnoDB transaction of another session (it holds the purge back from its
    start); seen with the PROCESS privilege. Its start is in the server's system time zone,
    whatever the session's: the session's clock is read there too."""
    sql = """
        SELECT 'transaction', CAST(trx.trx_mysql_thread_id AS CHAR),
            CONCAT_WS(', ', p.USER, p.HOST, p.DB, p.COMMAND),
            TIMESTAMPDIFF(
                MICROSECOND, trx.trx_started, CONVERT_TZ(NOW(6), @@session.time_zone, 'SYSTEM')
            ) / 1e6,
            NULL
        FROM information_schema.INNODB_TRX AS trx
        LEFT JOIN information_schema.PROCESSLIST AS p ON p.ID = trx.trx_mysql_thread_id
        WHERE trx.trx_mysql_thread_id <> CONNECTION_ID()
        ORDER BY trx.trx_started
        LIMIT 1
    """
    return sql, {}
