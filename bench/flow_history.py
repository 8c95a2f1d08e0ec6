"""What a scheduled flow's bookkeeping costs as the lake's history grows.

Every minute `rate-events` asks the lake what is new (`batch.sweep._state`), every 15
minutes `close-aggregate-days` finds the aggregate days to rate (`batch.aggregate_days.
_candidate_days`), and every hour `publish-usage-reports` publishes the days that changed
(`batch.usage_reports.publish_report`). None may cost more with a longer history: this
bench makes a data folder, grows its lake in steps with `bench.preload` (events written
straight into the stores as the service exports them, one export per 500,000; each step's
on a day of its own before today), and after each step times, on the same lake:

- `state`: the sweep's question, as the sweep asks it (median of 5);
- `close`: a close of aggregate days 10 minutes after the last, with nothing new since
  (median of 5);
- the raw limit: one full read of the export_id column (`max(export_id)` and a count over
  lake.events), what the sweep's question cost when it read the history;
- `publish`: a publication after an hour's traffic (3,600 events that occurred in the last
  hour, swept), and one with nothing new (median of 3), against the report of every day
  and month that each publication built before it followed the change feed (median of 3).

    python bench/flow_history.py [--steps 2000000,8000000,20000000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch.aggregate_days import close_aggregate_days  # noqa: E402
from batch.rating_plan import RatingPlan  # noqa: E402
from batch.sweep import _state, sweep  # noqa: E402
from batch.usage_reports import build_usage_report, publish_report  # noqa: E402
from bench.loopback import ROOT, free_port  # noqa: E402
from bench.preload import preload  # noqa: E402
from core.clock import ManualClock  # noqa: E402
from flows.workspace import applied_catalog, rating_lock  # noqa: E402
from warehouse.lake import connect_lake  # noqa: E402


def _median_ms(step: Callable[[], object], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        step()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def _initialise(data_dir: Path) -> None:
    """`tollgate serve` once, so the folder has its demo catalog, key, file and lake."""
    env = dict(os.environ, TOLLGATE_SCHEDULES="off")
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(free_port()), "--data-dir",
                             str(data_dir)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (data_dir / "lake" / "catalog.sqlite").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)
    proc.terminate()
    proc.wait(timeout=30)


def measure(data_dir: Path, clock: ManualClock, seed: int) -> dict[str, float]:
    """The figures of the lake as it is (see the module's doc), in ms, and the events
    table's files. The clock moves as the schedules would: a sweep, a close 10 minutes
    later, the measured closes 10 minutes after that, with nothing new since."""
    conn = connect_lake(data_dir)
    try:
        plan = RatingPlan.from_catalog(applied_catalog(data_dir, conn))
        lock = rating_lock(data_dir)

        def close_now() -> object:
            return close_aggregate_days(conn, plan, lock, lateness={"acme": 7200},
                                        now=clock.now(), clock=clock)

        sweep(conn, plan, lock, clock=clock)  # rates the step's events (not measured)
        clock.advance(600)
        close_now()  # leaves the mark the measured closes start from
        clock.advance(600)
        raw = _median_ms(lambda: conn.execute(
            "SELECT max(export_id), count(*) FILTER (export_id > -1) FROM lake.events").fetchall())
        state = _median_ms(lambda: _state(conn))
        close = _median_ms(close_now)
        files = conn.execute("SELECT count(*) FROM ducklake_list_files('lake', 'events')").fetchone()
        publish_report(conn, f"report-{seed}-a", clock.now())  # the step's days (not measured)
    finally:
        conn.close()
    # An hour of traffic that occurred in the last hour, exported and swept.
    preload(data_dir, 3_600, seed=seed + 1, occurred_from=datetime.now(timezone.utc) - timedelta(hours=1))
    conn = connect_lake(data_dir)
    try:
        sweep(conn, plan, lock, clock=clock)
        began = time.perf_counter()
        publish_report(conn, f"report-{seed}-b", clock.now())
        hour = (time.perf_counter() - began) * 1000
        runs = iter(range(100))
        idle = _median_ms(lambda: publish_report(conn, f"report-{seed}-c{next(runs)}", clock.now()), runs=3)
        whole = _median_ms(lambda: build_usage_report(conn, "whole", clock.now()), runs=3)
    finally:
        conn.close()
    return {"state": state, "close": close, "raw": raw, "files": int(files[0]) if files else 0,
            "publish_hour": hour, "publish_idle": idle, "report_whole": whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="2000000,8000000,20000000",
                        help="total events in the lake at each measurement")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    root = Path(tempfile.mkdtemp(prefix="tollgate-history-"))
    data_dir = root / "data"
    try:
        _initialise(data_dir)
        print(f"nproc={os.cpu_count()} python={sys.version.split()[0]}")
        stored = 0
        clock = ManualClock(datetime.now(timezone.utc))
        today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
        for i, total in enumerate(steps):
            began = time.monotonic()
            # Each step on a day of its own, the first the furthest back, none of them today.
            preload(data_dir, total - stored, seed=total,
                    occurred_from=today - timedelta(days=len(steps) + 1 - i))
            stored = total
            m = measure(data_dir, clock, seed=total)
            print(f"events={stored:,} files={m['files']:,}"
                  f" (grown in {time.monotonic() - began:.0f} s) | state {m['state']:.1f} ms,"
                  f" close {m['close']:.1f} ms | raw limit (full export_id read) {m['raw']:.1f} ms"
                  f" | state/raw {m['state'] / m['raw']:.2f}"
                  f" | publish after an hour's 3,600 events {m['publish_hour']:.0f} ms,"
                  f" with nothing new {m['publish_idle']:.0f} ms | the report of every day"
                  f" {m['report_whole']:.0f} ms", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
