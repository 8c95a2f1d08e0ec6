"""One builder for the catalogs of the tests and benchmarks: a catalog as Python calls, written
out as the TOML text `pipelines.catalog.load_catalog` reads (tomllib only reads TOML, so a
small emitter for the catalog's shapes lives here).

    from tests.catalog_builder import CatalogBuilder, Raw

    text = (CatalogBuilder("acme")
            .settings(lateness_allowance_seconds=3600)
            .account("acct_a", "prepaid", principals=["team-a"])
            .grant("acct_a", "welcome", 5_000_000, "2026-11-01T00:00:00Z")
            .meter("api.calls", "request")
            .feature("api.search", "api.calls")
            .price("api.calls", 2000, "2026-01-01T00:00:00Z", unit_quantity_minor=1)
            .rate_limit("api.search", per_seconds=1, limit=100)
            .policy("calls", ("v1", "2026-01-01T00:00:00Z", {"dsl_version": "v1", ...}))
            .realm("globex")                     # what follows goes to realm globex
            .account("acct_g", "postpaid")
            .toml())

Every method returns the builder, writes only the keys it is given (None leaves a key out,
so the loader's default or its "is required" applies) and adds to the realm chosen last.
Money and quantities may be given as ints; they are written as the integer strings the
catalog expects. A policy version's DSL is a dict (written as its JSON text) or a string
(written as it is, e.g. JSON that does not parse).

Deliberately invalid catalogs: any value may be a string the loader refuses
(`rounding="up"`, `effective_at="yesterday"`), `Raw("5")` writes a TOML value exactly as
given (an integer where a string belongs, an unquoted datetime), and keyword arguments a
method does not name are written as keys of their own (`family("llm", color="red")` makes the
unknown key `realms.acme.families.llm.color`).

The text holds only what was built, so the text of a builder that adds to what a document
declares (more prices, more accounts, a grant of its account, a version of its last policy)
can be appended to that document: arrays of tables continue the document's arrays. A table
declared in both (the same account, the realm's settings) makes the sum invalid TOML.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeAlias

__all__ = ["CatalogBuilder", "Dsl", "Raw", "Value", "Version", "emit_toml"]


@dataclass(frozen=True, slots=True)
class Raw:
    """A TOML value written exactly as given, e.g. `Raw("5")` for an integer where the catalog
    wants an integer string, or `Raw("2026-01-01T00:00:00Z")` for a TOML datetime."""

    text: str


Scalar: TypeAlias = str | int | bool | Raw
# A key's value: a scalar or an array of them.
Value: TypeAlias = Scalar | Sequence[Scalar]
# A policy version's DSL: a document (written as JSON), or its text as is.
Dsl: TypeAlias = Mapping[str, Any] | str | Raw
# (version, effective_at, DSL) of one policy version.
Version: TypeAlias = tuple[Value, Value, Dsl]

_Table: TypeAlias = dict[str, Any]


class _Continued(dict[str, Any]):
    """An element of an array of tables written without its `[[...]]` header: what it holds
    belongs to the last element of that array in the document the text is appended to."""


class CatalogBuilder:
    """A catalog of one or more realms, built by calls and written out by `toml()`."""

    def __init__(self, realm: str = "acme") -> None:
        """`realm` is the first realm and the one calls add to (written even if left empty)."""
        self._realms: dict[str, _Table] = {}
        self._realm = self._realms.setdefault(realm, {})

    def realm(self, realm_id: str) -> Self:
        """Make `realm_id` (new and empty, or one built before) the realm later calls add to."""
        self._realm = self._realms.setdefault(realm_id, {})
        return self

    def copy(self) -> CatalogBuilder:
        """An independent builder with everything built so far (and the same realm chosen)."""
        twin = CatalogBuilder.__new__(CatalogBuilder)
        twin._realms = copy.deepcopy(self._realms)
        current = next(k for k, v in self._realms.items() if v is self._realm)
        twin._realm = twin._realms[current]
        return twin

    # ---- tables keyed by id or code ---------------------------------------------------------
    def settings(self, *, lease_ttl_seconds: Value | None = None,
                 lateness_allowance_seconds: Value | None = None,
                 max_future_skew_seconds: Value | None = None, **extra: Value) -> Self:
        _put(self._table("settings"), lease_ttl_seconds=lease_ttl_seconds,
             lateness_allowance_seconds=lateness_allowance_seconds,
             max_future_skew_seconds=max_future_skew_seconds, **extra)
        return self

    def account(self, account_id: str, funding: Value | None, *,
                credit_limit_xusd: Value | None = None,
                principals: Value | None = None, **extra: Value) -> Self:
        """An account (`funding`: prepaid or postpaid); calling again adds to it."""
        _put(self._entry("accounts", account_id), funding=funding,
             credit_limit_xusd=_integer_string(credit_limit_xusd), principals=principals, **extra)
        return self

    def grant(self, account_id: str, grant_id: Value | None, amount_xusd: Value | None,
              effective_at: Value | None, **extra: Value) -> Self:
        """A grant of `account_id` (its table is made if this builder has none)."""
        grants: list[_Table] = self._entry("accounts", account_id).setdefault("grants", [])
        grants.append(_entry(id=grant_id, amount_xusd=_integer_string(amount_xusd),
                             effective_at=effective_at, **extra))
        return self

    def family(self, code: str, **extra: Value) -> Self:
        _put(self._entry("families", code), **extra)
        return self

    def meter(self, code: str, unit: Value | None = None, **extra: Value) -> Self:
        _put(self._entry("meters", code), unit=unit, **extra)
        return self

    def feature(self, code: str, primary_meter: Value | None, *, meters: Value | None = None,
                family: Value | None = None, lease_ttl_seconds: Value | None = None,
                active: Value | None = None, **extra: Value) -> Self:
        _put(self._entry("features", code), family=family, primary_meter=primary_meter,
             meters=meters, lease_ttl_seconds=lease_ttl_seconds, active=active, **extra)
        return self

    # ---- arrays of tables, in the order of the calls ----------------------------------------
    def price(self, meter: Value | None, unit_price_xusd: Value | None,
              effective_at: Value | None, *, unit_quantity_minor: Value | None = None,
              rounding: Value | None = None, **extra: Value) -> Self:
        self._array("prices").append(_entry(
            meter=meter, unit_price_xusd=_integer_string(unit_price_xusd),
            unit_quantity_minor=_integer_string(unit_quantity_minor), rounding=rounding,
            effective_at=effective_at, **extra))
        return self

    def quota(self, feature: Value | None, *, scope: Value | None, window: Value | None,
              limit_minor: Value | None, id: Value | None = None,
              accounts: Value | None = None, **extra: Value) -> Self:
        self._array("quotas").append(_entry(
            id=id, feature=feature, scope=scope, window=window,
            limit_minor=_integer_string(limit_minor), accounts=accounts, **extra))
        return self

    def budget(self, budget_id: Value | None, *, scope: Value | None, window: Value | None,
               limit_xusd: Value | None, accounts: Value | None = None,
               features: Value | None = None, **extra: Value) -> Self:
        self._array("budgets").append(_entry(
            id=budget_id, scope=scope, accounts=accounts, features=features, window=window,
            limit_xusd=_integer_string(limit_xusd), **extra))
        return self

    def rate_limit(self, feature: Value | None, *, per_seconds: Value | None, limit: Value | None,
                   scope: Value | None = None, id: Value | None = None, **extra: Value) -> Self:
        """A rate limit; `per_seconds` and `limit` are TOML integers in the catalog."""
        self._array("rate_limits").append(_entry(
            id=id, feature=feature, scope=scope, per_seconds=per_seconds, limit=limit, **extra))
        return self

    def policy(self, policy_id: Value | None, *versions: Version, **extra: Value) -> Self:
        """A policy with its versions, each (version, effective_at, DSL)."""
        self._array("policies").append(_entry(id=policy_id, **extra))
        for version, effective_at, dsl in versions:
            self.version(policy_id, version, effective_at, dsl)
        return self

    def version(self, policy_id: Value | None, version: Value | None, effective_at: Value | None,
                dsl: Dsl | None, **extra: Value) -> Self:
        """One more version of the realm's last policy with this id. A builder without policies
        writes it as a version of whichever policy comes last in the document its text is
        appended to (`policy_id` then only names that one for the reader)."""
        policies = self._array("policies")
        found = [p for p in policies if p.get("id") == policy_id]
        if found:
            policy = found[-1]
        elif not policies:
            policy = _Continued()
            policies.append(policy)
        else:
            raise KeyError(f"no policy {policy_id!r} in this realm of the builder")
        if isinstance(dsl, Mapping):
            dsl = json.dumps(dsl)
        versions: list[_Table] = policy.setdefault("versions", [])
        versions.append(_entry(version=version, effective_at=effective_at, dsl_json=dsl, **extra))
        return self

    # ---- the text ---------------------------------------------------------------------------
    def toml(self) -> str:
        """The catalog as TOML: a section per table, in the order of the calls."""
        return emit_toml({"realms": self._realms})

    def __str__(self) -> str:
        return self.toml()

    def _table(self, name: str) -> _Table:
        table: _Table = self._realm.setdefault(name, {})
        return table

    def _entry(self, section: str, key: str) -> _Table:
        entry: _Table = self._table(section).setdefault(key, {})
        return entry

    def _array(self, name: str) -> list[_Table]:
        array: list[_Table] = self._realm.setdefault(name, [])
        return array


def _integer_string(value: Value | None) -> Value | None:
    """Money and quantities: an int becomes the integer string the catalog expects."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def _put(table: _Table, **values: Value | None) -> None:
    table.update((k, v) for k, v in values.items() if v is not None)


