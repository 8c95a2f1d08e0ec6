"""`tollgate catalog apply` records every apply in the lake, and each catalog's detail rows
once per fingerprint."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import duckdb
import pytest

from pipelines.catalog import load_catalog
from tests.catalog_builder import CatalogBuilder
from tests.conftest import FIXTURES, tollgate
from warehouse.catalog_history import record_catalog
from warehouse.lake import connect_lake

pytestmark = pytest.mark.lake

JAN = datetime(2026, 1, 1, tzinfo=timezone.utc)
TABLES = ("catalog_versions", "catalog_prices", "catalog_policy_versions", "catalog_features")


class Lake:
    """A read-only view of the lake, opened on first use (it sees each new commit)."""

    def __init__(self) -> None:
        self.conn: duckdb.DuckDBPyConnection | None = None

    def __call__(self, data_dir: Path, sql: str) -> list[tuple[Any, ...]]:
        if self.conn is None:
            self.conn = connect_lake(data_dir, read_only=True)
        return self.conn.execute(sql).fetchall()


@pytest.fixture()
def lake() -> Iterator[Lake]:
    reader = Lake()
    yield reader
    if reader.conn is not None:
        reader.conn.close()


def counts(lake: Lake, data_dir: Path) -> dict[str, int]:
    return {t: lake(data_dir, f"SELECT count(*) FROM lake.{t}")[0][0] for t in TABLES}


def micros(moment: datetime) -> int:
    return int(moment.timestamp()) * 1_000_000 + moment.microsecond


def fingerprint_of(out: str) -> str:
    return out.split()[1]


def test_an_applied_catalog_appears_in_the_lake_and_reapplying_it_adds_only_its_apply(
        tmp_path: Path, lake: Lake) -> None:
    text = (FIXTURES / "catalog.toml").read_text()
    out = tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=tmp_path).stdout
    fp = fingerprint_of(out)
    assert "warning" not in out

    catalog = load_catalog(text)
    assert catalog.fingerprint == fp
    versions = lake(tmp_path, "SELECT fingerprint, source, applied_at FROM lake.catalog_versions")
    assert [(v[0], v[1]) for v in versions] == [(fp, text)]
    assert abs((datetime.now(timezone.utc) - versions[0][2]).total_seconds()) < 60

    realms = catalog.realms.items()
    assert set(lake(tmp_path, "SELECT realm, meter_code, price_id, unit_price_xusd, unit_quantity_minor, "
                    "rounding, epoch_us(effective_at) FROM lake.catalog_prices")) == {
        (r, p.meter, p.price_id, p.unit_price_xusd, p.unit_quantity_minor, p.rounding, micros(p.effective_at))
        for r, realm in realms for p in realm.prices}
    assert ("acme", "api.calls", "api.calls@2026-01-01T00:00:00Z", 2000, 1, "floor", micros(JAN)) in set(
        lake(tmp_path, "SELECT realm, meter_code, price_id, unit_price_xusd, unit_quantity_minor, rounding, "
             "epoch_us(effective_at) FROM lake.catalog_prices"))
    assert set(lake(tmp_path, "SELECT realm, policy_id, version, engine, epoch_us(effective_at), dsl_json "
                    "FROM lake.catalog_policy_versions")) == {
        (r, pid, v.version, v.document["engine"], micros(v.effective_at), v.dsl_json)
        for r, realm in realms for pid, pol in realm.policies.items() for v in pol.versions}
    assert ("acme", "llm-completions", "2026-01", "single") in {
        row[:4] for row in lake(tmp_path, "SELECT realm, policy_id, version, engine FROM lake.catalog_policy_versions")}
    features = lake(tmp_path, "SELECT realm, feature_code, family, primary_meter, meters FROM "
                    "lake.catalog_features ORDER BY realm, feature_code")
    assert features == sorted((r, code, f.family, f.primary_meter, list(f.meters))
                              for r, realm in realms for code, f in realm.features.items())
    assert ("acme", "llm.chat", "llm", "llm.input_tokens", ["llm.input_tokens", "llm.output_tokens"]) in features
    assert all(r == (fp,) for t in TABLES for r in lake(tmp_path, f"SELECT DISTINCT fingerprint FROM lake.{t}"))

    before = counts(lake, tmp_path)
    again = tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=tmp_path).stdout
    assert fingerprint_of(again) == fp
    assert counts(lake, tmp_path) == before | {"catalog_versions": 2}


def second_catalog(tmp_path: Path) -> Path:
    """The fixture catalog with one more api.calls price, from 2026-12-01."""
    second = tmp_path / "second.toml"
    second.write_text((FIXTURES / "catalog.toml").read_text() + "\n" + CatalogBuilder().price(
        "api.calls", 2500, "2026-12-01T00:00:00Z", unit_quantity_minor=1, rounding="ceil").toml())
    return second


def test_each_new_fingerprint_appends_one_set_of_rows(tmp_path: Path, lake: Lake) -> None:
    first = FIXTURES / "catalog.toml"
    second = second_catalog(tmp_path)
    fp1 = fingerprint_of(tollgate("catalog", "apply", str(first), data_dir=tmp_path).stdout)
    fp2 = fingerprint_of(tollgate("catalog", "apply", str(second), data_dir=tmp_path).stdout)
    tollgate("catalog", "apply", str(first), data_dir=tmp_path)  # back to the first: no new prices
    assert fp1 != fp2
    prices = sum(len(r.prices) for r in load_catalog(first.read_text()).realms.values())
    assert lake(tmp_path, "SELECT fingerprint, count(*) FROM lake.catalog_prices GROUP BY ALL ORDER BY 2") == [
        (fp1, prices), (fp2, prices + 1)]
    assert lake(tmp_path, "SELECT count(*), count(DISTINCT fingerprint) FROM lake.catalog_versions") == [(3, 2)]
    # The price in force for api.calls on 2026-12-15 under the second catalog:
    assert lake(tmp_path, f"""
        SELECT unit_price_xusd FROM lake.catalog_prices
        WHERE fingerprint = '{fp2}' AND meter_code = 'api.calls' AND effective_at <= '2026-12-15'
        ORDER BY effective_at DESC LIMIT 1""") == [(2500,)]


def test_going_back_to_a_catalog_records_when_it_came_back_into_force(tmp_path: Path, lake: Lake) -> None:
    a = load_catalog((FIXTURES / "catalog.toml").read_text())
    b = load_catalog(second_catalog(tmp_path).read_text())
    t1, t2, t3 = (datetime(2026, 11, day, tzinfo=timezone.utc) for day in (1, 2, 3))
    assert record_catalog(tmp_path, a, applied_at=t1) is True
    assert record_catalog(tmp_path, b, applied_at=t2) is True
    assert record_catalog(tmp_path, a, applied_at=t3) is False       # detail rows known already
    assert lake(tmp_path, "SELECT fingerprint, applied_at FROM lake.catalog_versions ORDER BY applied_at") == [
        (a.fingerprint, t1), (b.fingerprint, t2), (a.fingerprint, t3)]
    prices = sum(len(r.prices) for r in a.realms.values())
    assert lake(tmp_path, "SELECT fingerprint, count(*) FROM lake.catalog_prices GROUP BY ALL ORDER BY 2") == [
        (a.fingerprint, prices), (b.fingerprint, prices + 1)]
    # The catalog in force at a moment: the latest apply at or before it.
    in_force = """SELECT arg_max(fingerprint, applied_at) FROM lake.catalog_versions
                  WHERE applied_at <= TIMESTAMPTZ '{}'"""
    assert lake(tmp_path, in_force.format("2026-11-02 12:00:00+00")) == [(b.fingerprint,)]
    assert lake(tmp_path, in_force.format("2026-11-03 12:00:00+00")) == [(a.fingerprint,)]


def test_an_invalid_catalog_records_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(CatalogBuilder().feature("x", "nope").toml())
    result = tollgate("catalog", "apply", str(bad), data_dir=tmp_path, check=False)
    assert result.returncode == 1
    assert not (tmp_path / "lake" / "catalog.sqlite").exists()


def test_flows_rate_under_the_catalog_the_lake_recorded_last(tmp_path: Path) -> None:
    import shutil

    from flows.workspace import applied_catalog
    from warehouse.catalog_store import CatalogStore

    def in_force() -> str:
        conn = connect_lake(tmp_path)
        try:
            return applied_catalog(tmp_path, conn).fingerprint
        finally:
            conn.close()

    first = (FIXTURES / "catalog.toml").read_text()
    second = first.replace('unit_price_xusd = "150"', 'unit_price_xusd = "175"', 1)
    CatalogStore(tmp_path / "catalog").apply(first, load_catalog(first).fingerprint)
    assert in_force() == load_catalog(first).fingerprint  # nothing in the lake yet: the file
    for text in (second, first, second):
        path = tmp_path / "apply.toml"
        path.write_text(text)
        tollgate("catalog", "apply", str(path), data_dir=tmp_path)
        assert in_force() == load_catalog(text).fingerprint
    shutil.rmtree(tmp_path / "catalog")  # a flow worker without the service's folder
    assert in_force() == load_catalog(second).fingerprint


def test_a_catalog_the_lake_cannot_record_is_not_applied(tmp_path: Path) -> None:
    from warehouse.catalog_store import CatalogStore

    (tmp_path / "lake").mkdir()
    (tmp_path / "lake" / "catalog.sqlite").write_text("not a database")  # the lake is unusable
    done = tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=tmp_path, check=False)
    assert done.returncode != 0 and "not applied" in done.stdout + done.stderr
    assert CatalogStore(tmp_path / "catalog").read() is None
