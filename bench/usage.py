"""Usage report latency: POST /mgt/v1/reports/usage for a month of one account, against the
bare DuckDB scan of the same lines, measured in the same run.

    python bench/usage.py [--events 10000000] [--repeat 30] [--keep DIR]

N events of one account over one month (October 2026) go straight into a fresh lake (as in
bench/rating.py: a bulk Arrow insert per million, no HTTP) and are swept (rated, priced and
written as the rating flows write them). Then `tollgate serve` starts on that data folder as
a user starts it (schedules on), and each report shape is asked `--repeat` times over HTTP,
signed, after one warm-up call:

- month total:      granularity month, aggregate total (one row)
- daily by meter:   granularity day, group_by [bucket_start, meter_code] (~90 rows)
- features, total:  aggregate group_total, group_by [feature_code], with counts

The raw limit is one DuckDB query on a read-only attach of the same lake summing the sweep's
lines per day and line kind for that account (what the report must at least read), timed
the same number of times. The target is 200 ms for a month of one account at 10 M events.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.auth import sign_headers  # noqa: E402
from bench.loopback import free_port  # noqa: E402
from bench.rating import BATCH, EVENTS_SQL, catalog_text, run_sweep  # noqa: E402
from pipelines.catalog import load_catalog  # noqa: E402
from warehouse.catalog_store import CatalogStore  # noqa: E402
from warehouse.lake import connect_lake  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ACCOUNT = "acct-0000"
MONTH = {"from": "2026-10-01T00:00:00Z", "to": "2026-11-01T00:00:00Z"}
SHAPES: dict[str, dict[str, Any]] = {
    "month total": {"time": {**MONTH, "granularity": "month"}, "group_by": ["bucket_start"],
                    "aggregate": "total"},
    "daily by meter": {"time": {**MONTH, "granularity": "day"}, "group_by": ["bucket_start", "meter_code"]},
    "features, total": {"time": {**MONTH, "granularity": "day"}, "group_by": ["feature_code"],
                        "aggregate": "group_total",
                        "metrics": ["quantity_minor", "amount_xusd", "line_count", "commit_count"]},
}
RAW = ("SELECT epoch_us(occurred_at) // 86400000000 AS d, line_id, sum(quantity_minor),"
       " sum(amount_xusd), count(*) FROM lake.rating_lines WHERE realm = 'bench' AND billing_account_id = ?"
       " AND occurred_at >= TIMESTAMPTZ '2026-10-01 00:00:00+00' AND occurred_at < TIMESTAMPTZ '2026-11-01 00:00:00+00'"
       " GROUP BY ALL")


def build(data_dir: Path, events: int) -> tuple[float, float]:
    """The lake: N events of one account, swept. Seconds to generate and to sweep."""
    began = time.monotonic()
    text = catalog_text()
    CatalogStore(data_dir / "catalog").apply(text, load_catalog(text).fingerprint)
    conn = connect_lake(data_dir)
    conn.execute("SET enable_progress_bar = false")
    for export_id, first in enumerate(range(0, events, BATCH), start=1):
        batch = conn.execute(EVENTS_SQL.format(  # noqa: F841 (read by DuckDB below)
            accounts=1, days=31, export_id=export_id, first=first,
            last=min(events, first + BATCH))).to_arrow_table()
        conn.execute("INSERT INTO lake.events SELECT * FROM batch")
    conn.close()
    generated = time.monotonic() - began
    swept = run_sweep(data_dir, 500_000)
    return generated, float(swept["seconds"])


def serve(data_dir: Path) -> tuple[subprocess.Popen[bytes], int, dict[str, str]]:
    cli = [sys.executable, "-m", "cli"]
    key = json.loads(subprocess.run([*cli, "keys", "create", "--realm", "bench", "--data-dir", str(data_dir)],
                                    check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    port = free_port()
    proc = subprocess.Popen([*cli, "serve", "--port", str(port), "--data-dir", str(data_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc, port, key
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def ask(client: httpx.Client, port: int, key: dict[str, str], body: dict[str, Any]) -> tuple[float, Any]:
    raw = json.dumps(body).encode()
    path = "/mgt/v1/reports/usage"
    headers = sign_headers(key_id=key["key_id"], secret=key["secret"], method="POST", path=path, body=raw,
                           realm="bench", billing_account_id=ACCOUNT)
    began = time.perf_counter()
    reply = client.post(f"http://127.0.0.1:{port}{path}", content=raw, headers=headers)
    took = (time.perf_counter() - began) * 1000
    if reply.status_code != 200:
        raise RuntimeError(f"{reply.status_code}: {reply.text[:300]}")
    return took, reply.json()["data"]


def figures(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]
    return f"p50 {statistics.median(ordered):7.1f} ms  p95 {p95:7.1f} ms  max {ordered[-1]:7.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--keep", type=Path, default=None, help="reuse (or keep) the lake in this folder")
    args = parser.parse_args(argv)
    print(f"nproc {os.cpu_count()}  (sched_getaffinity {len(os.sched_getaffinity(0))})")
    data_dir = args.keep or Path(tempfile.mkdtemp(prefix="tollgate-usage-"))
    if not (data_dir / "lake" / "catalog.sqlite").exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        generated, swept = build(data_dir, args.events)
        print(f"lake: {args.events:,} events of one account in October 2026; generated in {generated:.1f} s,"
              f" swept in {swept:.1f} s")
    raw_conn = connect_lake(data_dir, read_only=True)
    lines = raw_conn.execute("SELECT count(*) FROM lake.rating_lines WHERE billing_account_id = ?",
                             [ACCOUNT]).fetchone()
    print(f"rating lines of the account: {lines[0] if lines else 0:,}")
    proc, port, key = serve(data_dir)
    try:
        with httpx.Client(timeout=60) as client:
            for name, body in SHAPES.items():
                ask(client, port, key, body)  # warm-up: the first call attaches the lake
                times, data = [], None
                for _ in range(args.repeat):
                    took, data = ask(client, port, key, body)
                    times.append(took)
                rows = len(data["rows"]) if data else 0
                total = data["totals"].get("amount_xusd") if data else None
                print(f"report {name:16} {figures(times)}  rows {rows:4}  amount_xusd {total}")
        raw_times = []
        for _ in range(args.repeat):
            began = time.perf_counter()
            raw_conn.execute(RAW, [ACCOUNT]).fetchall()
            raw_times.append((time.perf_counter() - began) * 1000)
        print(f"raw DuckDB scan        {figures(raw_times)}  (the sweep's lines per day and kind)")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        raw_conn.close()
        if args.keep is None:
            shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
