"""The gate book's counts, kept in memory by the writer process: its leases, the usage that
commits booked per UTC day, and what active leases hold. Windows are UTC calendar days and
months; a window's usage is summed from the days in it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import date, datetime

from writer.ops import GateOutcome

__all__ = ["Holds", "Lease", "Tally"]


def _window_start(window: str, today: date) -> date:
    return today if window == "day" else today.replace(day=1)


@dataclass(slots=True)
class Lease:
    lease_id: str
    token_sha: str
    realm: str
    principal_id: str
    account: str
    feature_code: str
    family: str
    held_qty: int
    held_xusd: int
    created_at: datetime
    expires_at: datetime
    state: str = "active"
    ended_at: datetime | None = None
    commit_body: bytes | None = None
    commit_outcome: GateOutcome | None = None


class Tally:
    """Quantity and amount per (realm, scope, scope id) and (feature, UTC day)."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str, str], dict[tuple[str, date], list[int]]] = defaultdict(dict)

    def add(self, realm: str, account: str, principal: str, feature: str, day: date,
            qty: int, xusd: int) -> None:
        for scope, sid in (("account", account), ("principal", principal)):
            cell = self.cells[(realm, scope, sid)].setdefault((feature, day), [0, 0])
            cell[0] += qty
            cell[1] += xusd

    def window(self, realm: str, scope: str, sid: str, window: str, today: date,
               features: Iterable[str] | None) -> tuple[int, int]:
        start = _window_start(window, today)
        wanted = None if features is None else set(features)
        qty = xusd = 0
        for (feature, day), (q, x) in self.cells.get((realm, scope, sid), {}).items():
            if start <= day <= today and (wanted is None or feature in wanted):
                qty += q
                xusd += x
        return qty, xusd

    def forget_before(self, first_day: date) -> None:
        for cells in self.cells.values():
            for key in [k for k in cells if k[1] < first_day]:
                del cells[key]


class Holds:
    """What active leases hold, per (realm, scope, scope id) and feature, plus funding."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str, str], dict[str, list[int]]] = defaultdict(dict)
        self.funding: dict[tuple[str, str], int] = defaultdict(int)

    def change(self, lease: Lease, sign: int) -> None:
        for scope, sid in (("account", lease.account), ("principal", lease.principal_id)):
            cell = self.cells[(lease.realm, scope, sid)].setdefault(lease.feature_code, [0, 0])
            cell[0] += sign * lease.held_qty
            cell[1] += sign * lease.held_xusd
        self.funding[(lease.realm, lease.account)] += sign * lease.held_xusd

    def held(self, realm: str, scope: str, sid: str, features: Iterable[str] | None) -> tuple[int, int]:
        cells = self.cells.get((realm, scope, sid), {})
        wanted = cells.keys() if features is None else features
        qty = xusd = 0
        for feature in wanted:
            cell = cells.get(feature)
            if cell:
                qty += cell[0]
                xusd += cell[1]
        return qty, xusd

