"""The gate's tables in the operational file (leases, lease_transitions, commits,
commit_lines, grants, idempotency; schema in `warehouse.operational`): the reads that rebuild
the writer's gate book at start and after a failed group, and the two writes the book makes
outside a group's transaction (grants recorded from the catalog, leases expired by time).

The book's rows inside a group are staged by table name and inserted by the journal; only
here is gate SQL written, beside the schema it reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import duckdb

__all__ = [
    "committed_totals",
    "carried_remainders",
    "idempotency_records",
    "last_seqs",
    "leases_to_keep",
    "record_expired",
    "record_grants",
    "recorded_grants",
    "usage_by_day",
]


def leases_to_keep(conn: duckdb.DuckDBPyConnection, ended_since: datetime) -> list[tuple[Any, ...]]:
    """Every lease still active, and every one that ended (committed, cancelled, expired) at
    or after `ended_since`: lease_id, token_sha256, realm, principal_id, billing_account_id,
    feature_code, feature_family_code ('' for none), held_quantity_minor, held_amount_xusd,
    created_at, expires_at, state (NULL: active), ended_at, and a commit's body and reply."""
    return conn.execute(
        """
        SELECT l.lease_id, l.token_sha256, l.realm, l.principal_id, l.billing_account_id,
               l.feature_code, coalesce(l.feature_family_code, ''), l.held_quantity_minor,
               l.held_amount_xusd, l.created_at, l.expires_at,
               CASE WHEN c.lease_id IS NOT NULL THEN 'committed' ELSE t.state END,
               coalesce(c.committed_at, t.happened_at), c.body_json, c.reply_json
        FROM leases l
        LEFT JOIN (SELECT lease_id, arg_max(state, happened_at) AS state, max(happened_at) AS happened_at
                   FROM lease_transitions GROUP BY lease_id) t USING (lease_id)
        LEFT JOIN commits c USING (lease_id)
        WHERE (c.lease_id IS NULL AND t.state IS NULL)
           OR coalesce(c.committed_at, t.happened_at) >= ?
        """, [ended_since]).fetchall()


def usage_by_day(conn: duckdb.DuckDBPyConnection, since: datetime) -> list[tuple[Any, ...]]:
    """Committed quantity and amount per realm, account, principal, feature and UTC day, from
    `since` on."""
    return conn.execute(
        """
        SELECT realm, billing_account_id, principal_id, feature_code, CAST(committed_at AS DATE),
               sum(quantity_minor), sum(amount_xusd)
        FROM commits WHERE committed_at >= ? GROUP BY ALL
        """, [since]).fetchall()


def committed_totals(conn: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
    """Every commit's amount summed per realm and account: what funding subtracts."""
    return conn.execute(
        "SELECT realm, billing_account_id, sum(amount_xusd) FROM commits GROUP BY ALL").fetchall()


def recorded_grants(conn: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
    """The grants in the ledger: realm, account, grant id, amount, effective_at."""
    return conn.execute(
        "SELECT realm, billing_account_id, grant_id, amount_xusd, effective_at FROM grants").fetchall()


def carried_remainders(conn: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
    """The remainder each (realm, account, meter, pricing fingerprint) carries: its latest
    commit line's."""
    return conn.execute(
        """
        SELECT realm, billing_account_id, meter_code, pricing_fingerprint, arg_max(remainder_after, seq)
        FROM commit_lines WHERE pricing_fingerprint IS NOT NULL GROUP BY ALL
        """).fetchall()


def idempotency_records(conn: duckdb.DuckDBPyConnection, since: datetime) -> list[tuple[Any, ...]]:
    """The idempotency records stored from `since` on: realm, principal, endpoint, key, body
    digest, reply (msgpack), stored_at."""
    return conn.execute(
        """
        SELECT realm, principal_id, endpoint, idem_key, body_sha256, reply, stored_at
        FROM idempotency WHERE stored_at >= ?
        """, [since]).fetchall()


def last_seqs(conn: duckdb.DuckDBPyConnection) -> tuple[int, int]:
    """The greatest seq of commit_lines and of commits (0 for none): where the next go on."""
    row = conn.execute("SELECT coalesce(max(seq), 0) FROM commit_lines").fetchone()
    line_seq = int(row[0]) if row else 0
    row = conn.execute("SELECT coalesce(max(seq), 0) FROM commits").fetchone()
    commit_seq = int(row[0]) if row else 0
    return line_seq, commit_seq


def record_grants(conn: duckdb.DuckDBPyConnection, rows: list[tuple[Any, ...]]) -> None:
    """Insert grants (realm, account, grant id, amount, effective_at, recorded_at) in one
    transaction; a grant id the realm has already is left as it is."""
    _insert_all(conn, "INSERT INTO grants VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING", rows)


def record_expired(conn: duckdb.DuckDBPyConnection, leases: list[tuple[str, datetime]]) -> None:
    """Mark leases (lease_id, expires_at) expired at their time, in one transaction."""
    _insert_all(conn, "INSERT INTO lease_transitions VALUES (?, 'expired', ?, NULL)", leases)


def _insert_all(conn: duckdb.DuckDBPyConnection, sql: str,
                rows: Sequence[Sequence[object]]) -> None:
    """`sql` for every row, all in one transaction or none."""
    conn.execute("BEGIN")
    try:
        conn.executemany(sql, rows)
        conn.execute("COMMIT")
    except duckdb.Error:
        conn.execute("ROLLBACK")
        raise
