"""`load_catalog`: a whole catalog document parsed and validated, realm by realm and, in each
realm, section by section (in the order below, since a section checks its references against
the sections before it); `CatalogInvalid` names every fault at once."""

from __future__ import annotations

import hashlib
import tomllib
from typing import Any

from pipelines.catalog.accounts import read_accounts
from pipelines.catalog.features import read_families, read_features, read_meters
from pipelines.catalog.limits import read_budgets, read_quotas, read_rate_limits
from pipelines.catalog.model import ID_PATTERN, Catalog, Realm
from pipelines.catalog.policies import read_policies
from pipelines.catalog.prices import read_prices
from pipelines.catalog.reader import (
    CatalogFault,
    CatalogInvalid,
    DslValidator,
    FaultReader,
    RealmDraft,
    SectionReader,
)
from pipelines.catalog.realm_settings import read_settings

__all__ = ["load_catalog"]

# A realm's sections, in the order they are read: each may refer to those above it.
_SECTIONS: tuple[tuple[str, SectionReader], ...] = (
    ("settings", read_settings),
    ("accounts", read_accounts),
    ("families", read_families),
    ("meters", read_meters),
    ("features", read_features),
    ("prices", read_prices),
    ("quotas", read_quotas),
    ("budgets", read_budgets),
    ("rate_limits", read_rate_limits),
    ("policies", read_policies),
)


def _default_dsl_validator(document: dict[str, Any]) -> list[tuple[str, str]]:
    from pipelines.rating import validate_policy

    return [(err.path, err.message) for err in validate_policy(document)]


def load_catalog(text: str, *, dsl_validator: DslValidator | None = None) -> Catalog:
    """Parse and validate a whole catalog; raise `CatalogInvalid` naming every fault."""
    reader = FaultReader()
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CatalogInvalid([CatalogFault("$", f"not valid TOML: {exc}")]) from None
    reader.unknown_keys(tree, "$", ["realms"])
    realms_node = reader.table(tree.get("realms"), "realms", required=True)
    realms: dict[str, Realm] = {}
    for realm_id, node in realms_node.items():
        path = f"realms.{realm_id}"
        if not ID_PATTERN.fullmatch(realm_id):
            reader.fault(path, "realm id must be 1-128 chars of [A-Za-z0-9._:@/-]")
        realm = _read_realm(reader, realm_id, reader.table(node, path), path,
                            dsl_validator or _default_dsl_validator)
        if realm is not None:
            realms[realm_id] = realm
    if reader.faults:
        raise CatalogInvalid(reader.faults)
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
    return Catalog(realms=realms, fingerprint=fingerprint, source=text)


def _read_realm(r: FaultReader, realm_id: str, node: dict[str, Any], path: str,
                dsl_validator: DslValidator) -> Realm | None:
    """The realm of `node`, or None when any of its sections has a fault."""
    start = len(r.faults)
    r.unknown_keys(node, path, [key for key, _ in _SECTIONS])
    draft = RealmDraft(dsl_validator)
    for key, read_section in _SECTIONS:
        read_section(r, node.get(key), f"{path}.{key}", draft)
    if len(r.faults) > start:
        return None
    return draft.realm(realm_id)
