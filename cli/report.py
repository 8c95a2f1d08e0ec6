"""`tollgate report`: one account's usage in one UTC month, as tables in the terminal and as
a chart.

    tollgate report --account A [--month YYYY-MM] [--realm R] [--out FILE] [--data-dir D]

The usage is what a report published now would hold (batch/usage_reports.py): the current
ratings (batch ratings, inline ratings not yet superseded, gate commit lines), `rated` lines
only, by the UTC day of their occurred_at. It prints the amount per day and meter, then per
feature, in USD worked out exactly from the integer xusd (1 USD = 1,000,000 xusd), with
totals, and writes the chart of batch/usage_charts.py (default
`usage-<realm>-<account>-<YYYY-MM>.png` in the current folder), printing its path. The lake
is opened read-only, as `tollgate sql` opens it, so the command runs beside `tollgate serve`.
The month defaults to the current UTC month. An account the lake does not know, or a realm
the account is not in, exits 2; a month in which the account has no usage exits 1.
"""

from __future__ import annotations

import calendar
import re
import sys
from collections.abc import Sequence
from datetime import date
from pathlib import Path
from typing import IO, Annotated, Any
from urllib.parse import quote

from cyclopts import Parameter

from cli.shared import CommandError, DataDir
from core.clock import SYSTEM_CLOCK
from core.settings import Settings

__all__ = ["report"]

_MONTH = re.compile(r"(\d{4})-(0[1-9]|1[0-2])")


def _a_month(hint: Any, month: str | None) -> None:
    if month is not None and not _MONTH.fullmatch(month):
        raise ValueError(f"{month!r} is not a month: expected YYYY-MM, e.g. 2026-11")


Month = Annotated[str | None, Parameter(name="--month", metavar="YYYY-MM", validator=_a_month)]


def report(*, account: Annotated[str, Parameter(name="--account", metavar="ACCOUNT")],
           month: Month = None,
           realm: Annotated[str | None, Parameter(name="--realm", metavar="REALM")] = None,
           out: Annotated[Path | None, Parameter(name="--out", metavar="FILE")] = None,
           data_dir: DataDir = None) -> int:
    """Print an account's usage in a month, and write its chart (PNG).

    The usage is that of the current ratings, as a report published now would
    hold it: the amount per day and meter, then per feature, in exact USD, with
    totals. The chart shows the daily amount by meter and the top features.
    The lake is opened read-only, so this runs beside tollgate serve. Exit code
    2 for an account the lake does not know, 1 for a month without usage.

    Parameters
    ----------
    account
        the billing account
    month
        the UTC month; default the current one
    realm
        the account's realm; needed only when it is in several
    out
        the chart's file (default usage-REALM-ACCOUNT-YYYY-MM.png)
    """
    folder = Settings.from_env(data_dir).data_dir
    first = _month_start(month) if month is not None else SYSTEM_CLOCK.now().date().replace(day=1)
    import duckdb

    from batch.usage_charts import month_usages, render_month_chart
    from batch.usage_reports import account_month_usage, account_months, account_realms
    from warehouse.lake import connect_lake, with_lake_retry

    try:
        conn = connect_lake(folder, read_only=True)
    except FileNotFoundError as exc:
        raise CommandError(f"{exc} (is --data-dir right?)", 2) from None
    try:
        realms = with_lake_retry(lambda: account_realms(conn, account))
        chosen = _realm(account, realm, realms)
        rows = with_lake_retry(lambda: account_month_usage(conn, chosen, account, first))
        if rows.num_rows == 0:
            months = with_lake_retry(lambda: account_months(conn, chosen, account))
            having = (f"months with usage: {', '.join(f'{m:%Y-%m}' for m in months)}" if months
                      else "it has no usage in any month")
            raise CommandError(f"{account} (realm {chosen}) has no usage in {first:%Y-%m};"
                               f" {having}", 1)
    except duckdb.Error as exc:
        raise CommandError(f"cannot read the lake: {exc}", 1) from None
    finally:
        conn.close()
    [usage] = month_usages(rows)
    _print_usage(rows.to_pylist(), account, chosen, first, sys.stdout)
    target = out if out is not None else Path(
        f"usage-{quote(chosen, safe='')}-{quote(account, safe='')}-{first:%Y-%m}.png")
    render_month_chart(usage, target)
    print(f"\nchart: {target}")
    return 0


