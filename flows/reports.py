"""The `publish-usage-reports` flow: usage per day and month, per account, feature and meter,
from the current ratings, of the UTC days that changed since the last publication and of
their months (`batch.usage_reports.changed_days`; every day and month the first time),
written three ways:
appended to `lake.usage_reports` (the report as it stands is the view
`lake.usage_reports_latest`), as Parquet files under `<data_dir>/reports/`, and as two Prefect
table artifacts, `usage-report-days` and `usage-report` (months), each showing the newest
rows of the report as it stands up to its cap.

Then the usage charts of the months it published (batch/usage_charts.py): a PNG per account
and month under `<data_dir>/reports/charts/` (a chart whose usage has not changed is not
drawn again), listed with their paths in the markdown artifact `usage-charts`.

What a publication reads and writes follows what changed since the one before, not the
lake's history: an hour of traffic costs the ratings of the days it touched (usually today)
and the published day rows of their months, and an hour with no new ratings costs the
change feed's look alone."""

from __future__ import annotations

import json
import os
from datetime import date
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from batch.rating_plan import sql_text
from batch.usage_charts import Published, format_usd, month_usages, publish_charts
from batch.usage_reports import REPORT_COLUMNS, REPORT_ORDER, in_months_sql, publish_report
from core.clock import SYSTEM_CLOCK
from core.layout import DataFolder
from flows.workspace import close_lake, open_lake, resolve_data_dir

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
    """Publish the usage of the days that changed since the last publication, and of their
    months; returns its run id, its row counts and the days it covered (None: every day)."""
    folder = resolve_data_dir(data_dir)
    reports = DataFolder(folder).reports
    published_at = SYSTEM_CLOCK.now()
    run_id = f"report-{published_at.strftime('%Y%m%dT%H%M%S%fZ')}"
    conn = open_lake(folder)
    try:
        report, days = publish_report(conn, run_id, published_at)
        periods = pc.value_counts(report.column("period")).to_pylist() if report.num_rows else []
        rows = {item["values"]: item["counts"] for item in periods}
        files = _write_parquet(conn, reports, run_id, report)
        totals = {period: _publish_artifact(conn, period, run_id) for period in ("day", "month")}
        # The charts of the months published, and of those published since the last
        # publication whose charts were drawn (one that failed after its lake commit).
        charts_root = DataFolder(folder).report_charts
        months = None if days is None else _months_to_chart(conn, charts_root, days)
        month_days = report.filter(pc.equal(report.column("period"), "day")) if days is None \
            else _month_days(conn, months)
    finally:
        close_lake(conn)
    charts = publish_charts(charts_root, month_usages(month_days), months=months)
    _write_marker(charts_root / _CHARTED, run_id)
    _publish_charts_artifact(charts, run_id)
    counts = {period: rows.get(period, 0) for period in ("day", "month")}
    covered = "every day" if days is None else ", ".join(f"{d:%Y-%m-%d}" for d in days) or "no day"
    get_run_logger().info("published %s (%s): %d day rows, %d month rows; the report holds %d"
                          " and %d; %d charts (%d drawn, %d removed)", run_id, covered,
                          counts["day"], counts["month"], totals["day"], totals["month"],
                          len(charts.charts), charts.drawn, charts.removed)
    return {"run_id": run_id, "rows": counts, "report_rows": totals,
            "days": None if days is None else [d.isoformat() for d in days],
            "files": [str(f) for f in files],
            "charts": {"folder": str(DataFolder(folder).report_charts),
                       "charts": len(charts.charts), "drawn": charts.drawn,
                       "removed": charts.removed}}


def _month_days(conn: duckdb.DuckDBPyConnection, months: list[date] | None) -> pa.Table:
    """The day rows of `months` (None: every month) as the report now stands, for their
    charts."""
    if months is not None and not months:
        return conn.execute(f"SELECT {REPORT_COLUMNS} FROM lake.usage_reports WHERE false").to_arrow_table()
    listed = "TRUE" if months is None else in_months_sql("period_start", months)
    return conn.execute(
        f"SELECT {REPORT_COLUMNS} FROM lake.usage_reports_latest WHERE period = 'day'"
        f" AND {listed} ORDER BY {REPORT_ORDER}").to_arrow_table()


