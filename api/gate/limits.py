"""Rate limits of authorize: fixed windows per (rate limit, principal or account).

Counted before a request reaches the writer: a refused request costs no write. With several
HTTP workers the counters live in one place, the service's parent process (`api.shared`), so a
principal's window is the same whichever worker a call reaches. Counters are not durable; a restart opens fresh windows, which errs on the side of
admitting work, never of refusing it twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone

from pipelines.catalog import Realm

__all__ = ["RateLimiter", "RatePlan", "RateRefusal", "RateWindowUse", "refusal", "window_uses"]


@dataclass(frozen=True, slots=True)
class RateRefusal:
    limit: int
    reset_at: datetime
    retry_after_seconds: int


@dataclass(frozen=True, slots=True)
class RateWindowUse:
    rate_limit_id: str
    scope: str
    limit: int
    used: int
    window_start: datetime
    window_end: datetime


# One rate limit as it applies to one call: (realm, rate limit id, principal or account,
# window seconds, limit). What the workers of a service send to the one place that counts.
RatePlan = tuple[tuple[str, str, str, int, int], ...]


class RateLimiter:
    """The counters of fixed windows. `plan` names the windows a call counts against (from
    the catalog, in the HTTP worker); `admit_planned` and `used` count them, in the worker
    itself when it is the only one, else in the service's parent process (`api.shared`)."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, str, str], tuple[int, int]] = {}

    @staticmethod
    def plan(realm: Realm, feature_code: str, principal: str, account: str) -> RatePlan:
        return tuple((realm.id, rule.rate_limit_id, principal if rule.scope == "principal" else account,
                      rule.per_seconds, rule.limit)
                     for rule in realm.rate_limits if rule.feature == feature_code)

    def admit(self, realm: Realm, feature_code: str, principal: str, account: str,
              now: datetime) -> RateRefusal | None:
        """Count this request against every rate limit of the feature; refuse if any is full
        (then nothing is counted)."""
        refused = self.admit_planned(self.plan(realm, feature_code, principal, account), now.timestamp())
        return None if refused is None else refusal(*refused, now.timestamp())

    def admit_planned(self, plan: RatePlan, stamp: float) -> tuple[int, int] | None:
        """Count one call in each window of `plan`; when one is full, nothing is counted and
        the answer is that limit and the end of its window (epoch seconds)."""
        counted: list[tuple[tuple[str, str, str], tuple[int, int]]] = []
        for realm_id, rate_limit_id, sid, per_seconds, limit in plan:
            key = (realm_id, rate_limit_id, sid)
            window = int(stamp // per_seconds)
            current, count = self._windows.get(key, (window, 0))
            if current != window:
                count = 0
            if count >= limit:
                return limit, (window + 1) * per_seconds
            counted.append((key, (window, count + 1)))
        for key, value in counted:
            self._windows[key] = value
        return None

    def used(self, plan: RatePlan, stamp: float) -> list[int]:
        """The calls counted so far in each window of `plan` open at `stamp`."""
        out = []
        for realm_id, rate_limit_id, sid, per_seconds, _ in plan:
            window = int(stamp // per_seconds)
            current, count = self._windows.get((realm_id, rate_limit_id, sid), (window, 0))
            out.append(count if current == window else 0)
        return out

    def windows(self, realm: Realm, feature_code: str, principal: str, account: str,
                now: datetime) -> list[RateWindowUse]:
        """The windows open now of every rate limit of the feature, counting nothing."""
        plan = self.plan(realm, feature_code, principal, account)
        return window_uses(realm, plan, self.used(plan, now.timestamp()), now)


def refusal(limit: int, reset: int, stamp: float) -> RateRefusal:
    return RateRefusal(limit, datetime.fromtimestamp(reset, tz=timezone.utc), max(1, math.ceil(reset - stamp)))


def window_uses(realm: Realm, plan: RatePlan, used: list[int], now: datetime) -> list[RateWindowUse]:
    scopes = {rule.rate_limit_id: rule.scope for rule in realm.rate_limits}
    stamp = now.timestamp()
    out = []
    for (_, rate_limit_id, _, per_seconds, limit), count in zip(plan, used, strict=True):
        window = int(stamp // per_seconds)
        out.append(RateWindowUse(
            rate_limit_id, scopes[rate_limit_id], limit, count,
            datetime.fromtimestamp(window * per_seconds, tz=timezone.utc),
            datetime.fromtimestamp((window + 1) * per_seconds, tz=timezone.utc)))
    return out
