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
import pyarrow as pa

from warehouse.journal import register_table

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
    `since`'s day on (from `gate_usage_days`, kept as commits are applied)."""
    return conn.execute(
        """
        SELECT realm, billing_account_id, principal_id, feature_code, day, quantity_minor, amount_xusd
        FROM gate_usage_days WHERE day >= CAST(timezone('UTC', ?::TIMESTAMPTZ) AS DATE)
        """, [since]).fetchall()


def committed_totals(conn: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
    """Every commit's amount summed per realm and account: what funding subtracts (from
    `gate_committed`, kept as commits are applied)."""
    return conn.execute(
        "SELECT realm, billing_account_id, amount_xusd FROM gate_committed").fetchall()


def recorded_grants(conn: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
    """The grants in the ledger: realm, account, grant id, amount, effective_at."""
    return conn.execute(
        "SELECT realm, billing_account_id, grant_id, amount_xusd, effective_at FROM grants").fetchall()


def carried_remainders(conn: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
    """The remainder each (realm, account, meter, pricing fingerprint) carries: its latest
    commit line's."""
    return conn.execute(
        "SELECT realm, billing_account_id, meter_code, pricing_fingerprint, remainder_after "
        "FROM gate_carry").fetchall()


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
    seqs = dict(conn.execute("SELECT stream, last_seq FROM gate_seqs").fetchall())
    return int(seqs.get("commit_lines", 0)), int(seqs.get("commits", 0))


def _staged(rows: list[tuple[Any, ...]]) -> pa.Table:
    columns = list(zip(*rows, strict=True))
    return pa.Table.from_arrays([pa.array(c) for c in columns], names=[f"c{i}" for i in range(len(columns))])


def write_commits(conn: duckdb.DuckDBPyConnection, rows: list[tuple[Any, ...]]) -> None:
    """Insert commits (the journal's rows, in the applier's transaction) and add them to the
    totals, the usage days and the last seq the gate book rebuilds from."""
    staged = _staged(rows)  # noqa: F841 (read by DuckDB below)
    conn.execute("INSERT INTO commits SELECT * FROM staged")
    conn.execute(
        "INSERT INTO gate_committed SELECT c3, c4, sum(c8) FROM staged GROUP BY ALL "
        "ON CONFLICT DO UPDATE SET amount_xusd = gate_committed.amount_xusd + excluded.amount_xusd")
    conn.execute(
        "INSERT INTO gate_usage_days SELECT c3, c4, c5, c6, CAST(timezone('UTC', c9::TIMESTAMPTZ) AS DATE), "
        "sum(c7), sum(c8) FROM staged GROUP BY ALL ON CONFLICT DO UPDATE SET "
        "quantity_minor = gate_usage_days.quantity_minor + excluded.quantity_minor, "
        "amount_xusd = gate_usage_days.amount_xusd + excluded.amount_xusd")
    _advance_seq(conn, "commits", max(r[0] for r in rows))


def write_commit_lines(conn: duckdb.DuckDBPyConnection, rows: list[tuple[Any, ...]]) -> None:
    """Insert commit lines and keep each (account, meter, price)'s latest remainder."""
    staged = _staged(rows)  # noqa: F841 (read by DuckDB below)
    conn.execute("INSERT INTO commit_lines SELECT * FROM staged")
    conn.execute(
        "INSERT INTO gate_carry SELECT c4, c5, c8, c17, arg_max(c15, c0), max(c0) FROM staged "
        "WHERE c17 IS NOT NULL GROUP BY c4, c5, c8, c17 ON CONFLICT DO UPDATE SET "
        "remainder_after = CASE WHEN excluded.seq > gate_carry.seq THEN excluded.remainder_after "
        "ELSE gate_carry.remainder_after END, seq = greatest(gate_carry.seq, excluded.seq)")
    _advance_seq(conn, "commit_lines", max(r[0] for r in rows))


def _advance_seq(conn: duckdb.DuckDBPyConnection, stream: str, seq: int) -> None:
    conn.execute(
        "INSERT INTO gate_seqs VALUES (?, ?) "
        "ON CONFLICT DO UPDATE SET last_seq = greatest(gate_seqs.last_seq, excluded.last_seq)",
        [stream, seq])


register_table("commits", write_commits)
register_table("commit_lines", write_commit_lines)


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