def _month_start(text: str) -> date:
    year, month = text.split("-")
    return date(int(year), int(month), 1)


def _realm(account: str, realm: str | None, realms: list[str]) -> str:
    """The realm to report on: the one given, or the account's only one."""
    if not realms:
        raise CommandError(f"no account {account!r} in the lake (no event or rating names it)", 2)
    if realm is not None:
        if realm not in realms:
            raise CommandError(f"account {account!r} is not in realm {realm!r}; its realms:"
                               f" {', '.join(realms)}", 2)
        return realm
    if len(realms) > 1:
        raise CommandError(f"account {account!r} is in realms {', '.join(realms)}: choose one"
                           " with --realm", 2)
    return realms[0]


def _print_usage(rows: list[dict[str, Any]], account: str, realm: str, month: date,
                 out: IO[str]) -> None:
    """The month's day rows as two tables: per day and meter, then per feature; amounts in
    USD with the decimals the column needs, exact."""
    from batch.usage_charts import format_usd, usd_decimals

    total = sum(int(r["amount_xusd"]) for r in rows)
    out.write(f"Usage of {account} (realm {realm}) in {calendar.month_name[month.month]}"
              f" {month.year}, UTC: {format_usd(total)} USD\n\n")

    per_day: dict[tuple[date, str], list[int]] = {}
    for r in rows:
        sums = per_day.setdefault((r["period_start"], r["meter_code"]), [0, 0, 0])
        sums[0] += int(r["quantity_minor"])
        sums[1] += int(r["amount_xusd"])
        sums[2] += int(r["line_count"])
    places = usd_decimals([total, *(s[1] for s in per_day.values())])
    table = [[f"{day:%Y-%m-%d}", meter, f"{q:,}", str(lines), format_usd(a, places)]
             for (day, meter), (q, a, lines) in sorted(per_day.items())]
    table.append(["total", "", "", str(sum(s[2] for s in per_day.values())),
                  format_usd(total, places)])
    _write_table(["day", "meter", "quantity", "lines", "amount (USD)"], table,
                 right={2, 3, 4}, out=out)

    per_feature: dict[str, list[int]] = {}
    for r in rows:
        sums = per_feature.setdefault(r["feature_code"], [0, 0])
        sums[0] += int(r["amount_xusd"])
        sums[1] += int(r["line_count"])
    ranked = sorted(per_feature.items(), key=lambda f: (-f[1][0], f[0]))
    places = usd_decimals([total, *(s[0] for s in per_feature.values())])
    table = [[feature, str(lines), format_usd(a, places), _share(a, total)]
             for feature, (a, lines) in ranked]
    table.append(["total", str(sum(s[1] for s in per_feature.values())),
                  format_usd(total, places), _share(total, total)])
    out.write("\n")
    _write_table(["feature", "lines", "amount (USD)", "share"], table, right={1, 2, 3}, out=out)


def _share(amount: int, total: int) -> str:
    """A percentage of the total, to one decimal (integer arithmetic)."""
    if total <= 0:
        return ""
    tenths = (amount * 1000 + total // 2) // total
    return f"{tenths // 10}.{tenths % 10}%"


def _write_table(columns: Sequence[str], rows: list[list[str]], *, right: set[int],
                 out: IO[str]) -> None:
    """Aligned columns (`right` aligned to the right), the last row set off as the totals."""
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w)
                         for i, (v, w) in enumerate(zip(values, widths, strict=True))).rstrip()

    out.write(line(columns) + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for row in rows[:-1]:
        out.write(line(row) + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    out.write(line(rows[-1]) + "\n")
