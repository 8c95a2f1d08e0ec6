"""The catalog: realms, billing accounts, principals, features, meters, prices, limits and
rating policies, parsed from one TOML document and validated whole.

`load_catalog(text)` returns a `Catalog` or raises `CatalogInvalid` carrying every fault, each
with the dotted path of the value at fault, so an operator fixes a catalog in one pass.
Money and quantities are integer strings in the document and `int` here; no float is read.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import msgspec

from core.constants import INT64_MAX

__all__ = [
    "Account",
    "Budget",
    "Catalog",
    "CatalogFault",
    "CatalogInvalid",
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
    "CODE_PATTERN",
    "ID_PATTERN",
    "load_catalog",
]

CODE_PATTERN = re.compile(r"[a-z0-9]([a-z0-9._/@:-]{0,126}[a-z0-9])?")
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")
ID_PATTERN = _ID_PATTERN  # realm, account, principal and grant ids
# Durations (lease TTLs, skews, rate-limit windows) are added to the clock: beyond this a
# datetime or timedelta overflows at request time (a 500), so the catalog refuses them.
_MAX_SECONDS = 10 * 366 * 86400


@dataclass(frozen=True, slots=True)
class CatalogFault:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class CatalogInvalid(Exception):
    """A catalog with faults; nothing of it is applied."""

    def __init__(self, faults: list[CatalogFault]) -> None:
        super().__init__("\n".join(str(f) for f in faults))
        self.faults = faults


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


class _Reader:
    """Reads typed values out of the TOML tree, recording faults instead of stopping."""

    def __init__(self) -> None:
        self.faults: list[CatalogFault] = []

    def fault(self, path: str, message: str) -> None:
        self.faults.append(CatalogFault(path, message))

    def table(self, node: Any, path: str, *, required: bool = False) -> dict[str, Any]:
        if node is None:
            if required:
                self.fault(path, "is required")
            return {}
        if not isinstance(node, dict):
            self.fault(path, "must be a table")
            return {}
        return node

    def array_of_tables(self, node: Any, path: str) -> list[dict[str, Any]]:
        if node is None:
            return []
        if not isinstance(node, list) or not all(isinstance(x, dict) for x in node):
            self.fault(path, "must be an array of tables")
            return []
        return node

    def unknown_keys(self, node: dict[str, Any], path: str, allowed: Iterable[str]) -> None:
        allowed_set = set(allowed)
        hint = f"allowed: {', '.join(sorted(allowed_set))}" if allowed_set else "this table takes no keys"
        for key in node:
            if key not in allowed_set:
                self.fault(f"{path}.{key}", f"unknown key ({hint})")

    def string(self, node: dict[str, Any], key: str, path: str, *, default: str | None = None,
               choices: Iterable[str] | None = None, pattern: re.Pattern[str] | None = None) -> str | None:
        value = node.get(key, default)
        where = f"{path}.{key}"
        if value is None:
            self.fault(where, "is required")
            return None
        if not isinstance(value, str):
            self.fault(where, "must be a string")
            return None
        if choices is not None and value not in set(choices):
            self.fault(where, f"must be one of {', '.join(sorted(choices))}, got {value!r}")
            return None
        if pattern is not None and not pattern.fullmatch(value):
            self.fault(where, f"{value!r} is not a valid code (lower-case [a-z0-9._/@:-], 1-128 chars)")
            return None
        return value

    def integer_string(self, node: dict[str, Any], key: str, path: str, *, default: str | None = None,
                       minimum: int = 0) -> int | None:
        """Money and quantities: an integer string, so no float can slip in."""
        value = node.get(key, default)
        where = f"{path}.{key}"
        if value is None:
            self.fault(where, "is required")
            return None
        if not isinstance(value, str) or not re.fullmatch(r"-?[0-9]+", value):
            self.fault(where, "must be a string holding an integer, e.g. \"1500\"")
            return None
        number = int(value)
        if number < minimum or number > INT64_MAX:
            self.fault(where, f"must be between {minimum} and {INT64_MAX}")
            return None
        return number

    def integer(self, node: dict[str, Any], key: str, path: str, *, default: int | None = None,
                minimum: int = 0, maximum: int = INT64_MAX) -> int | None:
        value = node.get(key, default)
        where = f"{path}.{key}"
        if value is None:
            self.fault(where, "is required")
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.fault(where, "must be an integer")
            return None
        if value < minimum or value > maximum:
            self.fault(where, f"must be between {minimum} and {maximum}")
            return None
        return value

    def instant(self, node: dict[str, Any], key: str, path: str) -> datetime | None:
        value = node.get(key)
        where = f"{path}.{key}"
        if isinstance(value, datetime):
            if value.tzinfo is None:
                self.fault(where, "must carry an offset (e.g. Z)")
                return None
            return self._utc(value, where)
        if not isinstance(value, str):
            self.fault(where, "is required: an RFC 3339 timestamp with an offset")
            return None
        try:
            moment = msgspec.convert(value, datetime)
        except msgspec.ValidationError:
            moment = None
        if moment is None or moment.tzinfo is None:
            self.fault(where, f"{value!r} is not an RFC 3339 timestamp with an offset")
            return None
        return self._utc(moment, where)

    def _utc(self, moment: datetime, where: str) -> datetime | None:
        try:
            return moment.astimezone(timezone.utc)
        except OverflowError:  # 0001-01-01T00:00:00+01:00, 9999-12-31T23:59:59-01:00
            self.fault(where, f"{moment.isoformat()} has no UTC instant (out of range)")
            return None

    def string_list(self, node: dict[str, Any], key: str, path: str, *,
                    pattern: re.Pattern[str] | None = None) -> tuple[str, ...] | None:
        value = node.get(key)
        if value is None:
            return None
        where = f"{path}.{key}"
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            self.fault(where, "must be an array of strings")
            return None
        if pattern is not None:
            for i, item in enumerate(value):
                if not pattern.fullmatch(item):
                    self.fault(f"{where}[{i}]", f"{item!r} is not a valid code")
        if len(set(value)) != len(value):
            self.fault(where, "has repeated entries")
        return tuple(value)


DslValidator = Callable[[dict[str, Any]], list[tuple[str, str]]]


def _default_dsl_validator(document: dict[str, Any]) -> list[tuple[str, str]]:
    from pipelines.rating import validate_policy

    return [(err.path, err.message) for err in validate_policy(document)]


def load_catalog(text: str, *, dsl_validator: DslValidator | None = None) -> Catalog:
    """Parse and validate a whole catalog; raise `CatalogInvalid` naming every fault."""
    reader = _Reader()
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogInvalid([CatalogFault("$", f"not valid TOML: {exc}")]) from None
    reader.unknown_keys(tree, "$", ["realms"])
    realms_node = reader.table(tree.get("realms"), "realms", required=True)
    realms: dict[str, Realm] = {}
    for realm_id, node in realms_node.items():
        path = f"realms.{realm_id}"
        if not _ID_PATTERN.fullmatch(realm_id):
            reader.fault(path, "realm id must be 1-128 chars of [A-Za-z0-9._:@/-]")
        realm = _read_realm(reader, realm_id, reader.table(node, path), path,
                            dsl_validator or _default_dsl_validator)
        if realm is not None:
            realms[realm_id] = realm
    if reader.faults:
        raise CatalogInvalid(reader.faults)
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
    return Catalog(realms=realms, fingerprint=fingerprint, source=text)


_REALM_KEYS = ("settings", "accounts", "families", "meters", "features", "prices", "quotas",
               "budgets", "rate_limits", "policies")


def _read_realm(r: _Reader, realm_id: str, node: dict[str, Any], path: str,
                dsl_validator: DslValidator) -> Realm | None:
    start = len(r.faults)
    r.unknown_keys(node, path, _REALM_KEYS)

    s_node = r.table(node.get("settings"), f"{path}.settings")
    r.unknown_keys(s_node, f"{path}.settings",
                   ["lease_ttl_seconds", "lateness_allowance_seconds", "max_future_skew_seconds"])
    settings = RealmSettings(
        lease_ttl_seconds=r.integer(s_node, "lease_ttl_seconds", f"{path}.settings", default=900, minimum=1,
                                    maximum=_MAX_SECONDS) or 900,
        lateness_allowance_seconds=r.integer(s_node, "lateness_allowance_seconds", f"{path}.settings",
                                             default=7200, maximum=_MAX_SECONDS) or 0,
        max_future_skew_seconds=r.integer(s_node, "max_future_skew_seconds", f"{path}.settings",
                                          default=300, maximum=_MAX_SECONDS) or 0,
    )

    accounts: dict[str, Account] = {}
    principal_account: dict[str, str] = {}
    grant_account: dict[str, str] = {}  # the ledger keys grants by (realm, id): one account per id
    for acct_id, a_node in r.table(node.get("accounts"), f"{path}.accounts").items():
        a_path = f"{path}.accounts.{acct_id}"
        a_node = r.table(a_node, a_path)
        r.unknown_keys(a_node, a_path, ["funding", "credit_limit_xusd", "principals", "grants"])
        if not _ID_PATTERN.fullmatch(acct_id):
            r.fault(a_path, "account id must be 1-128 chars of [A-Za-z0-9._:@/-]")
        funding = r.string(a_node, "funding", a_path, choices=("prepaid", "postpaid"))
        credit = r.integer_string(a_node, "credit_limit_xusd", a_path, default="0")
        principals = r.string_list(a_node, "principals", a_path) or ()
        for i, principal in enumerate(principals):
            if not _ID_PATTERN.fullmatch(principal):
                r.fault(f"{a_path}.principals[{i}]", f"{principal!r} is not a valid principal id")
            elif principal in principal_account:
                if principal_account[principal] == acct_id:
                    continue  # already reported: "has repeated entries"
                r.fault(f"{a_path}.principals[{i}]",
                        f"principal {principal!r} already belongs to account {principal_account[principal]!r}")
            else:
                principal_account[principal] = acct_id
        grants: list[Grant] = []
        for i, g_node in enumerate(r.array_of_tables(a_node.get("grants"), f"{a_path}.grants")):
            g_path = f"{a_path}.grants[{i}]"
            r.unknown_keys(g_node, g_path, ["id", "amount_xusd", "effective_at"])
            gid = r.string(g_node, "id", g_path, pattern=_ID_PATTERN)
            amount = r.integer_string(g_node, "amount_xusd", g_path)
            eff = r.instant(g_node, "effective_at", g_path)
            if gid is not None and gid in grant_account:
                where = "" if grant_account[gid] == acct_id else f" (also in account {grant_account[gid]!r})"
                r.fault(f"{g_path}.id", f"grant id {gid!r} is repeated{where}; grant ids are unique per realm")
            elif gid is not None:
                grant_account[gid] = acct_id
            if gid is not None and amount is not None and eff is not None:
                grants.append(Grant(gid, amount, eff))
        if funding is not None and credit is not None:
            accounts[acct_id] = Account(acct_id, funding, credit, principals, tuple(grants))

    families_node = r.table(node.get("families"), f"{path}.families")
    for fam, fam_node in families_node.items():
        if not CODE_PATTERN.fullmatch(fam):
            r.fault(f"{path}.families.{fam}", "family code must be lower-case [a-z0-9._/@:-], 1-128 chars")
        r.unknown_keys(r.table(fam_node, f"{path}.families.{fam}"), f"{path}.families.{fam}", [])
    families = frozenset(families_node)

    meters: dict[str, Meter] = {}
    for code, m_node in r.table(node.get("meters"), f"{path}.meters").items():
        m_path = f"{path}.meters.{code}"
        m_node = r.table(m_node, m_path)
        r.unknown_keys(m_node, m_path, ["unit"])
        if not CODE_PATTERN.fullmatch(code):
            r.fault(m_path, "meter code must be lower-case [a-z0-9._/@:-], 1-128 chars")
            continue
        unit = r.string(m_node, "unit", m_path, default="unit")
        meters[code] = Meter(code, unit if unit is not None else "unit")

    features: dict[str, Feature] = {}
    for code, f_node in r.table(node.get("features"), f"{path}.features").items():
        f_path = f"{path}.features.{code}"
        f_node = r.table(f_node, f_path)
        r.unknown_keys(f_node, f_path, ["family", "primary_meter", "meters", "lease_ttl_seconds", "active"])
        if not CODE_PATTERN.fullmatch(code):
            r.fault(f_path, "feature code must be lower-case [a-z0-9._/@:-], 1-128 chars")
            continue
        family = f_node.get("family")
        if family is not None and not isinstance(family, str):
            r.fault(f"{f_path}.family", "must be a string")
            family = None
        elif family is not None and family not in families:
            r.fault(f"{f_path}.family", f"unknown family {family!r}")
        primary = r.string(f_node, "primary_meter", f_path)
        allowed = r.string_list(f_node, "meters", f_path) or ((primary,) if primary else ())
        for i, m in enumerate(allowed):
            if m not in meters:
                r.fault(f"{f_path}.meters[{i}]", f"unknown meter {m!r}")
        if primary is not None:
            if primary not in meters:
                r.fault(f"{f_path}.primary_meter", f"unknown meter {primary!r}")
            elif primary not in allowed:
                r.fault(f"{f_path}.primary_meter", "must be one of the feature's meters")
        ttl = f_node.get("lease_ttl_seconds")
        if ttl is not None:
            ttl = r.integer(f_node, "lease_ttl_seconds", f_path, minimum=1, maximum=_MAX_SECONDS)
        active = f_node.get("active", True)
        if not isinstance(active, bool):
            r.fault(f"{f_path}.active", "must be a boolean")
            active = True
        if primary is not None:
            features[code] = Feature(code, family, primary, allowed, ttl, active)

    prices: list[Price] = []
    seen_prices: set[str] = set()
    for i, p_node in enumerate(r.array_of_tables(node.get("prices"), f"{path}.prices")):
        p_path = f"{path}.prices[{i}]"
        r.unknown_keys(p_node, p_path, ["meter", "unit_price_xusd", "unit_quantity_minor", "rounding", "effective_at"])
        meter = r.string(p_node, "meter", p_path)
        if meter is not None and meter not in meters:
            r.fault(f"{p_path}.meter", f"unknown meter {meter!r}")
        unit_price = r.integer_string(p_node, "unit_price_xusd", p_path)
        unit_qty = r.integer_string(p_node, "unit_quantity_minor", p_path, default="1", minimum=1)
        rounding = r.string(p_node, "rounding", p_path, default="floor", choices=("floor", "nearest", "ceil"))
        eff = r.instant(p_node, "effective_at", p_path)
        price_id = None
        if meter is not None and eff is not None:
            # The row's id (part of the carry key) is to the second: two rows of a meter in one
            # second would share it.
            price_id = f"{meter}@{eff.replace(tzinfo=None).isoformat(timespec='seconds')}Z"
            if price_id in seen_prices:
                r.fault(p_path, f"a second price for meter {meter!r} at the same effective_at (to the second)")
            seen_prices.add(price_id)
        if None not in (meter, unit_price, unit_qty, rounding, eff, price_id):
            prices.append(Price(price_id, meter, unit_price, unit_qty, rounding, eff))  # type: ignore[arg-type]

    quotas: list[Quota] = []
    seen_quotas: set[str] = set()
    for i, q_node in enumerate(r.array_of_tables(node.get("quotas"), f"{path}.quotas")):
        q_path = f"{path}.quotas[{i}]"
        r.unknown_keys(q_node, q_path, ["id", "feature", "scope", "window", "limit_minor", "accounts"])
        feature = r.string(q_node, "feature", q_path)
        if feature is not None and feature not in features:
            r.fault(f"{q_path}.feature", f"unknown feature {feature!r}")
        scope = r.string(q_node, "scope", q_path, choices=("account", "principal"))
        window = r.string(q_node, "window", q_path, choices=("day", "month"))
        limit = r.integer_string(q_node, "limit_minor", q_path)
        q_accounts = _account_filter(r, q_node, q_path, accounts)
        qid = _rule_id(r, q_node, q_path, f"quota-{i}-{feature}", "quota", seen_quotas)
        if None not in (feature, scope, window, limit, qid):
            quotas.append(Quota(qid, feature, scope, window, limit, q_accounts))  # type: ignore[arg-type]

    budgets: list[Budget] = []
    seen_budgets: set[str] = set()
    for i, b_node in enumerate(r.array_of_tables(node.get("budgets"), f"{path}.budgets")):
        b_path = f"{path}.budgets[{i}]"
        r.unknown_keys(b_node, b_path, ["id", "scope", "window", "limit_xusd", "accounts", "features"])
        bid = r.string(b_node, "id", b_path, pattern=_ID_PATTERN)
        if bid is not None and bid in seen_budgets:
            r.fault(f"{b_path}.id", f"budget id {bid!r} is repeated")
        scope = r.string(b_node, "scope", b_path, choices=("account", "principal"))
        window = r.string(b_node, "window", b_path, choices=("day", "month"))
        limit = r.integer_string(b_node, "limit_xusd", b_path)
        b_accounts = _account_filter(r, b_node, b_path, accounts)
        b_features = r.string_list(b_node, "features", b_path)
        for j, f in enumerate(b_features or ()):
            if f not in features:
                r.fault(f"{b_path}.features[{j}]", f"unknown feature {f!r}")
        if None not in (bid, scope, window, limit):
            seen_budgets.add(bid)  # type: ignore[arg-type]
            budgets.append(Budget(bid, scope, window, limit, b_accounts, b_features))  # type: ignore[arg-type]

    rate_limits: list[RateLimit] = []
    seen_rate_limits: set[str] = set()  # the limiter counts by id: two rules must not share one
    for i, l_node in enumerate(r.array_of_tables(node.get("rate_limits"), f"{path}.rate_limits")):
        l_path = f"{path}.rate_limits[{i}]"
        r.unknown_keys(l_node, l_path, ["id", "feature", "scope", "per_seconds", "limit"])
        feature = r.string(l_node, "feature", l_path)
        if feature is not None and feature not in features:
            r.fault(f"{l_path}.feature", f"unknown feature {feature!r}")
        scope = r.string(l_node, "scope", l_path, default="principal", choices=("account", "principal"))
        per = r.integer(l_node, "per_seconds", l_path, minimum=1, maximum=_MAX_SECONDS)
        limit_n = r.integer(l_node, "limit", l_path, minimum=1)
        lid = _rule_id(r, l_node, l_path, f"rate-{i}-{feature}", "rate limit", seen_rate_limits)
        if None not in (feature, scope, per, limit_n, lid):
            rate_limits.append(RateLimit(lid, feature, scope, per, limit_n))  # type: ignore[arg-type]

    policies: dict[str, Policy] = {}
    for i, pol_node in enumerate(r.array_of_tables(node.get("policies"), f"{path}.policies")):
        pol_path = f"{path}.policies[{i}]"
        r.unknown_keys(pol_node, pol_path, ["id", "versions"])
        pid = r.string(pol_node, "id", pol_path, pattern=_ID_PATTERN)
        if pid is not None and pid in policies:
            r.fault(f"{pol_path}.id", f"policy id {pid!r} is repeated")
        versions: list[PolicyVersion] = []
        v_nodes = r.array_of_tables(pol_node.get("versions"), f"{pol_path}.versions")
        if not v_nodes:
            r.fault(f"{pol_path}.versions", "a policy needs at least one version")
        seen_versions: set[str] = set()
        seen_effective: dict[datetime, str] = {}
        for j, v_node in enumerate(v_nodes):
            v_path = f"{pol_path}.versions[{j}]"
            r.unknown_keys(v_node, v_path, ["version", "effective_at", "dsl_json"])
            version = r.string(v_node, "version", v_path)
            if version is not None and version in seen_versions:
                r.fault(f"{v_path}.version", f"version {version!r} is repeated")
            eff = r.instant(v_node, "effective_at", v_path)
            if eff is not None and eff in seen_effective:
                r.fault(f"{v_path}.effective_at", f"version {seen_effective[eff]!r} of this policy takes effect at "
                        "the same instant; which one rates an event would be ambiguous")
            elif eff is not None and version is not None:
                seen_effective[eff] = version
            dsl_text = r.string(v_node, "dsl_json", v_path)
            document = _read_dsl(r, dsl_text, f"{v_path}.dsl_json", dsl_validator, features, meters)
            if None not in (version, eff, dsl_text, document):
                seen_versions.add(version)  # type: ignore[arg-type]
                versions.append(PolicyVersion(version, eff, dsl_text, document))  # type: ignore[arg-type]
        if pid is not None:
            policies[pid] = Policy(pid, tuple(sorted(versions, key=lambda v: v.effective_at)))

    if len(r.faults) > start:
        return None
    return Realm(
        id=realm_id, settings=settings, accounts=accounts, principal_account=principal_account,
        families=families, meters=meters, features=features, prices=tuple(prices),
        quotas=tuple(quotas), budgets=tuple(budgets), rate_limits=tuple(rate_limits), policies=policies,
    )


def _rule_id(r: _Reader, node: dict[str, Any], path: str, default: str, kind: str,
             seen: set[str]) -> str | None:
    """A quota's or rate limit's id: optional, a valid id when given, unique in the realm."""
    rid = r.string(node, "id", path, default=default, pattern=_ID_PATTERN) if "id" in node else default
    if rid is not None:
        if rid in seen:
            r.fault(f"{path}.id", f"{kind} id {rid!r} is repeated")
            return None
        seen.add(rid)
    return rid


def _account_filter(r: _Reader, node: dict[str, Any], path: str,
                    accounts: dict[str, Account]) -> tuple[str, ...] | None:
    listed = r.string_list(node, "accounts", path)
    for i, acct in enumerate(listed or ()):
        if acct not in accounts:
            r.fault(f"{path}.accounts[{i}]", f"unknown account {acct!r}")
    return listed


def _read_dsl(r: _Reader, text: str | None, path: str, validator: DslValidator,
              features: dict[str, Feature], meters: dict[str, Meter]) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        document = msgspec.json.decode(text.encode())
    except msgspec.DecodeError as exc:
        r.fault(path, f"not valid JSON: {exc}")
        return None
    if not isinstance(document, dict):
        r.fault(path, "must be a JSON object")
        return None
    faults = validator(document)
    for dsl_path, message in faults:
        r.fault(f"{path}{dsl_path.removeprefix('$')}", message)
    if faults:
        return None
    # The DSL names features and meters; a policy that emits one the realm lacks would rate
    # into nothing, so it is a catalog fault, not a runtime surprise.
    emit = document.get("emit", {})
    for i, intent in enumerate(emit.get("intents", [])):
        code = intent.get("feature_code")
        if code not in features:
            r.fault(f"{path}.emit.intents[{i}].feature_code", f"unknown feature {code!r}")
        for j, meter in enumerate(intent.get("meters", [])):
            m = meter.get("meter_code")
            if m not in meters:
                r.fault(f"{path}.emit.intents[{i}].meters[{j}].meter_code", f"unknown meter {m!r}")
    return document
