"""Reading a catalog document while collecting its faults: what a fault is, the reader of
typed values out of the TOML tree that records one instead of stopping, and the draft of a
realm that the section readers fill in turn.

Every section reader (`pipelines.catalog.accounts`, `.features`, `.limits`, ...) has one
shape, `SectionReader`: it is handed the section's raw value and dotted path and the realm's
draft, reads the section into the draft, and checks the references it makes against what
earlier sections put there. So the faults of a catalog come out in one pass, each with the
path of the value at fault.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import msgspec

from core.constants import INT64_MAX
from pipelines.catalog.model import (
    Account,
    Budget,
    Feature,
    Meter,
    Policy,
    Price,
    Quota,
    RateLimit,
    Realm,
    RealmSettings,
)

__all__ = ["CatalogFault", "CatalogInvalid", "DslValidator", "FaultReader", "RealmDraft", "SectionReader"]


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


class FaultReader:
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



# A rating policy's DSL document checked: the (path, message) of each fault, `$`-rooted.
DslValidator = Callable[[dict[str, Any]], list[tuple[str, str]]]


@dataclass(slots=True)
class RealmDraft:
    """A realm while its sections are read, in document order: each section reader fills its
    part, and a later section checks its references against an earlier one's (a feature's
    meters, a quota's accounts, a policy's features)."""

    dsl_validator: DslValidator
    settings: RealmSettings = field(default_factory=RealmSettings)
    accounts: dict[str, Account] = field(default_factory=dict)
    principal_account: dict[str, str] = field(default_factory=dict)
    families: frozenset[str] = frozenset()
    meters: dict[str, Meter] = field(default_factory=dict)
    features: dict[str, Feature] = field(default_factory=dict)
    prices: list[Price] = field(default_factory=list)
    quotas: list[Quota] = field(default_factory=list)
    budgets: list[Budget] = field(default_factory=list)
    rate_limits: list[RateLimit] = field(default_factory=list)
    policies: dict[str, Policy] = field(default_factory=dict)

    def realm(self, realm_id: str) -> Realm:
        return Realm(
            id=realm_id, settings=self.settings, accounts=self.accounts,
            principal_account=self.principal_account, families=self.families, meters=self.meters,
            features=self.features, prices=tuple(self.prices), quotas=tuple(self.quotas),
            budgets=tuple(self.budgets), rate_limits=tuple(self.rate_limits), policies=self.policies,
        )


# (the reader, the section's raw value, its dotted path, the realm being read)
SectionReader = Callable[[FaultReader, Any, str, RealmDraft], None]
