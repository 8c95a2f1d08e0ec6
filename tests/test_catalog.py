"""The catalog: the example shape loads, faults are all named with paths, apply is atomic and
picked up by a running server within 2 s (the catalog's shape; docs/architecture.md)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pipelines.catalog import CatalogInvalid, load_catalog
from tests.catalog_builder import CatalogBuilder, Raw
from tests.conftest import FIXTURES, Service, tollgate

EXAMPLE = Path(__file__).resolve().parents[1] / "cli" / "demo" / "catalog.toml"


def test_the_example_catalog_loads_with_every_section() -> None:
    catalog = load_catalog(EXAMPLE.read_text())
    acme = catalog.realms["acme"]
    assert acme.principal_account == {"team-a": "acct_prepaid", "team-b": "acct_prepaid", "team-c": "acct_postpaid"}
    assert acme.accounts["acct_prepaid"].grants[0].amount_xusd == 5_000_000
    assert acme.features["llm.chat"].lease_ttl_seconds == 600
    assert acme.lease_ttl(acme.features["api.search"]) == 900
    assert {p.meter for p in acme.prices} == {"llm.input_tokens", "llm.output_tokens", "api.calls"}
    assert acme.quotas[0].limit_minor == 2_000_000
    assert acme.budgets[0].accounts == ("acct_postpaid",)
    assert acme.rate_limits[0].limit == 100
    assert [v.version for v in acme.policies["llm-completions"].versions] == ["2026-01"]
    assert acme.policies["daily-peak-seats"].versions[0].document["engine"] == "aggregate"


BAD = (CatalogBuilder("acme")
       .account("a1", "prepay", credit_limit_xusd=Raw("5"), principals=["p1"])
       .account("a2", "postpaid", principals=["p1"])
       .meter("m.one")
       .feature("f.one", "m.missing")
       .price("m.one", "1.5", "yesterday", rounding="up")
       .policy("p", ("1", "2026-01-01T00:00:00Z", {"dsl_version": "v2", "engine": "single",
                                                   "match": {"event_type": "x"}, "emit": {"intents": []}}))
       .toml())


def test_an_invalid_catalog_names_every_fault_with_its_path() -> None:
    with pytest.raises(CatalogInvalid) as info:
        load_catalog(BAD)
    paths = {f.path for f in info.value.faults}
    assert "realms.acme.accounts.a1.funding" in paths
    assert "realms.acme.accounts.a1.credit_limit_xusd" in paths
    assert "realms.acme.accounts.a2.principals[0]" in paths  # p1 already in a1
    assert "realms.acme.features.f.one.primary_meter" in paths
    assert "realms.acme.prices[0].unit_price_xusd" in paths
    assert "realms.acme.prices[0].rounding" in paths
    assert "realms.acme.prices[0].effective_at" in paths
    assert any(p.startswith("realms.acme.policies[0].versions[0].dsl_json") for p in paths)


@pytest.mark.lake
def test_check_and_apply_from_the_cli_refuse_an_invalid_catalog_whole(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD)
    checked = tollgate("catalog", "check", str(bad), data_dir=tmp_path, check=False)
    assert checked.returncode == 1 and "realms.acme.prices[0].rounding" in checked.stderr
    applied = tollgate("catalog", "apply", str(bad), data_dir=tmp_path, check=False)
    assert applied.returncode == 1
    assert not (tmp_path / "catalog" / "current.toml").exists()
    good = tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=tmp_path)
    assert "applied" in good.stdout


@pytest.mark.lake
def test_a_grant_id_cannot_come_back_with_another_amount(tmp_path: Path) -> None:
    tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=tmp_path)
    changed = tmp_path / "changed.toml"
    changed.write_text((FIXTURES / "catalog.toml").read_text().replace('amount_xusd = "5000000"', 'amount_xusd = "9000000"'))
    r = tollgate("catalog", "apply", str(changed), data_dir=tmp_path, check=False)
    assert r.returncode == 1 and "welcome-2026-11" in r.stderr
    # re-applying the same catalog is fine (grants are idempotent by id)
    assert tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=tmp_path).returncode == 0


def test_apply_is_picked_up_by_a_running_server_within_two_seconds(service: Service, tmp_path: Path) -> None:
    extra = tmp_path / "extra.toml"
    extra.write_text((FIXTURES / "catalog.toml").read_text() + "\n"
                     + CatalogBuilder().account("acct_late", "postpaid", principals=["team-late"]).toml())
    body = {"semantic_kind": "activity", "event_type": "catalog.check", "occurred_at": "2026-11-20T10:00:00Z"}
    assert service.post("/mgt/v1/events", body, account="acct_late").status_code == 422
    tollgate("catalog", "apply", str(extra), data_dir=service.data_dir)
    deadline = time.monotonic() + 2.5
    while service.post("/mgt/v1/events", body, account="acct_late").status_code != 201:
        assert time.monotonic() < deadline, "catalog not picked up within 2 s"
        time.sleep(0.1)


def _with(extra: CatalogBuilder) -> str:
    """The example catalog with `extra` added at its end."""
    return EXAMPLE.read_text() + "\n" + extra.toml()


def _welcome(account: str, amount_xusd: int = 5_000_000) -> CatalogBuilder:
    """The grant welcome-2026-11 of the example and the fixture, given to `account`."""
    return CatalogBuilder().grant(account, "welcome-2026-11", amount_xusd, "2026-11-01T00:00:00Z")


def test_rules_that_used_to_crash_or_slip_through_are_faults_with_their_paths() -> None:
    text = EXAMPLE.read_text()
    cases = {
        # a non-string family crashed the loader (unhashable list)
        "realms.acme.features.llm.chat.family": text.replace('family = "llm"', 'family = ["llm"]'),
        # an offset that takes the instant out of range crashed it (OverflowError)
        "realms.acme.accounts.acct_prepaid.grants[0].effective_at":
            text.replace('effective_at = "2026-11-01T00:00:00Z"', 'effective_at = "0001-01-01T00:00:00+01:00"'),
        # the ledger keys grants by (realm, id): a second account's grant would never be booked
        "realms.acme.accounts.acct_postpaid.grants[0].id": _with(_welcome("acct_postpaid", 1)),
        # two rate limits with one id would share the limiter's counters
        "realms.acme.rate_limits[1].id": _with(CatalogBuilder().rate_limit(
            "api.search", id="rate-0-api.search", per_seconds=60, limit=5)),
        "realms.acme.quotas[0].id": text.replace('id = "llm-chat-daily-tokens"', 'id = 5'),
        # two versions of a policy at one instant: which rates an event is ambiguous
        "realms.acme.policies[1].versions[1].effective_at": _with(CatalogBuilder().version(
            "daily-peak-seats", "v2", "2026-01-01T00:00:00Z", {
                "dsl_version": "v1", "engine": "aggregate", "match": {"event_type": "seats.snapshot"},
                "emit": {"intents": [{"feature_code": "api.search", "meters": [{"meter_code": "api.calls",
                         "quantity_minor": {"agg": {"op": "max", "of": {"payload": "seats"}, "default": 1}}}]}]}})),
        # price ids are to the second (the carry's key): two rows in one second would share one
        "realms.acme.prices[3]": _with(CatalogBuilder().price("api.calls", 1, "2026-01-01T00:00:00.5Z")),
        # a TTL that overflows the clock answered every authorize with a 500
        "realms.acme.features.llm.chat.lease_ttl_seconds":
            text.replace("lease_ttl_seconds = 600", "lease_ttl_seconds = 300000000000"),
        "realms.acme.meters.api.calls.unit": text.replace('unit = "request"', "unit = 5"),
        "realms.acme.families.llm.color": text.replace("[realms.acme.families.llm]", '[realms.acme.families.llm]\ncolor = "red"'),
    }
    for path, document in cases.items():
        with pytest.raises(CatalogInvalid) as info:
            load_catalog(document)
        assert path in {f.path for f in info.value.faults}, (path, [str(f) for f in info.value.faults])


@pytest.mark.lake
def test_a_grant_id_applied_in_any_earlier_catalog_cannot_change_or_move(tmp_path: Path) -> None:
    fixture = (FIXTURES / "catalog.toml").read_text()
    grant = _welcome("acct_prepaid").toml()
    assert grant in fixture
    tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=tmp_path)
    without = tmp_path / "without.toml"
    without.write_text(fixture.replace(grant, ""))
    assert tollgate("catalog", "apply", str(without), data_dir=tmp_path).returncode == 0
    # the ledger still holds 5 USD under this id: 9 USD must not be accepted (and ignored)
    changed = tmp_path / "changed.toml"
    changed.write_text(fixture.replace('amount_xusd = "5000000"', 'amount_xusd = "9000000"'))
    r = tollgate("catalog", "apply", str(changed), data_dir=tmp_path, check=False)
    assert r.returncode == 1 and "welcome-2026-11" in r.stderr
    moved = tmp_path / "moved.toml"
    moved.write_text(fixture.replace(grant, "") + "\n" + _welcome("acct_postpaid").toml())
    r = tollgate("catalog", "apply", str(moved), data_dir=tmp_path, check=False)
    assert r.returncode == 1 and "applied before to account 'acct_prepaid'" in r.stderr
    assert tollgate("catalog", "apply", str(FIXTURES / "catalog.toml"), data_dir=tmp_path).returncode == 0
