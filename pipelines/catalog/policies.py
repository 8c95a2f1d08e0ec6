"""The `policies` section of a realm: rating policies and their versions, each version's DSL
document checked by the DSL's validator and against the realm's features and meters."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from pipelines.catalog.model import ID_PATTERN, Feature, Meter, Policy, PolicyVersion
from pipelines.catalog.reader import DslValidator, FaultReader, RealmDraft

__all__ = ["read_policies"]


def read_policies(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    policies = realm.policies
    for i, pol_node in enumerate(r.array_of_tables(node, path)):
        pol_path = f"{path}[{i}]"
        r.unknown_keys(pol_node, pol_path, ["id", "versions"])
        pid = r.string(pol_node, "id", pol_path, pattern=ID_PATTERN)
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
            document = _read_dsl(r, dsl_text, f"{v_path}.dsl_json", realm.dsl_validator,
                                 realm.features, realm.meters)
            if None not in (version, eff, dsl_text, document):
                seen_versions.add(version)  # type: ignore[arg-type]
                versions.append(PolicyVersion(version, eff, dsl_text, document))  # type: ignore[arg-type]
        if pid is not None:
            policies[pid] = Policy(pid, tuple(sorted(versions, key=lambda v: v.effective_at)))


def _read_dsl(r: FaultReader, text: str | None, path: str, validator: DslValidator,
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
