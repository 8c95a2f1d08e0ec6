"""The operational DuckDB file: its schema, its versioned migrations, and opening it.

Only the service process opens this file read-write (DuckDB allows one writer process), and
inside the service only the group-commit writer uses the connection. Writes reach it through
the journal of `warehouse.journal`: a file opened while a journal is left over (after a
`kill -9`) lacks the newest groups until the writer starts and applies them. It holds the event
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
    (
        2,
        """
        -- The gate. A lease row is written once; a commit row marks it committed, and its
        -- other state changes are appended to lease_transitions, so no row is ever updated
        -- on the hot path. No primary keys here: ids are random and the writer looks leases
        -- up in memory; an index doubled the cost of each group's insert.
        CREATE TABLE leases (
            lease_id            VARCHAR NOT NULL,
            token_sha256        VARCHAR NOT NULL,
            realm               VARCHAR NOT NULL,
            principal_id        VARCHAR NOT NULL,
            billing_account_id  VARCHAR NOT NULL,
            user_id             VARCHAR,
            feature_code        VARCHAR NOT NULL,
            feature_family_code VARCHAR,
            held_quantity_minor BIGINT NOT NULL,
            held_amount_xusd    BIGINT NOT NULL,
            holds               JSON NOT NULL,    -- the limit keys this lease holds against
            created_at          TIMESTAMPTZ NOT NULL,
            expires_at          TIMESTAMPTZ NOT NULL,
            labels              JSON NOT NULL
        );
        CREATE TABLE lease_transitions (
            lease_id  VARCHAR NOT NULL,
            state       VARCHAR NOT NULL,         -- cancelled | expired
            happened_at TIMESTAMPTZ NOT NULL,
            reason      VARCHAR
        );
        CREATE TABLE commits (
            seq                BIGINT NOT NULL,
            commit_id          VARCHAR NOT NULL,
            lease_id           VARCHAR NOT NULL,
            realm              VARCHAR NOT NULL,
            billing_account_id VARCHAR NOT NULL,
            principal_id       VARCHAR NOT NULL,
            feature_code       VARCHAR NOT NULL,
            quantity_minor     BIGINT NOT NULL,
            amount_xusd        BIGINT NOT NULL,
            committed_at       TIMESTAMPTZ NOT NULL,
            lease_expired      BOOLEAN NOT NULL,
            body_json          JSON NOT NULL,      -- the first commit body, for replays
            reply_json         JSON NOT NULL,      -- the first reply's data
            labels             JSON NOT NULL
        );
        -- Priced lines of commits, in commit order (seq): the lake's gate_commit ratings.
        CREATE TABLE commit_lines (
            seq                 BIGINT NOT NULL,
            line_id             VARCHAR NOT NULL,
            commit_id           VARCHAR NOT NULL,
            lease_id            VARCHAR NOT NULL,
            realm               VARCHAR NOT NULL,
            billing_account_id  VARCHAR NOT NULL,
            principal_id        VARCHAR NOT NULL,
            feature_code        VARCHAR NOT NULL,
            meter_code          VARCHAR NOT NULL,
            quantity_minor      BIGINT NOT NULL,
            price_id            VARCHAR,           -- NULL: no price configured (amount 0)
            unit_price_xusd     BIGINT,
            unit_quantity_minor BIGINT,
            rounding            VARCHAR,
            carried_before      BIGINT NOT NULL,
            remainder_after     BIGINT NOT NULL,
            amount_xusd         BIGINT NOT NULL,
            pricing_fingerprint VARCHAR,
            committed_at        TIMESTAMPTZ NOT NULL
        );
        CREATE TABLE grants (
            realm              VARCHAR NOT NULL,
            billing_account_id VARCHAR NOT NULL,
            grant_id           VARCHAR NOT NULL,
            amount_xusd        BIGINT NOT NULL,
            effective_at       TIMESTAMPTZ NOT NULL,
            recorded_at        TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (realm, grant_id)
        );
        CREATE TABLE idempotency (
            realm        VARCHAR NOT NULL,
            principal_id VARCHAR NOT NULL,
            endpoint     VARCHAR NOT NULL,
            idem_key     VARCHAR NOT NULL,
            body_sha256  VARCHAR NOT NULL,
            status       INTEGER NOT NULL,
            reply        BLOB NOT NULL,
            headers      JSON NOT NULL,
            stored_at    TIMESTAMPTZ NOT NULL
        );
        -- Inline ratings of single events, rated right after the event is durable.
        CREATE TABLE inline_ratings (
            seq                 BIGINT NOT NULL,
            rating_id           VARCHAR NOT NULL,
            event_id            UUID NOT NULL,
            realm               VARCHAR NOT NULL,
            billing_account_id  VARCHAR NOT NULL,
            status              VARCHAR NOT NULL,
            policy_id           VARCHAR,
            policy_version      VARCHAR,
            feature_code        VARCHAR,
            meter_code          VARCHAR,
            quantity_minor      BIGINT,
            price_id            VARCHAR,
            unit_price_xusd     BIGINT,
            unit_quantity_minor BIGINT,
            amount_xusd         BIGINT,
            occurred_at         TIMESTAMPTZ NOT NULL,
            rated_at            TIMESTAMPTZ NOT NULL,
            line_index          INTEGER
        );
        -- Export to the lake: the last exported seq of each stream, and its export id.
        CREATE TABLE export_watermarks (
            stream      VARCHAR PRIMARY KEY,      -- events | commit_lines | inline_ratings
            last_seq    BIGINT NOT NULL,
            export_id   BIGINT NOT NULL,
            exported_at TIMESTAMPTZ NOT NULL
        );
        """,
    ),
    (
        3,
        """
        -- The last journaled group applied to this file (warehouse/journal.py).
        CREATE TABLE journal_state (applied_seq BIGINT NOT NULL);
        """,
    ),
    (
        4,
        """
        -- What the gate book rebuilds from, kept as commits and their lines are applied (in
        -- the same transaction, `warehouse.gate_store`), so that commits and commit lines can
        -- leave the file (`warehouse.retention`) without changing a balance, a usage window,
        -- a carried remainder or the next seq; and a start reads these, not history.
        CREATE TABLE gate_committed (
            realm              VARCHAR NOT NULL,
            billing_account_id VARCHAR NOT NULL,
            amount_xusd        HUGEINT NOT NULL,
            PRIMARY KEY (realm, billing_account_id)
        );
        CREATE TABLE gate_usage_days (
            realm              VARCHAR NOT NULL,
            billing_account_id VARCHAR NOT NULL,
            principal_id       VARCHAR NOT NULL,
            feature_code       VARCHAR NOT NULL,
            day                DATE NOT NULL,       -- UTC
            quantity_minor     HUGEINT NOT NULL,
            amount_xusd        HUGEINT NOT NULL,
            PRIMARY KEY (realm, billing_account_id, principal_id, feature_code, day)
        );
        CREATE TABLE gate_carry (
            realm               VARCHAR NOT NULL,
            billing_account_id  VARCHAR NOT NULL,
            meter_code          VARCHAR NOT NULL,
            pricing_fingerprint VARCHAR NOT NULL,
            remainder_after     BIGINT NOT NULL,
            seq                 BIGINT NOT NULL,     -- of the commit line it comes from
            PRIMARY KEY (realm, billing_account_id, meter_code, pricing_fingerprint)
        );
        CREATE TABLE gate_seqs (
            stream   VARCHAR PRIMARY KEY,           -- commits | commit_lines
            last_seq BIGINT NOT NULL
        );
        INSERT INTO gate_committed
            SELECT realm, billing_account_id, sum(amount_xusd) FROM commits GROUP BY ALL;
        INSERT INTO gate_usage_days
            SELECT realm, billing_account_id, principal_id, feature_code,
                   CAST(timezone('UTC', committed_at) AS DATE), sum(quantity_minor), sum(amount_xusd)
            FROM commits GROUP BY ALL;
        INSERT INTO gate_carry
            SELECT realm, billing_account_id, meter_code, pricing_fingerprint,
                   arg_max(remainder_after, seq), max(seq)
            FROM commit_lines WHERE pricing_fingerprint IS NOT NULL GROUP BY ALL;
        INSERT INTO gate_seqs SELECT 'commits', coalesce(max(seq), 0) FROM commits;
        INSERT INTO gate_seqs SELECT 'commit_lines', coalesce(max(seq), 0) FROM commit_lines;
        """,
    ),
    (
        5,
        """
        -- The events table without its primary key. Dedupe is the event index's work
        -- (`warehouse.event_index`), checked before a row is staged, so the key only cost:
        -- measured on 6 M rows, its ART index made the file 7 times larger, halved the insert
        -- rate as it grew, and held memory in proportion to the rows (docs/measurements.md,
        -- "The events table's key"). Rows are found by seq, which ascends with insertion, so
        -- DuckDB's zone maps serve those reads without an index.
        DROP VIEW event_labels;
        CREATE TABLE events_unkeyed (
            seq                BIGINT NOT NULL,
            event_id           UUID NOT NULL,
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
            ingest_path        VARCHAR NOT NULL
        );
        INSERT INTO events_unkeyed SELECT * FROM events ORDER BY seq;
        DROP TABLE events;
        ALTER TABLE events_unkeyed RENAME TO events;
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
    (
        6,
        """
        -- The same typing of labels, from one parse of each event's labels. The lake export
        -- runs this view's SELECT over every batch (`warehouse.export`), and the form above
        -- parsed the labels again for each key and typed each value up to five times: 91-95
        -- ms of the exporter's CPU a batch of 50,000 events against 40-45 ms for this one,
        -- with the same rows (docs/measurements.md, "Where the writer's cost an event grows").
        CREATE OR REPLACE VIEW event_labels AS
        SELECT event_id, realm, billing_account_id, key,
               CASE type
                   WHEN 'BOOLEAN' THEN 'bool'
                   WHEN 'VARCHAR' THEN CASE WHEN is_uuid THEN 'uuid' ELSE 'text' END
                   ELSE 'number'
               END AS slot,
               CASE WHEN type = 'VARCHAR' AND NOT is_uuid THEN text END AS value_text,
               CASE WHEN is_uuid THEN CAST(text AS UUID) END AS value_uuid,
               CASE WHEN type = 'BOOLEAN' THEN CAST(value AS BOOLEAN) END AS value_bool,
               CASE WHEN type IN ('BIGINT', 'UBIGINT', 'DOUBLE', 'HUGEINT')
                   THEN CAST(value AS DOUBLE) END AS value_number
        FROM (
            SELECT *, type = 'VARCHAR' AND regexp_full_match(text,
                       '[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}') AS is_uuid
            FROM (
                SELECT e.event_id, e.realm, e.billing_account_id, j.key, j.value, j.type,
                       j.value ->> '$' AS text
                FROM events e, json_each(e.labels) AS j
            )
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
