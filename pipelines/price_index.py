"""The price rows of a realm by meter, and the fingerprint a priced line reports: what the
gate book prices with and what the limit endpoints show."""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from pipelines.catalog import Realm
from pipelines.pricing import PriceRow

__all__ = ["PriceIndex", "price_fingerprint"]


@dataclass(slots=True)
class PriceIndex:
    """Price rows of one realm by meter, sorted by effective_at, for the hot path."""

    by_meter: dict[str, tuple[list[datetime], list[PriceRow]]] = field(default_factory=dict)

    @staticmethod
    def of(realm: Realm) -> PriceIndex:
        rows: dict[str, list[tuple[datetime, PriceRow]]] = defaultdict(list)
        for p in realm.prices:
            rows[p.meter].append((p.effective_at, PriceRow(
                price_id=p.price_id, meter_code=p.meter, unit_price_xusd=p.unit_price_xusd,
                unit_quantity_minor=p.unit_quantity_minor, rounding=p.rounding,
                effective_at=p.effective_at.isoformat())))
        index = PriceIndex()
        for meter, items in rows.items():
            items.sort(key=lambda t: t[0])
            index.by_meter[meter] = ([t[0] for t in items], [t[1] for t in items])
        return index

    def at(self, meter: str, moment: datetime) -> PriceRow | None:
        """The row in force at `moment`: greatest effective_at <= moment (as select_price)."""
        found = self.by_meter.get(meter)
        if not found:
            return None
        i = bisect.bisect_right(found[0], moment)
        return found[1][i - 1] if i else None


@functools.lru_cache(maxsize=4096)
def price_fingerprint(row: PriceRow) -> str:
    """The row's id and terms, hashed: what a commit line reports, and the key its carried
    remainder is kept under, so a row whose terms change in a re-applied catalog starts its
    carry afresh instead of carrying a remainder measured in other blocks."""
    text = f"{row.price_id}|{row.unit_price_xusd}|{row.unit_quantity_minor}|{row.rounding}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
