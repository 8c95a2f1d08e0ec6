"""The `publish-usage-reports` flow: usage per day and month, per account, feature and meter,
from the current ratings, written three ways: appended to `lake.usage_reports`, as Parquet
files under `<data_dir>/reports/`, and as two Prefect table artifacts, `usage-report-days` and
`usage-report` (months), each showing the newest rows up to its cap.

Then the usage charts of the report (batch/usage_charts.py): a PNG per account and month under
`<data_dir>/reports/charts/` (only those of the latest publication; a chart whose usage has
not changed is not drawn again), listed with their paths in the markdown artifact
`usage-charts`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from batch.usage_charts import Published, format_usd, month_usages, publish_charts
from batch.usage_reports import REPORT_COLUMNS, build_usage_report
from core.clock import SYSTEM_CLOCK
from core.layout import DataFolder
from flows.workspace import close_lake, open_lake, resolve_data_dir
from warehouse.lake import transaction, with_lake_retry

__all__ = ["publish_usage_reports"]

# A table artifact is for reading in the UI; the lake and the Parquet files hold the whole
# report. Per period: its artifact key, its title and the most rows it shows (newest first).
_ARTIFACTS = {"day": ("usage-report-days", "Daily usage", 1000),
              "month": ("usage-report", "Monthly usage", 500)}
# The charts artifact lists the newest months first, at most this many charts.
_CHARTS_ARTIFACT = ("usage-charts", 500)
_ARTIFACT_COLUMNS = ["period_start", "realm", "billing_account_id", "feature_code", "meter_code",
                     "quantity_minor", "amount_xusd", "event_count", "line_count"]


@flow(name="publish-usage-reports")
def publish_usage_reports(data_dir: str | None = None) -> dict[str, Any]:
    """Publish the usage report of the current ratings; returns its run id and row counts."""
    folder = resolve_data_dir(data_dir)
    published_at = SYSTEM_CLOCK.now()
    run_id = f"report-{published_at.strftime('%Y%m%dT%H%M%S%fZ')}"
    conn = open_lake(folder)
    try:
        report = build_usage_report(conn, run_id, published_at)
        conn.register("report_rows", report)
        periods = pc.value_counts(report.column("period")).to_pylist() if report.num_rows else []
        rows = {item["values"]: item["counts"] for item in periods}

        def write() -> None:
            # The rows and the publication's own row land together: an empty publication
            # still says that it happened, so the latest report is always known.
            with transaction(conn):
                conn.execute(f"INSERT INTO lake.usage_reports ({REPORT_COLUMNS})"
                             f" SELECT {REPORT_COLUMNS} FROM report_rows")
                conn.execute("INSERT INTO lake.usage_report_runs VALUES (?, ?, ?, ?)",
                             [run_id, published_at, rows.get("day", 0), rows.get("month", 0)])
        with_lake_retry(write)
        conn.unregister("report_rows")
    finally:
        close_lake(conn)
    files = _write_parquet(DataFolder(folder).reports, run_id, report)
    counts = {period: _publish_artifact(report, period, run_id) for period in ("day", "month")}
    charts = publish_charts(DataFolder(folder).report_charts, month_usages(
        report.filter(pc.equal(report.column("period"), "day"))))
    _publish_charts_artifact(charts, run_id)
    get_run_logger().info("published %s: %d day rows, %d month rows; %d charts (%d drawn, %d"
                          " removed)", run_id, counts["day"], counts["month"],
                          len(charts.charts), charts.drawn, charts.removed)
    return {"run_id": run_id, "rows": counts, "files": [str(f) for f in files],
            "charts": {"folder": str(DataFolder(folder).report_charts),
                       "charts": len(charts.charts), "drawn": charts.drawn,
                       "removed": charts.removed}}


def _publish_charts_artifact(charts: Published, run_id: str) -> None:
    """The markdown artifact that lists the charts, newest months first, each with its total
    and its file (a link to it, and its path)."""
    key, cap = _CHARTS_ARTIFACT
    shown = sorted(charts.charts, key=lambda c: (-c[0].month.toordinal(), c[0].realm,
                                                  c[0].account))[:cap]
    lines = [f"# Usage charts, report {run_id}", "",
             f"{len(shown)} of {len(charts.charts)} charts, newest months first (at most {cap}"
             " listed); each is a PNG of the month's daily amount by meter and its top features.",
             "", "| month | realm | account | total (USD) | chart |", "|---|---|---|---:|---|"]
    for usage, path in shown:
        lines.append(f"| {usage.month:%Y-%m} | {usage.realm} | {usage.account}"
                     f" | {format_usd(usage.total_xusd)} | [{path.name}]({path.resolve().as_uri()})"
                     f" `{path}` |")
    create_markdown_artifact(markdown="\n".join(lines) + "\n", key=key,
                             description=f"Usage charts, report {run_id}")


def _publish_artifact(report: pa.Table, period: str, run_id: str) -> int:
    """The table artifact of one period: its newest rows, at most the period's cap; returns
    how many rows the period has in all."""
    key, title, cap = _ARTIFACTS[period]
    rows = report.filter(pc.equal(report.column("period"), period))
    shown = rows.sort_by([("period_start", "descending"), ("realm", "ascending"),
                          ("billing_account_id", "ascending"), ("feature_code", "ascending"),
                          ("meter_code", "ascending")]).slice(0, cap)
    create_table_artifact(
        table=[{k: (str(v) if v is not None else None) for k, v in row.items()}
               for row in shown.select(_ARTIFACT_COLUMNS).to_pylist()],
        key=key, description=(f"{title}, report {run_id} (amounts in xusd): {shown.num_rows} of"
                              f" {rows.num_rows} rows, newest first (at most {cap} shown); every row"
                              f" is in lake.usage_reports and reports/usage_{period}.parquet"))
    return int(rows.num_rows)


def _write_parquet(folder: Path, run_id: str, report: pa.Table) -> list[Path]:
    """`reports/<run_id>/usage_<period>.parquet`, and `reports/usage_<period>.parquet` replaced
    atomically by the latest."""
    kept = folder / run_id
    kept.mkdir(parents=True, exist_ok=True)
    written = []
    for period in ("day", "month"):
        rows = report.filter(pc.equal(report.column("period"), period))
        target = kept / f"usage_{period}.parquet"
        pq.write_table(rows, target)
        latest = folder / f"usage_{period}.parquet"
        staging = folder / f".usage_{period}.{os.getpid()}.parquet"
        pq.write_table(rows, staging)
        os.replace(staging, latest)
        written += [target, latest]
    return written
