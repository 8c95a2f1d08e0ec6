"""What a scheduled flow's bookkeeping costs as the lake's history grows.

Every minute `rate-events` asks the lake what is new (`batch.sweep._state`), and every 15
minutes `close-aggregate-days` finds the aggregate days to rate (`batch.aggregate_days.
_candidate_days`). Neither may cost more with a longer history: this bench makes a data
folder, grows its lake in steps with `bench.preload` (events written straight into the
stores as the service exports them, one export per 500,000), and after each step times,
on the same lake and connection:

- `state`: the sweep's question, as the sweep asks it (median of 5);
- `close`: a close of aggregate days 10 minutes after the last, with nothing new since
  (median of 5);
- the raw limit: one full read of the export_id column (`max(export_id)` and a count over
  lake.events), what the sweep's question cost when it read the history.

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
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batch.aggregate_days import close_aggregate_days  # noqa: E402
from batch.rating_plan import RatingPlan  # noqa: E402
from batch.sweep import _state, sweep  # noqa: E402
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


def measure(data_dir: Path, clock: ManualClock) -> tuple[float, float, float, int]:
    """(state ms, close ms, raw ms, the events table's files) on the lake as it is. The
    clock moves as the schedules would: a sweep, a close 10 minutes later, the measured
    closes 10 minutes after that, with nothing new since."""
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
        return state, close, raw, int(files[0]) if files else 0
    finally:
        conn.close()


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
        for total in steps:
            began = time.monotonic()
            preload(data_dir, total - stored, seed=total)
            stored = total
            state, close, raw, files = measure(data_dir, clock)
            print(f"events={stored:,} files={files:,}"
                  f" (grown in {time.monotonic() - began:.0f} s) | state {state:.1f} ms,"
                  f" close {close:.1f} ms | raw limit (full export_id read) {raw:.1f} ms"
                  f" | state/raw {state / raw:.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
