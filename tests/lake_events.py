"""Events into a lake the way the service puts them there: validated, stored in an operational
file by the outbox, then shipped by the lake exporter. For tests of the rating runs that need
no HTTP server."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec

from api.events.views import to_record
from batch.rating_plan import RatingPlan
from pipelines.catalog import load_catalog
from pipelines.events import EventIn, ValidEvent, validate_event
from tests.catalog_builder import CatalogBuilder
from warehouse.catalog_store import CatalogStore
from warehouse.export import LakeExporter
from warehouse.operational import open_operational
from warehouse.outbox import EventOutbox
from warehouse.writer import Transaction

FAR_FUTURE = datetime(2100, 1, 1, tzinfo=timezone.utc)


def event(account: str, event_type: str, occurred_at: str, payload: dict[str, Any],
          *, realm: str = "acme", subject: str | None = None) -> ValidEvent:
    body = {"semantic_kind": "activity", "event_type": event_type, "occurred_at": occurred_at,
            "subject_ref": subject, "payload": payload}
    item = msgspec.json.decode(json.dumps(body).encode(), type=EventIn)
    valid = validate_event(item, realm=realm, billing_account_id=account, now=FAR_FUTURE,
                           max_future_skew_seconds=300)
    assert isinstance(valid, ValidEvent), valid
    return valid


class LakeFeed:
    """An operational file and its exporter, writing into the lake of `data_dir`."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.conn = open_operational(data_dir / "operational.duckdb")
        self.outbox = EventOutbox(self.conn)
        self.exporter = LakeExporter(data_dir)

    def add(self, *events: ValidEvent, realm: str = "acme", path: str = "batch") -> list[str]:
        """Store the events (one group) and export them; their event ids, in order."""
        self.conn.execute("BEGIN")
        tx = Transaction(self.conn, datetime.now(timezone.utc))
        for item in events:
            self.outbox.stage(tx, realm, to_record(item), path)
        tx.flush()
        tx.commit()
        self.conn.execute("COMMIT")
        self.exporter.export_once(self.conn)
        return [item.event_id for item in events]

    def close(self) -> None:
        self.exporter.close()
        self.conn.close()


def apply_catalog(data_dir: Path, text: str) -> RatingPlan:
    """Apply `text` to `data_dir` as `tollgate catalog apply` does (recorded in the lake, then
    stored for the service); its rating plan."""
    from warehouse.catalog_history import record_catalog

    catalog = load_catalog(text)
    record_catalog(data_dir, catalog)
    CatalogStore(data_dir / "catalog").apply(text, catalog.fingerprint)
    return RatingPlan.from_catalog(catalog)


def catalog_toml(*, policies: str, prices: str, lateness_seconds: int = 7200) -> str:
    """A one-realm catalog (realm acme, accounts acct_a and acct_b) with these policies and
    prices (catalog text of `policy` and `price`) over the meters tokens.in, tokens.out, calls
    and seats."""
    base = (CatalogBuilder("acme")
            .settings(lateness_allowance_seconds=lateness_seconds)
            .account("acct_a", "postpaid", principals=["p-a"])
            .account("acct_b", "postpaid", principals=["p-b"])
            .meter("tokens.in", "token").meter("tokens.out", "token")
            .meter("calls", "call").meter("seats", "seat")
            .feature("llm.chat", "tokens.in", meters=["tokens.in", "tokens.out"])
            .feature("api.search", "calls")
            .feature("team.seats", "seats"))
    return "\n".join((base.toml(), prices, policies))


def price(meter: str, unit_price: int, unit_quantity: int, effective_at: str,
          rounding: str = "floor") -> str:
    """A price row of realm acme, as text to add to `catalog_toml`'s (several add up)."""
    return "\n" + CatalogBuilder("acme").price(
        meter, unit_price, effective_at, unit_quantity_minor=unit_quantity, rounding=rounding).toml()


def policy(policy_id: str, *versions: tuple[str, str, dict[str, Any]]) -> str:
    """A policy of realm acme with versions (version, effective_at, DSL document), as text to
    add to `catalog_toml`'s (several add up)."""
    return "\n" + CatalogBuilder("acme").policy(policy_id, *versions).toml()


def single(event_type: str, feature: str, meters: dict[str, Any],
           where: dict[str, Any] | None = None) -> dict[str, Any]:
    match: dict[str, Any] = {"event_type": event_type}
    if where is not None:
        match["where"] = where
    return {"dsl_version": "v1", "engine": "single", "match": match,
            "emit": {"intents": [{"feature_code": feature, "meters": [
                {"meter_code": code, "quantity_minor": quantity} for code, quantity in meters.items()]}]}}


def aggregate(event_type: str, feature: str, meter: str, agg: dict[str, Any]) -> dict[str, Any]:
    return {"dsl_version": "v1", "engine": "aggregate", "match": {"event_type": event_type},
            "emit": {"intents": [{"feature_code": feature, "meters": [
                {"meter_code": meter, "quantity_minor": {"agg": agg}}]}]}}
