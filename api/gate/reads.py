"""GET /mgt/v1/gate/limits and /gate/meters: what the principal in context may still use.

A feature's limits are its quotas (quantity per UTC day or month, per principal or per
account) with what commits used, what active leases hold and what is left, and its rate
limits (requests per fixed window) with the requests counted in the window open now. A
meter's view adds the price row in force and, for a prepaid account, how much of the meter
its available funds would buy. The counts come from the writer (`writer.ops.StandingOp`),
answered in queue order, so a read sees every gate call answered before it; the rate windows
come from the one place that counts them for every HTTP worker (`api.shared`).
"""

from __future__ import annotations

from datetime import date, datetime, time, timezone
from typing import Any

from litestar import Controller, Request, get

from api.envelope import Reply, ok
from api.gate.controller import gate_context
from api.gate.limits import RateLimiter, RateWindowUse, window_uses
from api.requests import read_signed
from api.runtime import Runtime
from pipelines.catalog import Feature, Quota, Realm
from pipelines.events import format_instant
from pipelines.price_index import PriceIndex, price_fingerprint
from writer.ops import QuotaUse, Standing, StandingOp

__all__ = ["LimitsController", "available_xusd", "window_bounds"]

# The official client's SubjectScope names a principal's counters "user".
_SUBJECT = {"principal": "user", "account": "account"}


def window_bounds(window: str, today: date) -> tuple[datetime, datetime]:
    """[start, end) of the UTC calendar day or month holding `today`.

    >>> [format_instant(t) for t in window_bounds("month", date(2026, 12, 5))]
    ['2026-12-01T00:00:00.000000Z', '2027-01-01T00:00:00.000000Z']
    """
    if window == "day":
        start = datetime.combine(today, time(), tzinfo=timezone.utc)
        return start, datetime.fromordinal(today.toordinal() + 1).replace(tzinfo=timezone.utc)
    first = today.replace(day=1)
    following = (first.replace(year=first.year + 1, month=1) if first.month == 12
                 else first.replace(month=first.month + 1))
    return (datetime.combine(first, time(), tzinfo=timezone.utc),
            datetime.combine(following, time(), tzinfo=timezone.utc))


def available_xusd(realm: Realm, account_id: str, standing: Standing, now: datetime) -> int:
    """What an authorize of this account could still hold: grants in force, less commits,
    plus the credit limit, less what active leases hold (as the funding check counts)."""
    account = realm.accounts[account_id]
    granted = sum(amount for _, amount, eff in standing.grants if datetime.fromisoformat(eff) <= now)
    return granted - standing.committed_xusd + account.credit_limit_xusd - standing.held_xusd


def _quota_view(quota: Quota, use: QuotaUse, today: date) -> dict[str, Any]:
    start, end = window_bounds(quota.window, today)
    return {"quota_id": quota.quota_id, "subject_scope": _SUBJECT[quota.scope], "scope": quota.scope,
            "window": quota.window, "window_start": format_instant(start), "window_end": format_instant(end),
            "limit_minor": str(quota.limit_minor), "used_minor": str(use.used_minor),
            "held_minor": str(use.held_minor),
            "remaining_minor": str(max(0, quota.limit_minor - use.used_minor - use.held_minor))}


async def _standing(request: Request[Any, Any, Any]) -> tuple[Runtime, Realm, str, str, Standing]:
    runtime: Runtime = request.app.state.runtime
    ctx, raw = await read_signed(runtime, request)
    realm, principal, account = gate_context(runtime, ctx)
    standing: Standing = await runtime.write(StandingOp(realm.id, account, principal))
    return runtime, realm, principal, account, standing


def _wanted(request: Request[Any, Any, Any], feature: Feature) -> bool:
    code = request.query_params.get("feature_code")
    family = request.query_params.get("feature_family_code")
    return (code is None or code == feature.code) and (family is None or family == feature.family)


