"""The catalog builder of the tests and benchmarks: what it builds is what `load_catalog`
reads back, and it writes the invalid values a fault test needs."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from pipelines.catalog import CatalogInvalid, load_catalog
from tests.catalog_builder import CatalogBuilder, Raw, Value

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "catalog.toml"
JAN = "2026-01-01T00:00:00Z"
CALLS = {"dsl_version": "v1", "engine": "single", "match": {"event_type": "api.call"},
         "emit": {"intents": [{"feature_code": "api.search", "meters": [
             {"meter_code": "api.calls", "quantity_minor": {"const": 1}}]}]}}


def test_every_section_round_trips_through_the_loader() -> None:
    text = (CatalogBuilder("acme")
            .settings(lease_ttl_seconds=600, lateness_allowance_seconds=3600)
            .account("acct_a", "prepaid", credit_limit_xusd=0, principals=["team-a", "team-b"])
            .grant("acct_a", "welcome", 5_000_000, "2026-11-01T00:00:00Z")
            .account("acct_b", "postpaid", principals=["team-c"])
            .family("api")
            .meter("api.calls", "request")
            .meter("seats")
            .feature("api.search", "api.calls", family="api", lease_ttl_seconds=60)
            .feature("team.seats", "seats", active=False)
            .price("api.calls", 2000, JAN, unit_quantity_minor=1, rounding="ceil")
            .quota("api.search", scope="principal", window="day", limit_minor=2_000_000)
            .budget("cap", scope="account", window="month", limit_xusd=50_000_000, accounts=["acct_b"])
            .rate_limit("api.search", scope="account", per_seconds=1, limit=100, id="searches")
            .policy("calls", ("v1", JAN, CALLS))
            .version("calls", "v2", "2026-11-01T00:00:00Z", CALLS)
            .realm("globex")
            .account("acct_g", "postpaid", principals=["team-g"])
            .toml())
    catalog = load_catalog(text)
    acme, globex = catalog.realms["acme"], catalog.realms["globex"]
    assert list(catalog.realms) == ["acme", "globex"]
    assert (acme.settings.lease_ttl_seconds, acme.settings.lateness_allowance_seconds) == (600, 3600)
    assert acme.principal_account == {"team-a": "acct_a", "team-b": "acct_a", "team-c": "acct_b"}
    assert acme.accounts["acct_a"].grants[0].amount_xusd == 5_000_000
    assert acme.accounts["acct_a"].funding == "prepaid" and acme.accounts["acct_b"].funding == "postpaid"
    assert acme.families == {"api"}
    assert acme.meters["seats"].unit == "unit"  # left out: the loader's default
    assert acme.features["api.search"].family == "api" and acme.features["api.search"].lease_ttl_seconds == 60
    assert acme.features["team.seats"].active is False
    assert [(p.price_id, p.unit_price_xusd, p.rounding) for p in acme.prices] == [
        ("api.calls@2026-01-01T00:00:00Z", 2000, "ceil")]
    assert acme.quotas[0].limit_minor == 2_000_000 and acme.quotas[0].quota_id == "quota-0-api.search"
    assert acme.budgets[0].accounts == ("acct_b",) and acme.budgets[0].limit_xusd == 50_000_000
    assert (acme.rate_limits[0].rate_limit_id, acme.rate_limits[0].scope) == ("searches", "account")
    assert [v.version for v in acme.policies["calls"].versions] == ["v1", "v2"]
    assert acme.policies["calls"].versions[0].document == CALLS
    assert globex.principal_account == {"team-g": "acct_g"}


def test_invalid_values_are_written_as_given_and_faulted_with_their_paths() -> None:
    text = (CatalogBuilder("acme")
            .account("a1", "prepay", credit_limit_xusd=Raw("5"))
            .family("llm", color="red")
            .meter("m.one")
            .price("m.one", "1.5", "yesterday", rounding="up")
            .toml())
    with pytest.raises(CatalogInvalid) as info:
        load_catalog(text)
    assert {f.path for f in info.value.faults} == {
        "realms.acme.accounts.a1.funding", "realms.acme.accounts.a1.credit_limit_xusd",
        "realms.acme.families.llm.color", "realms.acme.prices[0].unit_price_xusd",
        "realms.acme.prices[0].rounding", "realms.acme.prices[0].effective_at"}


def test_its_text_appends_to_a_document_it_adds_to() -> None:
    fixture = FIXTURE.read_text()
    grant = CatalogBuilder().grant("acct_prepaid", "welcome-2026-11", 5_000_000, "2026-11-01T00:00:00Z").toml()
    assert grant in fixture  # written the way the catalogs are written by hand
    more = CatalogBuilder().price("api.calls", 2500, "2026-12-01T00:00:00Z").toml()
    before, after = load_catalog(fixture), load_catalog(fixture + "\n" + more)
    assert after.realms["acme"].prices[:-1] == before.realms["acme"].prices
    assert after.realms["acme"].prices[-1].unit_price_xusd == 2500
    # A version of a policy the builder lacks goes to the document's last policy.
    last = list(before.realms["acme"].policies)[-1]
    version = CatalogBuilder().version(last, "v9", "2026-12-01T00:00:00Z", CALLS).toml()
    assert "[[realms.acme.policies]]" not in version
    versions = load_catalog(fixture + "\n" + version).realms["acme"].policies[last].versions
    assert [v.version for v in versions][-1] == "v9"
    with pytest.raises(KeyError):
        CatalogBuilder().policy("calls", ("v1", JAN, CALLS)).version("other", "v2", JAN, CALLS)


@pytest.mark.parametrize("value", ["plain", 'a "quoted" one', "it's", "it's \"both\" \\",
                                   "line\nbreak\ttab", "nul\x00 del\x7f", "é ∑ 😀", ""])
def test_strings_and_keys_read_back_as_written(value: str) -> None:
    keys: dict[str, Value] = {"k": value, value or "empty": [value, 1, True]}
    text = CatalogBuilder().family("f", **keys).toml()
    assert tomllib.loads(text)["realms"]["acme"]["families"]["f"] == keys
