"""The `settings` section of a realm: its lease TTL, the lateness it allows events and the
clock skew it tolerates, each with its default."""

from __future__ import annotations

from typing import Any

from pipelines.catalog.model import MAX_SECONDS, RealmSettings
from pipelines.catalog.reader import FaultReader, RealmDraft

__all__ = ["read_settings"]


def read_settings(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    s_node = r.table(node, path)
    r.unknown_keys(s_node, path,
                   ["lease_ttl_seconds", "lateness_allowance_seconds", "max_future_skew_seconds"])
    realm.settings = RealmSettings(
        lease_ttl_seconds=r.integer(s_node, "lease_ttl_seconds", path, default=900, minimum=1,
                                    maximum=MAX_SECONDS) or 900,
        lateness_allowance_seconds=r.integer(s_node, "lateness_allowance_seconds", path,
                                             default=7200, maximum=MAX_SECONDS) or 0,
        max_future_skew_seconds=r.integer(s_node, "max_future_skew_seconds", path,
                                          default=300, maximum=MAX_SECONDS) or 0,
    )
