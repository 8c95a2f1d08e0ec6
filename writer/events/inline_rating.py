"""Inline rating: a newly accepted single event is rated right after it is durable.

Runs in the writer process, after a group's replies are sent, on the events that group newly
accepted through POST /mgt/v1/events (`IngestHandler.accepted_singles`). The rating follows
the sweep's rules (`batch.rating_plan`) with the Python evaluator:
the policy version in force at occurred_at; `skipped_no_policy` when no policy matches,
`quarantined` (one row per matched policy) when several do, `deferred` for an aggregate
policy, else one `rated` row per (intent, meter) priced at occurred_at. Unlike the sweep it
prices every line on its own, without carry (`price_line(row, q, 0)`): the rating is
provisional, shown until a sweep rates the event and supersedes it.

The writer rates in steps between groups and hands the rows to its store, which writes them
to the operational table `inline_ratings` with its next transaction (they are not journaled:
a crash before then loses provisional rows only, and the sweep rates every event). `seq` is
strictly increasing across the table, and the exporter ships the rows to `lake.ratings` (run
`inline`). A failure here is logged by the caller and never changes a reply.
"""

from __future__ import annotations

from bisect import bisect_right
from datetime import datetime, timezone
from typing import Any, Protocol

import duckdb
import msgspec
import pyarrow as pa

from core.clock import SYSTEM_CLOCK, Clock
from pipelines.catalog import Catalog, Realm
from pipelines.pricing import PriceRow, price_line
from pipelines.rating import (
    EventFacts,
    Intent,
    PolicyDoc,
    evaluate,
    evaluate_aggregate,
    parse_policy,
)
from warehouse.journal import register_table
from warehouse.outbox import EventRecord

__all__ = ["InlineRater", "write_inline_ratings"]

_decode = msgspec.json.decode
_Row = tuple[Any, ...]
_COLUMNS = ["seq", "rating_id", "event_id", "realm", "billing_account_id", "status", "policy_id",
            "policy_version", "feature_code", "meter_code", "quantity_minor", "price_id",
            "unit_price_xusd", "unit_quantity_minor", "amount_xusd", "occurred_at", "rated_at",
            "line_index"]
_UTC = pa.timestamp("us", tz="UTC")
# The types of a row's values (all columns but seq), in order.
_TYPES = [pa.string(), pa.string(), pa.string(), pa.string(), pa.string(), pa.string(),
          pa.string(), pa.string(), pa.string(), pa.int64(), pa.string(), pa.int64(), pa.int64(),
          pa.int64(), _UTC, _UTC, pa.int32()]


class _CatalogSource(Protocol):
    current: Catalog


