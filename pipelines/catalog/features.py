"""The `families`, `meters` and `features` sections of a realm: what is metered, and the
features that meter it (each in at most one family, with a primary meter among its meters)."""

from __future__ import annotations

from typing import Any

from pipelines.catalog.model import CODE_PATTERN, MAX_SECONDS, Feature, Meter
from pipelines.catalog.reader import FaultReader, RealmDraft

__all__ = ["read_families", "read_features", "read_meters"]


def read_families(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    families_node = r.table(node, path)
    for fam, fam_node in families_node.items():
        if not CODE_PATTERN.fullmatch(fam):
            r.fault(f"{path}.{fam}", "family code must be lower-case [a-z0-9._/@:-], 1-128 chars")
        r.unknown_keys(r.table(fam_node, f"{path}.{fam}"), f"{path}.{fam}", [])
    realm.families = frozenset(families_node)


def read_meters(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    for code, m_node in r.table(node, path).items():
        m_path = f"{path}.{code}"
        m_node = r.table(m_node, m_path)
        r.unknown_keys(m_node, m_path, ["unit"])
        if not CODE_PATTERN.fullmatch(code):
            r.fault(m_path, "meter code must be lower-case [a-z0-9._/@:-], 1-128 chars")
            continue
        unit = r.string(m_node, "unit", m_path, default="unit")
        realm.meters[code] = Meter(code, unit if unit is not None else "unit")


def read_features(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    meters = realm.meters
    for code, f_node in r.table(node, path).items():
        f_path = f"{path}.{code}"
        f_node = r.table(f_node, f_path)
        r.unknown_keys(f_node, f_path, ["family", "primary_meter", "meters", "lease_ttl_seconds", "active"])
        if not CODE_PATTERN.fullmatch(code):
            r.fault(f_path, "feature code must be lower-case [a-z0-9._/@:-], 1-128 chars")
            continue
        family = f_node.get("family")
        if family is not None and not isinstance(family, str):
            r.fault(f"{f_path}.family", "must be a string")
            family = None
        elif family is not None and family not in realm.families:
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
            ttl = r.integer(f_node, "lease_ttl_seconds", f_path, minimum=1, maximum=MAX_SECONDS)
        active = f_node.get("active", True)
        if not isinstance(active, bool):
            r.fault(f"{f_path}.active", "must be a boolean")
            active = True
        if primary is not None:
            realm.features[code] = Feature(code, family, primary, allowed, ttl, active)