class LimitsController(Controller):
    path = "/mgt/v1/gate"
    tags = ["gate"]

    @get("/limits", operation_id="gate_list_feature_limits")
    async def limits(self, request: Request[Any, Any, Any]) -> Reply:
        """Every active feature's quotas and rate limits, with use now, for the principal
        in context (filters: ?feature_code=, ?feature_family_code=)."""
        runtime, realm, principal, account, standing = await _standing(request)
        now = datetime.fromisoformat(standing.as_of)
        today = now.date()
        uses = {u.quota_id: u for u in standing.quotas}
        out = []
        for feature in realm.features.values():
            if not feature.active or not _wanted(request, feature):
                continue
            quotas = [_quota_view(q, uses[q.quota_id], today) for q in realm.quotas
                      if q.feature == feature.code and q.quota_id in uses]
            rates = [{"rate_limit_id": w.rate_limit_id, "subject_scope": _SUBJECT[w.scope], "scope": w.scope,
                      "window_start": format_instant(w.window_start), "window_end": format_instant(w.window_end),
                      "limit_minor": str(w.limit), "used_minor": str(w.used),
                      "remaining_minor": str(max(0, w.limit - w.used))}
                     for w in await _rate_windows(runtime, realm, feature.code, principal, account, now)]
            meter = realm.meters.get(feature.primary_meter)
            out.append({"feature_code": feature.code, "feature_family_code": feature.family,
                        "unit": meter.unit if meter else None, "primary_meter": feature.primary_meter,
                        "quotas": quotas, "rates": rates, "meters": list(feature.meters)})
        return ok(out)

    @get("/meters", operation_id="gate_list_meter_limits")
    async def meters(self, request: Request[Any, Any, Any]) -> Reply:
        """Every meter of the realm: the features that use it, the quotas counted in it (of
        the features whose primary meter it is), the price in force, and for a prepaid
        account the quantity its available funds buy (?meter_code= filters)."""
        runtime, realm, principal, account, standing = await _standing(request)
        now = datetime.fromisoformat(standing.as_of)
        today = now.date()
        uses = {u.quota_id: u for u in standing.quotas}
        prices = PriceIndex.of(realm)
        funding = realm.accounts[account].funding
        available = available_xusd(realm, account, standing, now)
        wanted = request.query_params.get("meter_code")
        out = []
        for meter in realm.meters.values():
            if wanted is not None and wanted != meter.code:
                continue
            features = [f for f in realm.features.values() if f.active and meter.code in f.meters]
            primary_of = {f.code for f in features if f.primary_meter == meter.code}
            view: dict[str, Any] = {
                "meter_code": meter.code, "unit": meter.unit,
                "features": [f.code for f in features],
                "feature_family_codes": sorted({f.family for f in features if f.family}),
                "quotas": [_quota_view(q, uses[q.quota_id], today) for q in realm.quotas
                           if q.feature in primary_of and q.quota_id in uses],
                "rates": [],
            }
            row = prices.at(meter.code, now)
            if row is not None:
                view["pricing"] = {"unit_price_xusd": str(row.unit_price_xusd),
                                   "unit_quantity_minor": str(row.unit_quantity_minor),
                                   "rounding": row.rounding,
                                   "effective_at": format_instant(datetime.fromisoformat(row.effective_at)),
                                   "fingerprint": price_fingerprint(row), "unit": meter.unit,
                                   "price_id": row.price_id}
                if funding == "prepaid":
                    blocks = available // row.unit_price_xusd if row.unit_price_xusd > 0 and available > 0 else 0
                    view["coverage"] = {"basis": "xusd", "balance_xusd": str(available),
                                        "max_quantity_minor_estimated": str(blocks * row.unit_quantity_minor),
                                        "advisory": True, "as_of": standing.as_of}
            out.append(view)
        return ok(out)


async def _rate_windows(runtime: Runtime, realm: Realm, feature_code: str, principal: str, account: str,
                        now: datetime) -> list[RateWindowUse]:
    """The rate windows open now, as counted for every worker of the service (`api.shared`)."""
    plan = RateLimiter.plan(realm, feature_code, principal, account)
    if not plan:
        return []
    return window_uses(realm, plan, await runtime.shared.used(plan, now.timestamp()), now)