# In the charts' folder: the last publication whose charts were drawn.
_CHARTED = ".charted.json"


def _months_to_chart(conn: duckdb.DuckDBPyConnection, root: Path, days: list[date]) -> list[date] | None:
    """The months whose charts to draw: those of `days`, and of every publication after the
    last one whose charts were drawn; None (every month) when that one is not known or a
    whole publication came since."""
    try:
        marker = json.loads((root / _CHARTED).read_text())["run_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    found = conn.execute("SELECT published_at FROM lake.usage_report_runs WHERE run_id = ?",
                         [str(marker)]).fetchone()
    if found is None:
        return None
    since = conn.execute(
        "SELECT s.day, s.whole FROM lake.usage_report_scopes AS s JOIN lake.usage_report_runs AS p"
        " ON p.run_id = s.run_id WHERE p.published_at > ?", [found[0]]).fetchall()
    if any(whole for _, whole in since):
        return None
    return sorted({d.replace(day=1) for d in days} | {d.replace(day=1) for d, _ in since if d is not None})


def _write_marker(path: Path, run_id: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(json.dumps({"run_id": run_id}))
    os.replace(staging, path)


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


def _publish_artifact(conn: duckdb.DuckDBPyConnection, period: str, run_id: str) -> int:
    """The table artifact of one period: the newest rows of the report as it stands, at most
    the period's cap; returns how many rows the period has in all."""
    key, title, cap = _ARTIFACTS[period]
    total = conn.execute("SELECT count(*) FROM lake.usage_reports_latest WHERE period = ?",
                         [period]).fetchall()[0][0]
    shown = conn.execute(
        f"SELECT {', '.join(_ARTIFACT_COLUMNS)} FROM lake.usage_reports_latest WHERE period = ?"
        " ORDER BY period_start DESC, realm, billing_account_id, feature_code, meter_code"
        f" LIMIT {int(cap)}", [period]).to_arrow_table()
    create_table_artifact(
        table=[{k: (str(v) if v is not None else None) for k, v in row.items()}
               for row in shown.to_pylist()],
        key=key, description=(f"{title}, report {run_id} (amounts in xusd): {shown.num_rows} of"
                              f" {total} rows, newest first (at most {cap} shown); every row"
                              f" is in lake.usage_reports_latest and reports/usage_{period}.parquet"))
    return int(total)


def _write_parquet(conn: duckdb.DuckDBPyConnection, folder: Path, run_id: str,
                   report: pa.Table) -> list[Path]:
    """`reports/<run_id>/usage_<period>.parquet` (the publication's own rows), and
    `reports/usage_<period>.parquet` replaced atomically by the report as it stands (written
    by DuckDB from `lake.usage_reports_latest`, never held in this process)."""
    kept = folder / run_id
    kept.mkdir(parents=True, exist_ok=True)
    written = []
    for period in ("day", "month"):
        rows = report.filter(pc.equal(report.column("period"), period))
        target = kept / f"usage_{period}.parquet"
        pq.write_table(rows, target)
        latest = folder / f"usage_{period}.parquet"
        staging = folder / f".usage_{period}.{os.getpid()}.parquet"
        # The flows' connections do not keep insertion order (`flows.workspace`): without it
        # a parallel COPY may write the sorted rows out of order.
        conn.execute("SET preserve_insertion_order = true")
        try:
            conn.execute(f"COPY (SELECT {REPORT_COLUMNS} FROM lake.usage_reports_latest"
                         f" WHERE period = '{period}' ORDER BY {REPORT_ORDER})"
                         f" TO {sql_text(str(staging))} (FORMAT parquet)")
        finally:
            conn.execute("SET preserve_insertion_order = false")
        os.replace(staging, latest)
        written += [target, latest]
    return written