def _instant(us: int) -> datetime:
    return datetime.fromtimestamp(us // 1_000_000, tz=timezone.utc).replace(microsecond=us % 1_000_000)


def _rfc3339(moment: datetime) -> str:
    # isoformat, not strftime: glibc's %Y does not pad years before 1000 to four digits.
    return moment.astimezone(timezone.utc).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


class _RealmRules:
    """One realm's policies (parsed once) and price rows, for one applied catalog."""

    def __init__(self, realm: Realm) -> None:
        self.policies = [
            (policy_id, [(v.effective_at, v.version, parse_policy(v.document))
                         for v in realm.policies[policy_id].versions])
            for policy_id in sorted(realm.policies)
        ]
        # Per meter, its rows in effective_at order: the row in force at an instant is the
        # last one not after it (what pricing.select_price decides, without parsing text).
        self.prices: dict[str, tuple[list[datetime], list[PriceRow]]] = {}
        for price in sorted(realm.prices, key=lambda p: p.effective_at):
            starts, rows = self.prices.setdefault(price.meter, ([], []))
            starts.append(price.effective_at)
            rows.append(PriceRow(price.price_id, price.meter, price.unit_price_xusd,
                                 price.unit_quantity_minor, price.rounding,
                                 _rfc3339(price.effective_at)))

    def price(self, meter: str, at: datetime) -> PriceRow | None:
        starts, rows = self.prices.get(meter, ((), ()))
        index = bisect_right(starts, at)
        return rows[index - 1] if index else None

    def in_force(self, occurred_at: datetime) -> list[tuple[int, str, str, PolicyDoc]]:
        """(policy position, policy id, version, document) of each policy's version in force."""
        found = []
        for index, (policy_id, versions) in enumerate(self.policies):
            current = [v for v in versions if v[0] <= occurred_at]
            if current:
                _, version, document = max(current, key=lambda v: v[0])
                found.append((index, policy_id, version, document))
        return found


class InlineRater:
    """Rates single events in the writer process; see the module docstring."""

    def __init__(self, catalog: _CatalogSource, clock: Clock = SYSTEM_CLOCK) -> None:
        self._catalog = catalog
        self._clock = clock
        self._fingerprint: str | None = None
        self._rules: dict[str, _RealmRules] = {}
        self._seq: int | None = None

    def _realm(self, realm_id: str) -> _RealmRules | None:
        catalog = self._catalog.current
        if catalog.fingerprint != self._fingerprint:
            self._fingerprint, self._rules = catalog.fingerprint, {}
        rules = self._rules.get(realm_id)
        if rules is None and realm_id in catalog.realms:
            rules = self._rules[realm_id] = _RealmRules(catalog.realms[realm_id])
        return rules

    def rate(self, conn: duckdb.DuckDBPyConnection, items: list[tuple[str, EventRecord]]) -> list[_Row]:
        """Rate `items` (realm, event): their `inline_ratings` rows, `seq` first, numbered on
        from the table's last (`conn` is read for that once)."""
        rated_at = self._clock.now()
        rows = [row for realm, record in items for row in self._rows(realm, record, rated_at)]
        if not rows:
            return []
        if self._seq is None:
            # Exported rows leave the file (`warehouse.retention`): the export watermark
            # remembers how far the seqs went.
            found = conn.execute(
                "SELECT greatest((SELECT coalesce(max(seq), 0) FROM inline_ratings), (SELECT "
                "coalesce(max(last_seq), 0) FROM export_watermarks WHERE stream = 'inline_ratings'))"
            ).fetchall()  # read to its end: an open result holds its transaction
            self._seq = int(found[0][0]) if found else 0
        first = self._seq
        self._seq = first + len(rows)
        return [(first + i, *row) for i, row in enumerate(rows, 1)]

    def _rows(self, realm_id: str, record: EventRecord, rated_at: datetime) -> list[_Row]:
        occurred_at = _instant(record.occurred_at_us)
        head = (record.event_id, realm_id, record.billing_account_id)

        def row(status: str, line_index: int, policy: str | None = None, version: str | None = None,
                feature: str | None = None, meter: str | None = None, quantity: int | None = None,
                price: PriceRow | None = None, amount: int | None = None) -> _Row:
            return (f"{record.event_id}:{line_index}:inline", *head, status, policy, version,
                    feature, meter, quantity, price.price_id if price else None,
                    price.unit_price_xusd if price else None,
                    price.unit_quantity_minor if price else None, amount, occurred_at, rated_at,
                    line_index)

        rules = self._realm(realm_id)
        if rules is None:
            return [row("skipped_no_policy", 0)]
        facts = EventFacts(record.billing_account_id, record.semantic_kind, record.event_type,
                           _rfc3339(occurred_at), record.subject_ref,
                           _decode(record.payload_json), _decode(record.labels_json))
        matched: list[tuple[int, str, str, list[Intent] | None]] = []
        for index, policy_id, version, document in rules.in_force(occurred_at):
            if document.engine == "aggregate":
                if evaluate_aggregate(document, [facts]):
                    matched.append((index, policy_id, version, None))
            elif (intents := evaluate(document, facts)) is not None:
                matched.append((index, policy_id, version, intents))
        if not matched:
            return [row("skipped_no_policy", 0)]
        if len(matched) > 1:
            return [row("quarantined", index, policy_id, version)
                    for index, policy_id, version, _ in matched]
        _, policy_id, version, intents = matched[0]
        if intents is None:
            return [row("deferred", 0, policy_id, version)]
        rows: list[_Row] = []
        for intent in intents:
            for meter, quantity in intent.meters:
                # int(): the evaluator hands a payload boolean back as bool.
                quantity = int(quantity)
                price = rules.price(meter, occurred_at)
                amount = 0 if price is None else price_line(price, quantity, 0).amount_xusd
                rows.append(row("rated", len(rows), policy_id, version, intent.feature_code,
                                meter, quantity, price, amount))
        return rows


def write_inline_ratings(conn: duckdb.DuckDBPyConnection, rows: list[_Row]) -> None:
    """Insert rows made by `InlineRater.rate` (one Arrow insert, typed)."""
    columns = list(zip(*rows, strict=True))
    batch = pa.Table.from_arrays(  # noqa: F841 (read by DuckDB below)
        [pa.array(values, kind) for values, kind in zip(columns, [pa.int64(), *_TYPES], strict=True)],
        names=_COLUMNS)
    conn.execute(f"INSERT INTO inline_ratings ({', '.join(_COLUMNS)}) SELECT {', '.join(_COLUMNS)} FROM batch")


register_table("inline_ratings", write_inline_ratings)
