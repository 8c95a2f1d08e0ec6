"""Rate limits of authorize: fixed windows per (rate limit, principal or account).

Counted in the service process, before a request reaches the writer: a refused request costs
no write. Counters are not durable; a restart opens fresh windows, which errs on the side of
admitting work, never of refusing it twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone

from pipelines.catalog import Realm

__all__ = ["RateLimiter", "RateRefusal", "RateWindowUse"]


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


class RateLimiter:
    def __init__(self) -> None:
        self._windows: dict[tuple[str, str, str], tuple[int, int]] = {}

    def admit(self, realm: Realm, feature_code: str, principal: str, account: str,
              now: datetime) -> RateRefusal | None:
        """Count this request against every rate limit of the feature; refuse if any is full
        (then nothing is counted)."""
        stamp = now.timestamp()
        counted: list[tuple[tuple[str, str, str], tuple[int, int]]] = []
        for rule in realm.rate_limits:
            if rule.feature != feature_code:
                continue
            sid = principal if rule.scope == "principal" else account
            key = (realm.id, rule.rate_limit_id, sid)
            window = int(stamp // rule.per_seconds)
            current, count = self._windows.get(key, (window, 0))
            if current != window:
                count = 0
            if count >= rule.limit:
                reset = (window + 1) * rule.per_seconds
                return RateRefusal(rule.limit, datetime.fromtimestamp(reset, tz=timezone.utc),
                                   max(1, math.ceil(reset - stamp)))
            counted.append((key, (window, count + 1)))
        for key, value in counted:
            self._windows[key] = value
        return None

    def windows(self, realm: Realm, feature_code: str, principal: str, account: str,
                now: datetime) -> list[RateWindowUse]:
        """The windows open now of every rate limit of the feature, counting nothing."""
        stamp = now.timestamp()
        out = []
        for rule in realm.rate_limits:
            if rule.feature != feature_code:
                continue
            sid = principal if rule.scope == "principal" else account
            window = int(stamp // rule.per_seconds)
            current, count = self._windows.get((realm.id, rule.rate_limit_id, sid), (window, 0))
            used = count if current == window else 0
            out.append(RateWindowUse(
                rule.rate_limit_id, rule.scope, rule.limit, used,
                datetime.fromtimestamp(window * rule.per_seconds, tz=timezone.utc),
                datetime.fromtimestamp((window + 1) * rule.per_seconds, tz=timezone.utc)))
        return out
