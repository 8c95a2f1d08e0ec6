"""The catalog's values: realms, billing accounts and their grants, features, meters, prices,
quotas, budgets, rate limits and rating policies, as frozen dataclasses; and the patterns a
catalog's ids and codes follow.

They are made only by `load_catalog` (`pipelines.catalog.load`), which validates a whole
document first: a value here is always one of a valid catalog. Money and quantities are
`int`; no float is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = [
    "CODE_PATTERN",
    "ID_PATTERN",
    "MAX_SECONDS",
    "Account",
    "Budget",
    "Catalog",
    "Feature",
    "Grant",
    "Meter",
    "Policy",
    "PolicyVersion",
    "Price",
    "Quota",
    "RateLimit",
    "Realm",
    "RealmSettings",
]

CODE_PATTERN = re.compile(r"[a-z0-9]([a-z0-9._/@:-]{0,126}[a-z0-9])?")
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")  # realm, account, principal and grant ids
# Durations (lease TTLs, skews, rate-limit windows) are added to the clock: beyond this a
# datetime or timedelta overflows at request time (a 500), so the catalog refuses them.
MAX_SECONDS = 10 * 366 * 86400


@dataclass(frozen=True, slots=True)
class RealmSettings:
    lease_ttl_seconds: int = 900
    lateness_allowance_seconds: int = 7200
    max_future_skew_seconds: int = 300


@dataclass(frozen=True, slots=True)
class Grant:
    id: str
    amount_xusd: int
    effective_at: datetime


@dataclass(frozen=True, slots=True)
class Account:
    id: str
    funding: str  # prepaid | postpaid
    credit_limit_xusd: int
    principals: tuple[str, ...]
    grants: tuple[Grant, ...]


@dataclass(frozen=True, slots=True)
class Meter:
    code: str
    unit: str


@dataclass(frozen=True, slots=True)
class Feature:
    code: str
    family: str | None
    primary_meter: str
    meters: tuple[str, ...]
    lease_ttl_seconds: int | None
    active: bool


@dataclass(frozen=True, slots=True)
class Price:
    price_id: str
    meter: str
    unit_price_xusd: int
    unit_quantity_minor: int
    rounding: str  # floor | nearest | ceil
    effective_at: datetime


@dataclass(frozen=True, slots=True)
class Quota:
    quota_id: str
    feature: str
    scope: str  # account | principal
    window: str  # day | month
    limit_minor: int
    accounts: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class Budget:
    id: str
    scope: str  # account | principal
    window: str  # day | month
    limit_xusd: int
    accounts: tuple[str, ...] | None
    features: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class RateLimit:
    rate_limit_id: str
    feature: str
    scope: str  # account | principal
    per_seconds: int
    limit: int


@dataclass(frozen=True, slots=True)
class PolicyVersion:
    version: str
    effective_at: datetime
    dsl_json: str
    document: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Policy:
    id: str
    versions: tuple[PolicyVersion, ...]


@dataclass(frozen=True, slots=True)
class Realm:
    id: str
    settings: RealmSettings
    accounts: dict[str, Account]
    principal_account: dict[str, str]
    families: frozenset[str]
    meters: dict[str, Meter]
    features: dict[str, Feature]
    prices: tuple[Price, ...]
    quotas: tuple[Quota, ...]
    budgets: tuple[Budget, ...]
    rate_limits: tuple[RateLimit, ...]
    policies: dict[str, Policy]

    def lease_ttl(self, feature: Feature) -> int:
        return feature.lease_ttl_seconds or self.settings.lease_ttl_seconds


@dataclass(frozen=True, slots=True)
class Catalog:
    realms: dict[str, Realm]
    fingerprint: str
    source: str = field(repr=False, default="")

    @staticmethod
    def empty() -> Catalog:
        return Catalog(realms={}, fingerprint="empty", source="")