def _entry(**values: Value | None) -> _Table:
    table: _Table = {}
    _put(table, **values)
    return table


# ---- a TOML emitter for nested tables, arrays of tables and scalar values ---------------------
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}


def emit_toml(document: Mapping[str, Any]) -> str:
    """TOML text for `document`: dicts are tables, non-empty lists of dicts arrays of tables,
    anything else a value (str, int, bool, `Raw`, or a list of those). A table gets a header
    of its own when it holds values or nothing at all; one holding only tables is declared by
    theirs. Sections are separated by a blank line."""
    sections: list[str] = []
    _emit_table(document, (), sections, header=None)
    return "\n".join(sections)


def _is_table_array(node: Any) -> bool:
    return isinstance(node, list) and bool(node) and all(isinstance(x, dict) for x in node)


def _emit_table(table: Mapping[str, Any], path: tuple[str, ...], sections: list[str],
                header: str | None) -> None:
    values = [(k, v) for k, v in table.items() if not isinstance(v, dict) and not _is_table_array(v)]
    if header is not None:
        sections.append("".join([f"{header}\n", *(f"{_key(k)} = {_value(v)}\n" for k, v in values)]))
    elif values:  # the document's own keys, before any header
        sections.append("".join(f"{_key(k)} = {_value(v)}\n" for k, v in values))
    for key, node in table.items():
        sub = (*path, key)
        dotted = ".".join(_key(k) for k in sub)
        if isinstance(node, dict):
            has_values = any(not isinstance(v, dict) and not _is_table_array(v) for v in node.values())
            _emit_table(node, sub, sections, f"[{dotted}]" if has_values or not node else None)
        elif _is_table_array(node):
            for item in node:
                _emit_table(item, sub, sections, None if isinstance(item, _Continued) else f"[[{dotted}]]")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _value(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"no TOML value for {value!r} ({type(value).__name__}); use Raw for one as is")


def _string(text: str) -> str:
    """A basic string; a literal one ('...') when that needs no escapes (JSON reads better)."""
    if not _CONTROL.search(text):
        if '"' not in text and "\\" not in text:
            return f'"{text}"'
        if "'" not in text:
            return f"'{text}'"
    escaped = "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04X}" if _CONTROL.match(c) else c) for c in text)
    return f'"{escaped}"'
