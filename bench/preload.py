"""A history of synthetic events written straight into the stores, as the service would have
stored and exported them: the lake's events table (with its export_log), the writer's event
index with its watermark, and the export watermark in the operational file. Not through HTTP:
50 M events take minutes this way, not an hour.

    python bench/preload.py --data-dir D --count N [--seed S]

The data folder must be one where `tollgate serve` has run once and stopped (the demo catalog
and key exist, the operational file and the lake are made). The events are the demo realm's
(`acme`) and account's (`acct_prepaid`), never repeated (the seed and a counter are in their
payload), in `seq` order after whatever the folder holds. Each event's `event_id` is the
service's own derivation (`pipelines.events.validate_event`), so `first_event`, re-sent to
POST /mgt/v1/events with the demo account, answers 200 as a duplicate.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402

from core.layout import DataFolder  # noqa: E402
from pipelines.events import decode_event, format_instant, validate_event  # noqa: E402
from warehouse.event_index import EventIndex  # noqa: E402
from warehouse.lake import attach_lake, transaction  # noqa: E402
from warehouse.operational import open_operational  # noqa: E402

__all__ = ["preload"]

REALM = "acme"
ACCOUNT = "acct_prepaid"
EVENT_TYPE = "preload.synthetic"
CHUNK = 500_000
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_VARIANT = {c: "89ab"[int(c, 16) & 0x3] for c in "0123456789abcdef"}


def _body(seed: int, n: int, occurred_at: str) -> dict[str, Any]:
    return {"semantic_kind": "activity", "event_type": EVENT_TYPE, "occurred_at": occurred_at,
            "subject_ref": None, "payload": {"n": n, "seed": seed}, "labels": {}}


def _chunk(seed: int, first_n: int, count: int, base_us: int, first_seq: int,
           created_us: int, export_id: int) -> tuple[pa.Table, list[tuple[int, int, bytes, int, bytes]]]:
    """`count` events from counter `first_n`: the lake's rows and the index's entries. The
    facts' canonical JSON is assembled by hand in the order `pipelines.canonical` sorts it
    (checked against the service's own code for the first event of every run)."""
    sha256 = hashlib.sha256
    b64 = base64.urlsafe_b64encode
    head = f'{{"billing_account_id":"{ACCOUNT}","event_type":"{EVENT_TYPE}","occurred_at":"'.encode()
    realm_account = f"{REALM}\x00{ACCOUNT}\x00".encode()
    ids: list[str] = []
    raw_ids: list[bytes] = []
    hashes: list[str] = []
    occurred: list[int] = []
    payloads: list[str] = []
    for n in range(first_n, first_n + count):
        us = base_us + n * 1000
        stamp = format_instant(_EPOCH + timedelta(microseconds=us))
        payload = f'{{"n":{n},"seed":{seed}}}'
        facts = b"".join((head, stamp.encode(), b'","payload":', payload.encode(),
                          b',"semantic_kind":"activity","subject_ref":null}'))
        rh = b64(sha256(facts).digest()).rstrip(b"=").decode("ascii")
        h = sha256(realm_account + rh.encode()).digest()[:16].hex()
        eid = f"{h[:8]}-{h[8:12]}-8{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"
        ids.append(eid)
        raw_ids.append(bytes.fromhex(eid.replace("-", "")))
        hashes.append(rh)
        occurred.append(us)
        payloads.append(payload)
    seqs = list(range(first_seq, first_seq + count))
    table = pa.table({
        "event_id": pa.array(ids, pa.string()),
        "request_hash": pa.array(hashes, pa.string()),
        "occurred_us": pa.array(occurred, pa.int64()),
        "payload": pa.array(payloads, pa.string()),
        "seq": pa.array(seqs, pa.int64()),
    })
    entries = [(seq, us, raw, created_us, b"{}")
               for seq, us, raw in zip(seqs, occurred, raw_ids, strict=True)]
    return table, entries


def preload(data_dir: Path, count: int, *, seed: int = 0,
            occurred_from: datetime | None = None) -> dict[str, Any]:
    """Write `count` events into the lake, the index and the watermarks of `data_dir` (a
    folder `tollgate serve` has run in and left). Returns the count, the first event's JSON
    body (re-sendable with the demo account), the account and the realm. The events occur a
    millisecond apart from `occurred_from` (default: two days ago, at midnight UTC)."""
    folder = DataFolder(Path(data_dir).resolve())
    if not folder.operational.exists() or not folder.catalog.exists():
        raise SystemExit(f"{folder.root} is not a data folder `tollgate serve` has run in")
    now = datetime.now(timezone.utc)
    # Occurred from two days ago on, a millisecond apart (50 M events: 14 hours).
    base = occurred_from or (now - timedelta(days=2)).replace(hour=0, minute=0, second=0, microsecond=0)
    base_us = (base - _EPOCH) // timedelta(microseconds=1)
    created_us = (now - _EPOCH) // timedelta(microseconds=1)
    op = open_operational(folder.operational)
    lake = None
    index = None
    try:
        index = EventIndex(folder.index, 64 << 20)
        row = op.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()
        mark = op.execute("SELECT last_seq, export_id FROM export_watermarks WHERE stream = 'events'").fetchone()
        last_seq = max(int(row[0]) if row else 0, index.watermark, int(mark[0]) if mark else 0)
        if row and int(row[0]) > (int(mark[0]) if mark else 0):
            raise SystemExit("the operational file holds events not yet exported; start and stop "
                             "`tollgate serve` once more so they reach the lake first")
        lake = __import__("duckdb").connect()
        lake.execute("SET TimeZone = 'UTC'")
        attach_lake(lake, folder.root)
        got = lake.execute("SELECT coalesce(max(export_id), 0) FROM lake.export_log WHERE stream = 'events'").fetchone()
        export_id = int(got[0]) if got else 0
        first_body = _body(seed, 0, format_instant(base))
        # The service's own derivation of the first event, against the hand-made one.
        valid = validate_event(decode_event(json.dumps(first_body).encode()), realm=REALM,
                               billing_account_id=ACCOUNT, now=now, max_future_skew_seconds=300)
        _, entries0 = _chunk(seed, 0, 1, base_us, 1, created_us, 0)
        if isinstance(valid, list) or valid.event_id != str(__import__("uuid").UUID(bytes=entries0[0][2])):
            raise AssertionError(f"preload derives another event id than the service: {valid}")
        done = 0
        while done < count:
            n = min(CHUNK, count - done)
            export_id += 1
            first_seq = last_seq + 1
            table, entries = _chunk(seed, done, n, base_us, first_seq, created_us, export_id)
            with transaction(lake):
                lake.register("preload_batch", table)
                lake.execute(
                    "INSERT INTO lake.events (event_id, realm, billing_account_id, request_hash, "
                    "semantic_kind, event_type, occurred_at, subject_ref, payload, labels, created_at, "
                    "ingest_path, seq, export_id) "
                    f"SELECT event_id::UUID, '{REALM}', '{ACCOUNT}', request_hash, 'activity', "
                    f"'{EVENT_TYPE}', make_timestamptz(occurred_us), NULL, payload::JSON, '{{}}'::JSON, "
                    "make_timestamptz(?), 'batch', seq, ? FROM preload_batch ORDER BY seq",
                    [created_us, export_id])
                lake.execute("INSERT INTO lake.export_log VALUES ('events', ?, ?, ?, ?, ?)",
                             [export_id, first_seq, first_seq + n - 1, n, now])
                lake.unregister("preload_batch")
            index.add_events(entries)
            last_seq += n
            done += n
        op.execute(
            "INSERT INTO export_watermarks (stream, last_seq, export_id, exported_at) "
            "VALUES ('events', ?, ?, ?) ON CONFLICT (stream) DO UPDATE SET last_seq = excluded.last_seq, "
            "export_id = excluded.export_id, exported_at = excluded.exported_at",
            [last_seq, export_id, now])
        op.execute("CHECKPOINT")
    finally:
        if index is not None:
            index.close()
        if lake is not None:
            lake.close()
        op.close()
    return {"count": count, "first_event": first_body, "account": ACCOUNT, "realm": REALM}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    began = time.perf_counter()
    result = preload(Path(args.data_dir), args.count, seed=args.seed)
    took = time.perf_counter() - began
    print(f"preloaded {args.count:,} events in {took:.1f} s ({args.count / took:,.0f} events/s)")
    print(json.dumps(result["first_event"]))


if __name__ == "__main__":
    main()
