"""The applied catalog's history in the lake: one row per apply, one set of detail rows per
catalog fingerprint.

`tollgate catalog apply` appends a `lake.catalog_versions` row (fingerprint, applied_at,
source) on every apply, so the row of the latest `applied_at` names the catalog in force and
when it was applied, also after going back to an earlier catalog. The detail rows (`catalog_prices`,
`catalog_policy_versions`, `catalog_features`) are written once per fingerprint: a
fingerprint recorded before appends only its `catalog_versions` row.

The catalog comes in duck-typed (the shapes of `pipelines.catalog`, described by the
protocols below): storage does not import the domain.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import duckdb

from core.clock import SYSTEM_CLOCK, Clock
from warehouse.lake import connect_lake, transaction, with_lake_retry

__all__ = ["CatalogRows", "catalog_rows", "record_catalog"]


class _Price(Protocol):
    @property
    def price_id(self) -> str: ...
    @property
    def meter(self) -> str: ...
    @property
    def unit_price_xusd(self) -> int: ...
    @property
    def unit_quantity_minor(self) -> int: ...
    @property
    def rounding(self) -> str: ...
    @property
    def effective_at(self) -> datetime: ...


class _PolicyVersion(Protocol):
    @property
    def version(self) -> str: ...
    @property
    def effective_at(self) -> datetime: ...
    @property
    def dsl_json(self) -> str: ...
    @property
    def document(self) -> Mapping[str, Any]: ...


class _Policy(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def versions(self) -> Iterable[_PolicyVersion]: ...


class _Feature(Protocol):
    @property
    def code(self) -> str: ...
    @property
    def family(self) -> str | None: ...
    @property
    def primary_meter(self) -> str: ...
    @property
    def meters(self) -> Iterable[str]: ...


class _Realm(Protocol):
    @property
    def prices(self) -> Iterable[_Price]: ...
    @property
    def policies(self) -> Mapping[str, _Policy]: ...
    @property
    def features(self) -> Mapping[str, _Feature]: ...


class _Catalog(Protocol):
    @property
    def fingerprint(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def realms(self) -> Mapping[str, _Realm]: ...


CatalogRows = dict[str, list[tuple[Any, ...]]]


def catalog_rows(catalog: _Catalog, applied_at: datetime) -> CatalogRows:
    """The lake rows of one catalog, by table. `source` keeps the applied TOML document."""
    fp = catalog.fingerprint
    rows: CatalogRows = {"catalog_versions": [(fp, applied_at, catalog.source)],
                         "catalog_prices": [], "catalog_policy_versions": [], "catalog_features": []}
    for realm_id, realm in sorted(catalog.realms.items()):
        for p in realm.prices:
            rows["catalog_prices"].append((fp, realm_id, p.meter, p.price_id, p.unit_price_xusd,
                                           p.unit_quantity_minor, p.rounding, p.effective_at))
        for policy_id, policy in sorted(realm.policies.items()):
            for v in policy.versions:
                rows["catalog_policy_versions"].append(
                    (fp, realm_id, policy_id, v.version, v.document.get("engine"), v.effective_at,
                     v.dsl_json))
        for code, f in sorted(realm.features.items()):
            rows["catalog_features"].append((fp, realm_id, code, f.family, f.primary_meter,
                                             list(f.meters)))
    return rows


def record_catalog(data_dir: Path, catalog: _Catalog, *, applied_at: datetime | None = None,
                   clock: Clock = SYSTEM_CLOCK) -> bool:
    """Record one apply of the catalog in the lake, in one transaction: its `catalog_versions`
    row always, its detail rows when its fingerprint is new. False when the fingerprint was
    recorded before (only the `catalog_versions` row is written then)."""
    rows = catalog_rows(catalog, applied_at or clock.now())
    conn = connect_lake(data_dir)
    try:
        return with_lake_retry(lambda: _append(conn, catalog.fingerprint, rows))
    finally:
        conn.close()


def _append(conn: duckdb.DuckDBPyConnection, fingerprint: str, rows: CatalogRows) -> bool:
    with transaction(conn):
        seen = conn.execute("SELECT count(*) FROM lake.catalog_versions WHERE fingerprint = ?",
                            [fingerprint]).fetchone()
        new = not (seen and seen[0])
        for table, table_rows in rows.items():
            if table_rows and (new or table == "catalog_versions"):
                marks = ", ".join("?" * len(table_rows[0]))
                conn.executemany(f"INSERT INTO lake.{table} VALUES ({marks})", table_rows)
    return new


def latest_catalog_source(conn: duckdb.DuckDBPyConnection) -> str | None:
    """The text of the catalog applied last, from the lake attached to `conn` as `lake`
    (None before the first apply)."""
    # On a cursor closed at once: a read of DuckLake's SQLite catalog otherwise keeps a lock
    # on it until the connection's next statement, and other processes' commits fail.
    cursor = conn.cursor()
    try:
        row = cursor.execute("SELECT source FROM lake.catalog_versions"
                             " ORDER BY applied_at DESC, fingerprint LIMIT 1").fetchone()
    finally:
        cursor.close()
    return None if row is None else str(row[0])
