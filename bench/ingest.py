"""Event ingestion over loopback: batch events/s, single requests/s with p50/p99, and the raw
limit measured in the same run (msgspec decode + validate + hash + DuckDB Arrow insert of the
same events in-process, no HTTP, no auth).

    python bench/ingest.py [--batches 200] [--singles 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402

from api.auth import sign_headers  # noqa: E402
from api.events.views import to_record  # noqa: E402
from bench.loopback import Connection, percentile, run, start_server  # noqa: E402
from pipelines.events import ValidEvent, decode_event, validate_event  # noqa: E402
from warehouse.operational import open_operational  # noqa: E402
from warehouse.outbox import EventOutbox  # noqa: E402
from warehouse.writer import Transaction  # noqa: E402

ACCOUNT = "acct_prepaid"


def make_event(i: int) -> dict:
    return {"semantic_kind": "activity", "event_type": "llm.completion",
            "occurred_at": f"2026-11-20T10:{i // 60 % 60:02d}:{i % 60:02d}Z",
            "subject_ref": f"req-{uuid.uuid4()}",
            "payload": {"schema": 2, "model": "m-large", "usage": {"input_tokens": 1000 + i % 977,
                                                                     "output_tokens": 200 + i % 311}},
            "labels": {"env": "prod", "region": "eu-west"}}


def signed(server, path: str, body: bytes) -> dict[str, str]:
    return sign_headers(key_id=server.key_id, secret=server.secret, method="POST", path=path, body=body,
                        realm="acme", billing_account_id=ACCOUNT)


async def run_batches(server, bodies: list[bytes], clients: int) -> float:
    queue = list(reversed(bodies))

    async def worker() -> None:
        conn = await Connection.open(server.port)
        while queue:
            body = queue.pop()
            status, reply = await conn.request("POST", "/mgt/v1/events/batch",
                                               signed(server, "/mgt/v1/events/batch", body), body)
            assert status == 207, reply[:300]
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - t0


async def run_singles(server, bodies: list[bytes], clients: int) -> tuple[float, list[float]]:
    queue = list(reversed(bodies))
    latencies: list[float] = []

    async def worker() -> None:
        conn = await Connection.open(server.port)
        while queue:
            body = queue.pop()
            headers = signed(server, "/mgt/v1/events", body)
            t = time.perf_counter()
            status, reply = await conn.request("POST", "/mgt/v1/events", headers, body)
            latencies.append(time.perf_counter() - t)
            assert status == 201, reply[:300]
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - t0, sorted(latencies)


def raw_limit(bodies: list[bytes]) -> float:
    """Decode + validate + hash + Arrow insert with dedupe, in-process, one commit per batch."""
    folder = Path(tempfile.mkdtemp(prefix="tollgate-raw-"))
    conn = open_operational(folder / "raw.duckdb")
    outbox = EventOutbox(conn)
    decode = msgspec.json.Decoder(dict[str, list[msgspec.Raw]]).decode
    now = datetime.now(timezone.utc)
    n = 0
    t0 = time.perf_counter()
    for body in bodies:
        events = []
        for raw in decode(body)["events"]:
            ev = validate_event(decode_event(raw), realm="acme", billing_account_id=ACCOUNT, now=now,
                                max_future_skew_seconds=300, floats_normalized=True)
            assert isinstance(ev, ValidEvent)
            events.append(ev)
        conn.execute("BEGIN")
        tx = Transaction(conn, now)
        for ev in events:
            outbox.stage(tx, "acme", to_record(ev), "batch")
        tx.flush()
        tx.commit()
        conn.execute("COMMIT")
        n += len(events)
    rate = n / (time.perf_counter() - t0)
    conn.close()
    shutil.rmtree(folder, ignore_errors=True)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--batch-clients", type=int, default=8)
    parser.add_argument("--singles", type=int, default=20000)
    parser.add_argument("--single-clients", type=int, default=64)
    parser.add_argument("--catalog", type=Path, default=None, help="catalog to apply (default: the demo)")
    args = parser.parse_args()

    counter = iter(range(10**9))
    batch_bodies = [json.dumps({"events": [make_event(next(counter)) for _ in range(args.batch_size)]}).encode()
                    for _ in range(args.batches)]
    raw_bodies = [json.dumps({"events": [make_event(next(counter)) for _ in range(args.batch_size)]}).encode()
                  for _ in range(args.batches)]
    single_bodies = [json.dumps(make_event(next(counter))).encode() for _ in range(args.singles)]

    print(f"nproc={os.cpu_count()}  python={sys.version.split()[0]}")
    server = start_server(args.catalog)
    try:
        warm = [json.dumps(make_event(next(counter))).encode() for _ in range(500)]
        run(run_singles(server, warm, 16))
        elapsed = run(run_batches(server, batch_bodies, args.batch_clients))
        batch_rate = args.batches * args.batch_size / elapsed
        elapsed, lat = run(run_singles(server, single_bodies, args.single_clients))
        single_rate = args.singles / elapsed
    finally:
        server.stop()
    raw_rate = raw_limit(raw_bodies)
    print(f"batch ingest : {batch_rate:10,.0f} events/s  ({args.batches} x {args.batch_size}-event batches, "
          f"{args.batch_clients} clients)")
    print(f"raw limit    : {raw_rate:10,.0f} events/s  (in-process decode+validate+hash+Arrow insert, no HTTP)")
    print(f"batch / raw  : {batch_rate / raw_rate:10.0%}")
    print(f"single ingest: {single_rate:10,.0f} requests/s ({args.singles} requests, {args.single_clients} clients)"
          f"  p50 {percentile(lat, 0.50) * 1000:.1f} ms  p99 {percentile(lat, 0.99) * 1000:.1f} ms")


if __name__ == "__main__":
    main()
