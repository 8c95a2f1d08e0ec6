"""The `quotas`, `budgets` and `rate_limits` sections of a realm: the limits the gate checks,
each on a feature (budgets: on any or some features), per account or per principal,
optionally only for some accounts; ids unique in their section."""

from __future__ import annotations

from typing import Any

from pipelines.catalog.model import ID_PATTERN, MAX_SECONDS, Account, Budget, Quota, RateLimit
from pipelines.catalog.reader import FaultReader, RealmDraft

__all__ = ["read_budgets", "read_quotas", "read_rate_limits"]


def read_quotas(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    seen_quotas: set[str] = set()
    for i, q_node in enumerate(r.array_of_tables(node, path)):
        q_path = f"{path}[{i}]"
        r.unknown_keys(q_node, q_path, ["id", "feature", "scope", "window", "limit_minor", "accounts"])
        feature = r.string(q_node, "feature", q_path)
        if feature is not None and feature not in realm.features:
            r.fault(f"{q_path}.feature", f"unknown feature {feature!r}")
        scope = r.string(q_node, "scope", q_path, choices=("account", "principal"))
        window = r.string(q_node, "window", q_path, choices=("day", "month"))
        limit = r.integer_string(q_node, "limit_minor", q_path)
        q_accounts = _account_filter(r, q_node, q_path, realm.accounts)
        qid = _rule_id(r, q_node, q_path, f"quota-{i}-{feature}", "quota", seen_quotas)
        if None not in (feature, scope, window, limit, qid):
            realm.quotas.append(Quota(qid, feature, scope, window, limit, q_accounts))  # type: ignore[arg-type]


def read_budgets(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    seen_budgets: set[str] = set()
    for i, b_node in enumerate(r.array_of_tables(node, path)):
        b_path = f"{path}[{i}]"
        r.unknown_keys(b_node, b_path, ["id", "scope", "window", "limit_xusd", "accounts", "features"])
        bid = r.string(b_node, "id", b_path, pattern=ID_PATTERN)
        if bid is not None and bid in seen_budgets:
            r.fault(f"{b_path}.id", f"budget id {bid!r} is repeated")
        scope = r.string(b_node, "scope", b_path, choices=("account", "principal"))
        window = r.string(b_node, "window", b_path, choices=("day", "month"))
        limit = r.integer_string(b_node, "limit_xusd", b_path)
        b_accounts = _account_filter(r, b_node, b_path, realm.accounts)
        b_features = r.string_list(b_node, "features", b_path)
        for j, f in enumerate(b_features or ()):
            if f not in realm.features:
                r.fault(f"{b_path}.features[{j}]", f"unknown feature {f!r}")
        if None not in (bid, scope, window, limit):
            seen_budgets.add(bid)  # type: ignore[arg-type]
            realm.budgets.append(Budget(bid, scope, window, limit, b_accounts, b_features))  # type: ignore[arg-type]


def read_rate_limits(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    seen_rate_limits: set[str] = set()  # the limiter counts by id: two rules must not share one
    for i, l_node in enumerate(r.array_of_tables(node, path)):
        l_path = f"{path}[{i}]"
        r.unknown_keys(l_node, l_path, ["id", "feature", "scope", "per_seconds", "limit"])
        feature = r.string(l_node, "feature", l_path)
        if feature is not None and feature not in realm.features:
            r.fault(f"{l_path}.feature", f"unknown feature {feature!r}")
        scope = r.string(l_node, "scope", l_path, default="principal", choices=("account", "principal"))
        per = r.integer(l_node, "per_seconds", l_path, minimum=1, maximum=MAX_SECONDS)
        limit_n = r.integer(l_node, "limit", l_path, minimum=1)
        lid = _rule_id(r, l_node, l_path, f"rate-{i}-{feature}", "rate limit", seen_rate_limits)
        if None not in (feature, scope, per, limit_n, lid):
            realm.rate_limits.append(RateLimit(lid, feature, scope, per, limit_n))  # type: ignore[arg-type]


def _rule_id(r: FaultReader, node: dict[str, Any], path: str, default: str, kind: str,
             seen: set[str]) -> str | None:
    """A quota's or rate limit's id: optional, a valid id when given, unique in the realm."""
    rid = r.string(node, "id", path, default=default, pattern=ID_PATTERN) if "id" in node else default
    if rid is not None:
        if rid in seen:
            r.fault(f"{path}.id", f"{kind} id {rid!r} is repeated")
            return None
        seen.add(rid)
    return rid


def _account_filter(r: FaultReader, node: dict[str, Any], path: str,
                    accounts: dict[str, Account]) -> tuple[str, ...] | None:
    listed = r.string_list(node, "accounts", path)
    for i, acct in enumerate(listed or ()):
        if acct not in accounts:
            r.fault(f"{path}.accounts[{i}]", f"unknown account {acct!r}")
    return listed
