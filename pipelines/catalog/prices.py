"""The `prices` section of a realm: a meter's price rows, each in force from its
`effective_at` on; a row's id is its meter and that instant, to the second."""

from __future__ import annotations

from typing import Any

from pipelines.catalog.model import Price
from pipelines.catalog.reader import FaultReader, RealmDraft

__all__ = ["read_prices"]


def read_prices(r: FaultReader, node: Any, path: str, realm: RealmDraft) -> None:
    seen_prices: set[str] = set()
    for i, p_node in enumerate(r.array_of_tables(node, path)):
        p_path = f"{path}[{i}]"
        r.unknown_keys(p_node, p_path, ["meter", "unit_price_xusd", "unit_quantity_minor", "rounding", "effective_at"])
        meter = r.string(p_node, "meter", p_path)
        if meter is not None and meter not in realm.meters:
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
            realm.prices.append(Price(price_id, meter, unit_price, unit_qty, rounding, eff))  # type: ignore[arg-type]
