"""The gate loop against the gate's rules, rule by rule: check order, validation that
must not end in a 500, commit and cancel rules, and what an Idempotency-Key stores."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.catalog_builder import CatalogBuilder
from tests.conftest import FIXTURES, Service, make_service, tollgate

pytestmark = pytest.mark.server

AUTHORIZE = "/mgt/v1/gate/authorize"
COMMITS = "/mgt/v1/gate/commits"
CANCEL = "/mgt/v1/gate/cancel"

# Accounts, principals and limits of this module's own, on top of the fixture catalog.
JAN = "2026-01-01T00:00:00Z"
EXTRA = (
    CatalogBuilder("acme")
    .feature("audit.order", "gate.units", family="gate")
    .feature("audit.rated", "gate.units", family="gate")
    # funds for 5 units of audit.order
    .account("acct_audit_order", "prepaid", principals=["audit-order-p"])
    .grant("acct_audit_order", "audit-order", 500, JAN)
    .account("acct_audit_rate", "postpaid", principals=["audit-rate-p"])
    # commits that leave carried remainders of their own
    .account("acct_audit_misc", "postpaid", principals=["audit-misc-p"])
    # nothing granted until the test grants it
    .account("acct_audit_poor", "prepaid", principals=["audit-poor-p"])
    # funds for one unit, then debts beyond 2^64 xusd
    .account("acct_audit_debt", "prepaid", principals=["audit-debt-p"])
    .grant("acct_audit_debt", "audit-debt", 100, JAN)
    # a budget, then spending beyond 2^64 xusd
    .account("acct_audit_spent", "postpaid", principals=["audit-spent-p"])
    .budget("audit-spent-budget", scope="account", accounts=["acct_audit_spent"], window="month",
            limit_xusd=1000)
    .quota("audit.order", scope="principal", window="day", limit_minor=100)
    .budget("audit-order-budget", scope="account", accounts=["acct_audit_order"], window="month",
            limit_xusd=5000)
    .rate_limit("audit.order", scope="principal", per_seconds=3600, limit=4)
    .rate_limit("audit.rated", scope="principal", per_seconds=1, limit=1)
)
# The same, and the grant that funds acct_audit_poor later.
GRANTED = EXTRA.copy().grant("acct_audit_poor", "audit-poor-late", 1_000_000, JAN)


def _catalog(tmp: Path, name: str, extra: CatalogBuilder) -> Path:
    path = tmp / name
    path.write_text((FIXTURES / "catalog.toml").read_text() + "\n" + extra.toml())
    return path


@pytest.fixture(scope="module")
def audit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("audit")
    data = tmp / "data"
    data.mkdir()
    svc = make_service(data, _catalog(tmp, "audit.toml", EXTRA))
    svc.start()
    yield svc
    svc.stop()


def authorize(svc: Service, principal: str, feature: str = "gate.unit", estimate: Any = "10",
              **kw: Any) -> httpx.Response:
    return svc.post(AUTHORIZE, {"feature_code": feature, "estimated_quantity_minor": estimate},
                    principal=principal, **kw)


def token_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["data"]["lease_token"])


def error(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json()["code"]


# ---- validation: never a 500 for client input ---------------------------------------------
def test_a_quantity_of_thousands_of_digits_is_422_not_500(service: Service) -> None:
    huge = "9" * 5000
    r = authorize(service, "gate-p", estimate=huge)
    assert error(r) == (422, "VALIDATION.INVALID_INPUT"), r.text
    assert r.json()["errors"][0]["field"] == "estimated_quantity_minor"
    token = token_of(authorize(service, "gate-p", estimate="1"))
    r = service.post(COMMITS, {"lease_token": token, "feature_code": "gate.unit", "quantity_minor": huge},
                     principal="gate-p")
    assert error(r) == (422, "VALIDATION.INVALID_INPUT"), r.text
    r = service.post(COMMITS, {"lease_token": token, "feature_code": "gate.unit", "quantity_minor": "1",
                               "meters": [{"meter_code": "gate.units", "quantity_minor": huge}]},
                     principal="gate-p")
    assert error(r) == (422, "VALIDATION.INVALID_INPUT"), r.text
    assert r.json()["errors"][0]["field"] == "meters[0].quantity_minor"
    # leading zeros do not change the value ("007" is 7): a padded small number is a number
    padded = authorize(service, "gate-p", estimate="0" * 5000 + "3")
    assert padded.status_code == 200 and padded.json()["data"]["held_quantity_minor"] == "3"


def test_a_meter_entry_without_its_quantity_is_invalid_not_the_top_level_quantity(service: Service) -> None:
    token = token_of(authorize(service, "gate-p", estimate="1"))
    for entry in ({"meter_code": "gate.units"}, {"meter_code": "gate.units", "quantity_minor": None}):
        r = service.post(COMMITS, {"lease_token": token, "feature_code": "gate.unit", "quantity_minor": "5",
                                   "meters": [entry]}, principal="gate-p")
        assert error(r) == (422, "VALIDATION.INVALID_INPUT"), r.text
        assert r.json()["errors"][0]["field"] == "meters[0].quantity_minor"
    # nor does a meter entry borrow a meter_code from the top level of the body
    r = service.post(COMMITS, {"lease_token": token, "feature_code": "gate.unit", "quantity_minor": "5",
                               "meter_code": "gate.units",
                               "meters": [{"meter_code": None, "quantity_minor": "5"}]}, principal="gate-p")
    assert error(r) == (422, "VALIDATION.INVALID_INPUT"), r.text
    assert r.json()["errors"][0] == {"field": "meters[0].meter_code", "code": "VALIDATION.REQUIRED",
                                     "message": "meter_code is required"}
    # and the lease was not charged: it still commits once, at its own quantity
    r = service.post(COMMITS, {"lease_token": token, "feature_code": "gate.unit", "quantity_minor": "1"},
                     principal="gate-p")
    assert r.status_code == 200 and r.json()["data"]["amount_xusd"] == "100"


# ---- authorize: the order of the checks ---------------------------------------------------
def test_authorize_checks_run_in_contract_order(audit: Service) -> None:
    p, f = "audit-order-p", "audit.order"   # quota 100/day, budget 5,000/month, funds 500, 4 calls/hour
    # quota before budget and funding: 101 units break all three
    quota = authorize(audit, p, feature=f, estimate="101")
    assert error(quota) == (402, "QUOTA.EXHAUSTED")
    assert quota.json()["hints"] == [{"type": "quota.remaining", "max_quantity_minor": 100}]
    # budget before funding: 60 units (6,000 xusd) break both
    budget = authorize(audit, p, feature=f, estimate="60")
    assert error(budget) == (402, "BUDGET.EXHAUSTED")
    assert budget.json()["hints"] == [{"type": "budget.shortfall", "budget_id": "audit-order-budget",
                                       "shortfall_xusd": 1000}]
    funding = authorize(audit, p, feature=f, estimate="10")
    assert error(funding) == (402, "FUNDING.INSUFFICIENT")
    assert funding.json()["hints"] == [{"type": "funding.xusd_shortfall", "shortfall_xusd": 500}]
    # a feature check comes before the rate limit, which comes before every 402
    for _ in range(6):
        r = authorize(audit, p, feature=f, estimate="101")
        if r.status_code == 429:
            break
        assert error(r) == (402, "QUOTA.EXHAUSTED")
    assert error(r) == (429, "LIMIT.RATE_EXCEEDED")
    assert int(r.headers["retry-after"]) >= 1
    assert [h["type"] for h in r.json()["hints"]] == ["rate.limit"]
    wrong_family = audit.post(AUTHORIZE, {"feature_code": f, "feature_family_code": "llm",
                                          "estimated_quantity_minor": "1"}, principal=p)
    assert error(wrong_family) == (422, "RESOURCE.NOT_FOUND")


def test_an_estimate_priced_past_the_ledger_is_refused_by_quota_and_budget_first(service: Service) -> None:
    huge = str(2**63 - 1)                       # at 100 xusd a unit, beyond a BIGINT of xusd
    # gate.quota allows 100 units a day: the quota (check 3) answers, whatever the price
    r = authorize(service, "quota-p", feature="gate.quota", estimate=huge)
    assert error(r) == (402, "QUOTA.EXHAUSTED"), r.text
    assert r.json()["hints"][0]["type"] == "quota.remaining"
    # acct_gate_budget has a budget of 10,000 xusd a month: the budget (check 4) answers
    r = authorize(service, "budget-p", estimate=huge)
    assert error(r) == (402, "BUDGET.EXHAUSTED"), r.text
    assert r.json()["hints"][0]["shortfall_xusd"] == 2**63 - 1       # clamped to signed 64-bit


# ---- commit ------------------------------------------------------------------------------
def test_commit_replay_with_keys_reordered_is_the_first_result(audit: Service) -> None:
    token = token_of(authorize(audit, "audit-misc-p", feature="gate.rounding", estimate="10"))
    body = {"lease_token": token, "feature_code": "gate.rounding", "quantity_minor": "1500",
            "meters": [{"meter_code": "gate.floor", "quantity_minor": "1000"},
                       {"meter_code": "gate.ceil", "quantity_minor": "500"}], "labels": {"a": "1", "b": "2"}}
    first = audit.post(COMMITS, body, principal="audit-misc-p")
    assert first.status_code == 200, first.text
    data = first.json()["data"]
    assert set(data) >= {"commit_id", "amount_xusd", "lines", "balance_xusd"}
    for line in data["lines"]:
        assert set(line) >= {"line_id", "meter_code", "quantity_minor", "unit_price_xusd",
                             "unit_quantity_minor", "amount_xusd", "pricing_fingerprint"}
        assert line["pricing_fingerprint"]
    reordered = {"labels": {"b": "2", "a": "1"},
                 "meters": [{"quantity_minor": "1000", "meter_code": "gate.floor"},
                            {"quantity_minor": "500", "meter_code": "gate.ceil"}],
                 "quantity_minor": "1500", "feature_code": "gate.rounding", "lease_token": token}
    again = audit.post(COMMITS, reordered, principal="audit-misc-p")
    assert again.status_code == 200 and again.json()["data"] == data
    swapped = {**body, "meters": list(reversed(body["meters"]))}       # array order is part of JSON
    assert error(audit.post(COMMITS, swapped, principal="audit-misc-p")) == (409, "LEASE.ALREADY_COMMITTED")


def test_commit_through_the_lease_alias_with_an_unpriced_meter(service: Service) -> None:
    token = token_of(authorize(service, "gate-p", estimate="1"))
    # A null lease_token (a client that fills every field of its model) defers to the alias.
    r = service.post(COMMITS, {"lease_token": None, "lease": token, "feature_code": "gate.unit",
                               "quantity_minor": "3",
                               "meters": [{"meter_code": "gate.unpriced", "quantity_minor": "3"}]},
                     principal="gate-p")
    assert r.status_code == 200, r.text
    assert r.json()["data"]["amount_xusd"] == "0"
    assert r.json()["data"]["lines"][0]["amount_xusd"] == "0"
    assert r.json()["hints"] == [{"type": "pricing.not_configured", "feature_code": "gate.unit",
                                  "meters": ["gate.unpriced"]}]
    cancel = service.post(CANCEL, {"lease": token}, principal="gate-p").json()["data"]
    assert cancel["cancelled"] is False and cancel["state"] == "committed" and cancel["released_cap"] == "0"


# ---- Idempotency-Key: what is stored -------------------------------------------------------
def test_a_429_under_a_key_is_not_stored_and_the_key_works_once_the_limit_resets(audit: Service) -> None:
    p, f = "audit-rate-p", "audit.rated"                           # 1 call a second
    for _ in range(5):
        key = f"rate-{uuid.uuid4()}"
        authorize(audit, p, feature=f, estimate="1")               # takes this second's call
        limited = authorize(audit, p, feature=f, estimate="1", idempotency_key=key)
        if limited.status_code == 429:
            break
    assert error(limited) == (429, "LIMIT.RATE_EXCEEDED")
    time.sleep(int(limited.headers["retry-after"]) + 0.05)
    for _ in range(5):
        later = authorize(audit, p, feature=f, estimate="1", idempotency_key=key)
        if later.status_code != 429:
            break
        time.sleep(int(later.headers["retry-after"]) + 0.05)
    assert later.status_code == 200 and "idempotent-replayed" not in later.headers
    time.sleep(1.05)
    replay = authorize(audit, p, feature=f, estimate="1", idempotency_key=key)
    assert replay.status_code == 200 and replay.headers.get("idempotent-replayed") == "true"
    assert replay.json()["data"]["lease_token"] == later.json()["data"]["lease_token"]


def test_a_402_under_a_key_is_replayed_after_funds_appear(audit: Service, tmp_path: Path) -> None:
    key = f"poor-{uuid.uuid4()}"
    refused = authorize(audit, "audit-poor-p", estimate="3", idempotency_key=key)
    assert error(refused) == (402, "FUNDING.INSUFFICIENT")
    tollgate("catalog", "apply", str(_catalog(tmp_path, "granted.toml", GRANTED)),
             data_dir=audit.data_dir)
    deadline = time.monotonic() + 5
    while authorize(audit, "audit-poor-p", estimate="3").status_code != 200:
        assert time.monotonic() < deadline, "the grant was not picked up"
        time.sleep(0.1)
    replay = authorize(audit, "audit-poor-p", estimate="3", idempotency_key=key)
    assert replay.status_code == 402 and replay.headers.get("idempotent-replayed") == "true"
    assert replay.json()["code"] == "FUNDING.INSUFFICIENT" and replay.json()["hints"] == refused.json()["hints"]
    # the key's scope is (realm, principal, endpoint, key): on cancel it is another record
    other = audit.post(CANCEL, {"lease_token": "tgl_unknown"}, principal="audit-poor-p", idempotency_key=key)
    assert error(other) == (422, "LEASE.NOT_FOUND") and "idempotent-replayed" not in other.headers


# ---- money beyond 64 bits ------------------------------------------------------------------
def test_a_shortfall_beyond_64_bits_is_a_402_and_the_service_lives_on(fresh_service: Service,
                                                                      tmp_path: Path) -> None:
    # Commits are never refused for funds, so an account's debt (or its spending against a
    # budget) may pass 2^64 xusd in three commits of just under 2^63. The refusal that
    # follows must still be a 402 with its hint, not the end of the writer process.
    svc = fresh_service
    tollgate("catalog", "apply", str(_catalog(tmp_path, "audit.toml", EXTRA)), data_dir=svc.data_dir)
    svc.start()
    most = str((2**63 - 1) // 100)                                 # gate.unit: 100 xusd a unit
    for principal, code, hint in (("audit-debt-p", "FUNDING.INSUFFICIENT", "funding.xusd_shortfall"),
                                  ("audit-spent-p", "BUDGET.EXHAUSTED", "budget.shortfall")):
        tokens = [token_of(authorize(svc, principal, estimate="0")) for _ in range(3)]
        for token in tokens:
            r = svc.post(COMMITS, {"lease_token": token, "feature_code": "gate.unit", "quantity_minor": most},
                         principal=principal)
            assert r.status_code == 200, r.text
        refused = authorize(svc, principal, estimate="1")
        assert error(refused) == (402, code), refused.text
        assert refused.json()["hints"][0]["type"] == hint
        assert refused.json()["hints"][0]["shortfall_xusd"] == 2**63 - 1   # clamped to signed 64-bit
        assert authorize(svc, "gate-p", estimate="1").status_code == 200   # the writer is still there
    svc.stop()
