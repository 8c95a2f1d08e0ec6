"""Rating sweep throughput and memory, next to the raw limit measured in the same run.

    python bench/rating.py [--events 5000000] [--sizes 1000000,5000000,20000000]
                           [--repeat 3] [--chunk-events 500000] [--keep DIR]
                           [--shape spread|seconds]

For each size: N events across 1,000 accounts and 30 days go straight into a fresh lake (a
bulk Arrow insert per million, no HTTP), with a generated catalog of three single-engine
policies (LLM tokens in two meters priced per 1,000 with carry, API calls, storage KiB) and
one aggregate policy (peak seats per day). Then, each in a process of its own so that peak
memory (ru_maxrss) is the step's own:

- the sweep: every event rated, priced and written to lake.ratings (events/s, peak memory);
- the raw limit: one DuckDB scan of the same events extracting the same payload paths
  (json_extract_string per path, as an analyst would write it), run just before and just
  after the sweep (the machine's speed moves within minutes; their mean is the limit).

With `--shape seconds` the events are instead ten accounts' over one hour, in whole seconds:
the shape of clients that send seconds, where thousands of an account's lines tie at each
instant and the carry must order them (docs/measurements.md, "Ties at one instant").

The sweep's share of the raw scan's rate is printed last, with its CPU seconds against the
raw scan's. `nproc` is printed first: the targets are for 2 cores.

The machine's speed moves by a tenth or more from one run to the next, so each size is
measured `--repeat` times (3 by default) on the same generated lake, restored from a copy
before each repetition (raw, sweep, raw): every sweep is compared with the scans just before
and after it. Each repetition is printed, then the medians of the rate and of the share
(each over the repetitions, so they may come from different ones). The raw scan runs as a
bare DuckDB scan, without the flows' process settings.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch.chunks import CHUNK_EVENTS  # noqa: E402
from batch.rating_plan import RatingPlan  # noqa: E402
from batch.rating_runs import RatingLock  # noqa: E402
from batch.sweep import sweep  # noqa: E402
from flows.workspace import close_lake, open_lake, scratch_dir  # noqa: E402
from pipelines.catalog import load_catalog  # noqa: E402
from tests.catalog_builder import CatalogBuilder  # noqa: E402
from warehouse.catalog_store import CatalogStore  # noqa: E402
from warehouse.lake import connect_lake  # noqa: E402

ACCOUNTS = 1000
DAYS = 30
# The events' shapes: (accounts used, span of occurred_at in microseconds, its step). "spread"
# is the default above; "seconds" is traffic from clients that send whole seconds, an hour of
# it from ten accounts, so thousands of an account's events share each instant (the soak's
# shape: its sweeps order those ties).
SHAPES = {"spread": (ACCOUNTS, DAYS * 86_400_000_000, 1), "seconds": (10, 3_600_000_000, 1_000_000)}
BATCH = 1_000_000
# The payload paths the single-engine policies read (the aggregate one is rated per day).
PATHS = ("$.usage.input_tokens", "$.usage.output_tokens", "$.status", "$.bytes")

# The generated catalog's policies (realm bench): three single-engine, one aggregate.
POLICIES: dict[str, dict[str, Any]] = {
    "llm": {"dsl_version": "v1", "engine": "single",
            "match": {"event_type": "llm.completion", "where": {"gt": [{"payload": "usage.input_tokens"}, 0]}},
            "emit": {"intents": [{"feature_code": "llm.chat", "meters": [
                {"meter_code": "llm.input_tokens", "quantity_minor": {"payload_int": "usage.input_tokens"}},
                {"meter_code": "llm.output_tokens", "quantity_minor": {"payload_int": "usage.output_tokens"}}]}]}},
    "api": {"dsl_version": "v1", "engine": "single",
            "match": {"event_type": "api.request", "where": {"lt": [{"payload": "status"}, 500]}},
            "emit": {"intents": [{"feature_code": "api.search", "meters": [
                {"meter_code": "api.calls", "quantity_minor": {"const": 1}}]}]}},
    "storage": {"dsl_version": "v1", "engine": "single",
                "match": {"event_type": "storage.write"},
                "emit": {"intents": [{"feature_code": "storage", "meters": [
                    {"meter_code": "storage.kib", "quantity_minor":
                        {"div": [{"payload_int": "bytes"}, {"const": 1024}], "rounding": "ceil"}}]}]}},
    "seats": {"dsl_version": "v1", "engine": "aggregate",
              "match": {"event_type": "seats.snapshot"},
              "emit": {"intents": [{"feature_code": "seats", "meters": [
                  {"meter_code": "seats", "quantity_minor": {"agg": {"op": "max", "of": {"payload": "seats"}}}}]}]}},
}

# Six in ten events are LLM completions, two API requests (one in seven of those failed, so
# not billed), one a storage write, one a seats snapshot.
EVENTS_SQL = """
SELECT uuid() AS event_id, 'bench' AS realm,
       'acct-' || lpad(CAST(hash(i) % {accounts} AS VARCHAR), 4, '0') AS billing_account_id,
       'h' || i AS request_hash, 'activity' AS semantic_kind,
       CASE i % 10 WHEN 0 THEN 'seats.snapshot' WHEN 1 THEN 'storage.write'
            WHEN 2 THEN 'api.request' WHEN 3 THEN 'api.request' ELSE 'llm.completion' END AS event_type,
       TIMESTAMPTZ '2026-10-01 00:00:00+00'
         + to_microseconds(CAST(hash(i * 7 + 1) % {span_us} // {step_us} * {step_us} AS BIGINT)) AS occurred_at,
       CAST(NULL AS VARCHAR) AS subject_ref,
       CAST(CASE i % 10
         WHEN 0 THEN '{{"seats":' || (hash(i) % 50) || '}}'
         WHEN 1 THEN '{{"bytes":' || (hash(i) % 100000) || '}}'
         WHEN 2 THEN '{{"endpoint":"/search","status":200}}'
         WHEN 3 THEN '{{"endpoint":"/search","status":' || CASE WHEN i % 7 = 0 THEN 503 ELSE 200 END || '}}'
         ELSE '{{"model":"m' || (i % 3) || '","usage":{{"input_tokens":' || (hash(i) % 5000)
              || ',"output_tokens":' || (hash(i + 1) % 2000) || '}}}}' END AS JSON) AS payload,
       CAST('{{"env":"prod"}}' AS JSON) AS labels, now() AS created_at, 'batch' AS ingest_path,
       i + 1 AS seq, {export_id} AS export_id
FROM range({first}, {last}) AS t(i)
"""


def catalog_text() -> str:
    """The generated catalog: realm bench, ACCOUNTS postpaid accounts, the meters of POLICIES
    (LLM tokens priced per 1,000 with carry, API calls, storage KiB, seats) and POLICIES."""
    jan = "2026-01-01T00:00:00Z"
    catalog = CatalogBuilder("bench").settings(lateness_allowance_seconds=7200)
    for n in range(ACCOUNTS):
        catalog.account(f"acct-{n:04d}", "postpaid")
    (catalog
     .meter("llm.input_tokens", "token").meter("llm.output_tokens", "token")
     .meter("api.calls", "call").meter("storage.kib", "KiB").meter("seats", "seat")
     .feature("llm.chat", "llm.input_tokens", meters=["llm.input_tokens", "llm.output_tokens"])
     .feature("api.search", "api.calls")
     .feature("storage", "storage.kib")
     .feature("seats", "seats")
     .price("llm.input_tokens", 150, jan, unit_quantity_minor=1000, rounding="floor")
     .price("llm.output_tokens", 600, jan, unit_quantity_minor=1000, rounding="ceil")
     .price("api.calls", 2000, jan, unit_quantity_minor=1)
     .price("storage.kib", 3, jan, unit_quantity_minor=1024, rounding="nearest")
     .price("seats", 1_000_000, jan, unit_quantity_minor=1))
    for policy_id, document in POLICIES.items():
        catalog.policy(policy_id, ("v1", jan, document))
    return catalog.toml()


def generate(data_dir: Path, events: int, shape: str = "spread") -> float:
    """Fill a fresh lake with `events` events of `shape` and apply the catalog; seconds taken."""
    accounts, span_us, step_us = SHAPES[shape]
    began = time.monotonic()
    text = catalog_text()
    CatalogStore(data_dir / "catalog").apply(text, load_catalog(text).fingerprint)
    conn = connect_lake(data_dir)
    conn.execute("SET enable_progress_bar = false")
    for export_id, first in enumerate(range(0, events, BATCH), start=1):
        batch = conn.execute(EVENTS_SQL.format(  # noqa: F841 (read by DuckDB below)
            accounts=accounts, span_us=span_us, step_us=step_us, export_id=export_id, first=first,
            last=min(events, first + BATCH))).to_arrow_table()
        conn.execute("INSERT INTO lake.events SELECT * FROM batch")
    conn.close()
    return time.monotonic() - began


def run_sweep(data_dir: Path, chunk_events: int) -> dict[str, float]:
    text = CatalogStore(data_dir / "catalog").read() or ""
    plan = RatingPlan.from_catalog(load_catalog(text))
    conn = open_lake(data_dir)  # the flows' settings: memory capped, spilling next to the lake
    began, cpu = time.monotonic(), _cpu()
    runs = sweep(conn, plan, RatingLock(data_dir / "lake" / "rating.lock"),
                 chunk_events=chunk_events, scratch=scratch_dir(data_dir))
    seconds, cpu = time.monotonic() - began, _cpu() - cpu
    close_lake(conn)
    return {"seconds": seconds, "cpu": cpu, "events": sum(r.events for r in runs),
            "lines": sum(r.lines for r in runs), "runs": len(runs)}


def run_raw_scan(data_dir: Path) -> dict[str, float]:
    conn = connect_lake(data_dir, read_only=True)
    reads = ", ".join(f"sum(TRY_CAST(json_extract_string(payload, '{p}') AS BIGINT))" for p in PATHS)
    began, cpu = time.monotonic(), _cpu()
    row = conn.execute(f"SELECT count(*), {reads} FROM lake.events").fetchone()
    seconds, cpu = time.monotonic() - began, _cpu() - cpu
    conn.close()
    return {"seconds": seconds, "cpu": cpu, "events": int(row[0]) if row else 0}


def _cpu() -> float:
    """CPU seconds this process has used, on all its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _in_child(step: str, data_dir: Path, chunk_events: int, events: int = 0,
              shape: str = "spread") -> dict[str, float]:
    """Run a step in a fresh process; its result plus that process's peak RSS."""
    out = subprocess.run(
        [sys.executable, __file__, "--step", step, "--data-dir", str(data_dir),
         "--chunk-events", str(chunk_events), "--events", str(events), "--shape", shape],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gib(kib: float) -> str:
    return f"{kib / 1024 / 1024:.2f} GiB"


def _restore(folder: Path, pristine: Path) -> None:
    """The data folder as generated (the lake records its absolute data path, so it is
    copied back to where it was made)."""
    shutil.rmtree(folder)
    shutil.copytree(pristine, folder, symlinks=True)
    os.sync()


def bench(events: int, chunk_events: int, keep: Path | None, repeat: int = 3,
          shape: str = "spread") -> None:
    folder = Path(tempfile.mkdtemp(prefix="tollgate-bench-", dir=keep))
    pristine = folder.with_name(folder.name + "-generated")
    try:
        # Generated in a process of its own too: a bench process that had generated the
        # lake itself measured its sweeps 10-15 % slower than the same sweeps started
        # from a fresh process (the same lake, restored from a copy).
        seconds = _in_child("generate", folder, chunk_events, events, shape)["seconds"]
        print(f"events={events:,} shape={shape}: generated in {seconds:.1f} s", flush=True)
        if repeat > 1:
            shutil.copytree(folder, pristine, symlinks=True)
        # The lake just written goes to disk now, not during the steps measured (on 2 cores
        # the kernel's writeback took a third off a 1 M event sweep that overlapped it).
        os.sync()
        # The raw scan just before and just after each sweep, on the lake it sweeps: the
        # machine's speed moves within minutes, and their mean is what the sweep is
        # compared with.
        ratios: list[float] = []
        rates: list[float] = []
        for number in range(repeat):
            if number:
                _restore(folder, pristine)
            before = _in_child("raw", folder, chunk_events)
            swept = _in_child("sweep", folder, chunk_events)
            after = _in_child("raw", folder, chunk_events)
            sweep_rate = swept["events"] / swept["seconds"]
            raw_seconds = (before["seconds"] + after["seconds"]) / 2
            raw_rate = before["events"] / raw_seconds
            rates.append(sweep_rate)
            ratios.append(sweep_rate / raw_rate)
            label = f" [{number + 1}/{repeat}]" if repeat > 1 else ""
            print(f"  sweep{label}: {swept['events']:,.0f} events rated in {swept['seconds']:.2f} s"
                  f" = {sweep_rate:,.0f} events/s ({swept['lines']:,.0f} rating rows,"
                  f" {swept['runs']:.0f} runs); CPU {swept['cpu']:.2f} s; peak RSS {_gib(swept['maxrss_kib'])}",
                  flush=True)
            print(f"  raw scan: {before['events']:,.0f} events, {len(PATHS)} payload paths in"
                  f" {before['seconds']:.2f} s before the sweep and {after['seconds']:.2f} s after"
                  f" (mean {raw_seconds:.2f} s = {raw_rate:,.0f} events/s); CPU"
                  f" {before['cpu']:.2f} s and {after['cpu']:.2f} s; peak RSS {_gib(before['maxrss_kib'])}")
            print(f"  sweep rate = {100 * sweep_rate / raw_rate:.0f} % of the raw scan;"
                  f" sweep CPU = {2 * swept['cpu'] / (before['cpu'] + after['cpu']):.2f}x the raw scan's",
                  flush=True)
        if repeat > 1:
            print(f"  median of {repeat}: {statistics.median(rates):,.0f} events/s,"
                  f" {100 * statistics.median(ratios):.0f} % of the raw scan"
                  f" (each: {', '.join(f'{100 * r:.0f} %' for r in ratios)})", flush=True)
    finally:
        if keep is None:
            shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(pristine, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=5_000_000)
    parser.add_argument("--sizes", help="comma-separated event counts, e.g. 1000000,5000000")
    parser.add_argument("--chunk-events", type=int, default=CHUNK_EVENTS)
    parser.add_argument("--repeat", type=int, default=3, help="sweeps per size (median shown)")
    parser.add_argument("--keep", type=Path, help="make the data folders here and keep them")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="spread",
                        help="spread: 1,000 accounts over 30 days, in microseconds; seconds: 10"
                             " accounts over an hour, in whole seconds (ties by the thousand)")
    parser.add_argument("--step", choices=("generate", "sweep", "raw"), help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        if args.step == "generate":
            result = {"seconds": generate(args.data_dir, args.events, args.shape)}
        elif args.step == "sweep":
            result = run_sweep(args.data_dir, args.chunk_events)
        else:
            result = run_raw_scan(args.data_dir)
        result["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(result))
        return 0
    print(f"nproc: {os.cpu_count()} (sched_getaffinity: {len(os.sched_getaffinity(0))})")
    sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else [args.events]
    for size in sizes:
        bench(size, args.chunk_events, args.keep, max(args.repeat, 1), args.shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
