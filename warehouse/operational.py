"""The operational DuckDB file: its schema, its versioned migrations, and opening it.

Only the service process opens this file read-write (DuckDB allows one writer process), and
inside the service only the group-commit writer thread uses the connection. It holds the event
outbox with its dedupe key and labels, and the gate's state (leases, ledger, counters,
idempotency records, remainder buckets). All times are stored as UTC TIMESTAMPTZ.
"""

from __future__ import annotations

from pathlib import Path

import duckdb

__all__ = ["MIGRATIONS", "open_operational", "schema_version"]

# Append only: a migration, once shipped, is never edited; a change is a new version.
MIGRATIONS: tuple[tuple[int, str], ...] = (
    (
        1,
        """
        CREATE TABLE events (
            seq                BIGINT NOT NULL,
            event_id           UUID PRIMARY KEY,
            realm              VARCHAR NOT NULL,
            billing_account_id VARCHAR NOT NULL,
            request_hash       VARCHAR NOT NULL,
            semantic_kind      VARCHAR NOT NULL,
            event_type         VARCHAR NOT NULL,
            occurred_at        TIMESTAMPTZ NOT NULL,
            subject_ref        VARCHAR,
            payload            JSON NOT NULL,
            labels             JSON NOT NULL,
            created_at         TIMESTAMPTZ NOT NULL,
            ingest_path        VARCHAR NOT NULL  -- single | batch
        );
        -- Labels are stored once, as the JSON object on the event row; this view types each
        -- value into one slot (uuid for a canonical lower-case UUID string, else text; bool;
        -- number), so typing costs nothing on the write path and cannot drift from the row.
        CREATE VIEW event_labels AS
        SELECT event_id, realm, billing_account_id, key,
               CASE json_type(value)
                   WHEN 'BOOLEAN' THEN 'bool'
                   WHEN 'VARCHAR' THEN CASE WHEN regexp_full_match(value ->> '$',
                       '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}')
                       THEN 'uuid' ELSE 'text' END
                   ELSE 'number'
               END AS slot,
               CASE WHEN json_type(value) = 'VARCHAR' AND NOT regexp_full_match(value ->> '$',
                   '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}')
                   THEN value ->> '$' END AS value_text,
               CASE WHEN json_type(value) = 'VARCHAR' AND regexp_full_match(value ->> '$',
                   '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}')
                   THEN CAST(value ->> '$' AS UUID) END AS value_uuid,
               CASE WHEN json_type(value) = 'BOOLEAN' THEN CAST(value AS BOOLEAN) END AS value_bool,
               CASE WHEN json_type(value) IN ('BIGINT', 'UBIGINT', 'DOUBLE', 'HUGEINT')
                   THEN CAST(value AS DOUBLE) END AS value_number
        FROM (
            SELECT e.event_id, e.realm, e.billing_account_id, k.key,
                   json_extract(e.labels, '$."' || k.key || '"') AS value
            FROM events e, unnest(json_keys(e.labels)) AS k(key)
        );
        """,
    ),
)


def schema_version(conn: duckdb.DuckDBPyConnection) -> int:
    row = conn.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()
    return int(row[0]) if row else 0


def open_operational(path: Path) -> duckdb.DuckDBPyConnection:
    """Open (creating if needed) the operational file and bring its schema up to date."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = duckdb.connect(str(path))
    conn.execute("SET TimeZone = 'UTC'")
    conn.execute("SET threads = 1")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        "(version INTEGER PRIMARY KEY, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
    )
    current = schema_version(conn)
    for version, sql in MIGRATIONS:
        if version <= current:
            continue
        conn.execute("BEGIN")
        try:
            conn.execute(sql)
            conn.execute("INSERT INTO schema_migrations (version) VALUES (?)", [version])
            conn.execute("COMMIT")
        except Exception:
            conn.execute("ROLLBACK")
            raise
    return conn
