"""Usage charts: one PNG per account and UTC month, drawn from plain usage rows.

A chart has two panels: on top, the month's amount per day, a bar per day stacked by meter
(the eight meters of the largest amounts, the rest as one "other meters" part); below, the
features of the largest amounts (at most ten), each bar labelled with its exact amount.
Amounts stay integer xusd (1 USD = 1,000,000 xusd) in every row; they become floats only
as bar heights, and the axes read in USD.

    month_usages(day_rows)          MonthUsage per (realm, account, month) of report day rows
    render_month_chart(usage, path) the PNG, written whole (a reader never sees half a file)
    publish_charts(root, usages, months)  `<root>/<realm>/<account>/<YYYY-MM>.png` for every
                                    usage; of `months` (None: every month) nothing else
    format_usd(xusd)                an amount in USD, exact: 1234500 -> "1.2345"

`publish-usage-reports` (flows/reports.py) publishes the charts of the months it
publishes; `tollgate report` (cli/report.py) draws one. The same usage always gives the same
bytes (no time or random state in the file), so a chart changes exactly when its usage does.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pyarrow as pa

__all__ = ["Charted", "MonthUsage", "Published", "chart_path", "format_usd", "month_usages",
           "publish_charts", "render_month_chart", "usd_decimals"]

XUSD_PER_USD = 1_000_000
TOP_FEATURES = 10
TOP_METERS = 8
# Part of every chart's digest: change it when the drawing changes, so that publish_charts
# draws every chart again.
CHART_STYLE = "usage-chart/1"
_DIGESTS = ".digests.json"


@dataclass(frozen=True, slots=True)
class MonthUsage:
    """One account's usage in one UTC month, in integer xusd."""

    realm: str
    account: str
    month: date  # the first day of the month
    days: tuple[tuple[date, str, int], ...]  # (day, meter_code, amount_xusd), by day then meter
    features: tuple[tuple[str, int], ...]  # (feature_code, amount_xusd), largest first

    @property
    def total_xusd(self) -> int:
        return sum(amount for _, amount in self.features)

    def digest(self) -> str:
        """What the chart is drawn from, hashed: equal digests draw equal charts."""
        import matplotlib

        text = json.dumps([CHART_STYLE, matplotlib.__version__, self.realm, self.account,
                           self.month.isoformat(),
                           [[d.isoformat(), m, a] for d, m, a in self.days],
                           [list(f) for f in self.features]])
        return hashlib.sha256(text.encode()).hexdigest()


def format_usd(xusd: int, decimals: int | None = None) -> str:
    """An amount of xusd in USD, exactly (integer arithmetic), with thousands separators and
    `decimals` places (default: as many as it needs, at least two).

    >>> format_usd(1_234_500), format_usd(450), format_usd(0), format_usd(-2_000_000_000)
    ('1.2345', '0.00045', '0.00', '-2,000.00')
    >>> format_usd(450, 6)
    '0.000450'
    """
    places = usd_decimals([xusd]) if decimals is None else decimals
    if not 0 <= places <= 6 or places < usd_decimals([xusd]):
        raise ValueError(f"{xusd} xusd cannot be shown with {places} decimals")
    whole, micros = divmod(abs(xusd), XUSD_PER_USD)
    sign = "-" if xusd < 0 else ""
    fraction = f"{micros:06d}"[:places]
    return f"{sign}{whole:,}" + (f".{fraction}" if places else "")


def usd_decimals(amounts: Iterable[int]) -> int:
    """The decimals that show each of these xusd amounts exactly, at least two.

    >>> usd_decimals([1_500_000, 450]), usd_decimals([]), usd_decimals([10])
    (5, 2, 5)
    """
    places = 2
    for amount in amounts:
        micros = f"{abs(amount) % XUSD_PER_USD:06d}".rstrip("0")
        places = max(places, len(micros))
    return places


def month_usages(day_rows: pa.Table) -> list[MonthUsage]:
    """The MonthUsage of every (realm, account, month) in `day_rows` (rows of a usage report
    with period = 'day': period_start, realm, billing_account_id, feature_code, meter_code,
    amount_xusd), ordered by realm, account and month."""
    per_day: dict[tuple[str, str, date], dict[tuple[date, str], int]] = defaultdict(dict)
    per_feature: dict[tuple[str, str, date], dict[str, int]] = defaultdict(dict)
    columns = ["period_start", "realm", "billing_account_id", "feature_code", "meter_code",
               "amount_xusd"]
    for row in day_rows.select(columns).to_pylist():
        day: date = row["period_start"]
        key = (row["realm"], row["billing_account_id"], day.replace(day=1))
        amount = int(row["amount_xusd"])
        days = per_day[key]
        days[(day, row["meter_code"])] = days.get((day, row["meter_code"]), 0) + amount
        features = per_feature[key]
        features[row["feature_code"]] = features.get(row["feature_code"], 0) + amount
    return [MonthUsage(realm, account, month,
                       days=tuple((d, m, a) for (d, m), a in sorted(per_day[key].items())),
                       features=tuple(sorted(per_feature[key].items(), key=lambda f: (-f[1], f[0]))))
            for key in sorted(per_day) for realm, account, month in [key]]


def chart_path(root: Path, realm: str, account: str, month: date) -> Path:
    """`<root>/<realm>/<account>/<YYYY-MM>.png`; a character other than a letter, a digit or
    one of `_.-~` in an id is %-escaped (an account id may hold `/`), and so is a leading dot,
    so each id is one folder of its own, never `..` or a hidden one.

    >>> chart_path(Path("charts"), "acme", "team/a:1", date(2026, 11, 1)).as_posix()
    'charts/acme/team%2Fa%3A1/2026-11.png'
    >>> chart_path(Path("charts"), "acme", "..", date(2026, 11, 1)).as_posix()
    'charts/acme/%2E./2026-11.png'
    """
    return root / _folder(realm) / _folder(account) / f"{month:%Y-%m}.png"


def _folder(name: str) -> str:
    escaped = quote(name, safe="")
    return "%2E" + escaped[1:] if escaped.startswith(".") else escaped or "%"


@dataclass(frozen=True, slots=True)
class Published:
    """What publish_charts did: every chart under the root with its file (those of the
    months it was not given too), how many it drew, kept as they were (same usage) and
    removed (no longer in the report)."""

    charts: list[tuple[Charted, Path]]
    drawn: int
    kept: int
    removed: int


@dataclass(frozen=True, slots=True)
class Charted:
    """What a chart's listing says of it: whose month, and its total."""

    realm: str
    account: str
    month: date
    total_xusd: int


def publish_charts(root: Path, usages: Sequence[MonthUsage],
                   months: Iterable[date] | None = None) -> Published:
    """The chart of every usage under `root` (see chart_path). `months` (first days) are the
    months the usages stand for: a chart of one of them whose usage is not among `usages` is
    removed, and the charts of other months stay as they are; None stands for every month,
    so `root` then holds these charts and no other. A chart whose usage has not changed
    since it was drawn (its digest, kept in `<root>/.digests.json` with its listing) is not
    drawn again."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        known: dict[str, Any] = json.loads((root / _DIGESTS).read_text())
    except (OSError, ValueError):
        known = {}
    scope = None if months is None else set(months)
    records: dict[str, dict[str, Any]] = {}
    if scope is not None:
        # The charts of the months not published this time stay, with their listings.
        for name, record in known.items():
            if (isinstance(record, dict) and date.fromisoformat(record["month"]) not in scope
                    and (root / name).exists()):
                records[name] = record
    drawn = 0
    for usage in usages:
        path = chart_path(root, usage.realm, usage.account, usage.month)
        name = path.relative_to(root).as_posix()
        digest = usage.digest()
        before = known.get(name)
        if not isinstance(before, dict) or before.get("digest") != digest or not path.exists():
            render_month_chart(usage, path)
            drawn += 1
        records[name] = {"digest": digest, "realm": usage.realm, "account": usage.account,
                         "month": usage.month.isoformat(), "total_xusd": str(usage.total_xusd)}
    removed = 0
    for found in sorted(root.rglob("*.png")):
        if found.name.startswith("."):
            # A chart being written (by another publication at the same time), or one a
            # publication that stopped left half-written: gone once it is an hour old.
            try:
                if time.time() - found.stat().st_mtime > 3600:
                    found.unlink(missing_ok=True)
            except OSError:
                pass  # renamed into place meanwhile
        elif found.relative_to(root).as_posix() not in records and (
                scope is None or _month_of(found) in scope):
            found.unlink(missing_ok=True)
            removed += 1
    for folder in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(folder.iterdir()):
            folder.rmdir()
    _replace(root / _DIGESTS, json.dumps(records, indent=1, sort_keys=True).encode())
    charts = [(Charted(r["realm"], r["account"], date.fromisoformat(r["month"]), int(r["total_xusd"])),
               root / name) for name, r in sorted(records.items())]
    return Published(charts, drawn, len(usages) - drawn, removed)


def _month_of(path: Path) -> date | None:
    """The month a chart's file name (`<YYYY-MM>.png`) says; None if it says none."""
    try:
        return date.fromisoformat(path.stem + "-01")
    except ValueError:
        return None


def render_month_chart(usage: MonthUsage, path: Path) -> Path:
    """Draw the chart of `usage` (Agg, off-screen) into the PNG file `path`; returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    daily, ranked = figure.subplots(2, 1, height_ratios=[3, 2])
    month_name = f"{calendar.month_name[usage.month.month]} {usage.month.year}"
    figure.suptitle(f"{usage.account} (realm {usage.realm}): usage in {month_name}, UTC;"
                    f" total {format_usd(usage.total_xusd)} USD", fontsize=13)
    _draw_days(daily, usage, month_name)
    _draw_features(ranked, usage)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.stem}.{os.getpid()}.png")
    # No Software key: the file then depends on the usage alone, not on the library's version.
    figure.savefig(staging, format="png", metadata={"Software": None})
    os.replace(staging, path)
    return path


def _draw_days(axes: Any, usage: MonthUsage, month_name: str) -> None:
    """Stacked bars: the amount of each day of the month by meter."""
    import numpy as np

    length = calendar.monthrange(usage.month.year, usage.month.month)[1]
    per_meter: dict[str, list[int]] = defaultdict(lambda: [0] * length)
    for day, meter, amount in usage.days:
        per_meter[meter][day.day - 1] += amount
    order = sorted(per_meter, key=lambda m: (-sum(per_meter[m]), m))
    shown = {meter: per_meter[meter] for meter in order[:TOP_METERS]}
    rest = order[TOP_METERS:]
    if rest:
        shown[f"{len(rest)} other meters"] = [sum(per_meter[m][i] for m in rest)
                                              for i in range(length)]
    days = np.arange(1, length + 1)
    base = np.zeros(length)
    colours = _colours(order[:TOP_METERS]) + (["#9e9e9e"] if rest else [])
    for (meter, amounts), colour in zip(shown.items(), colours, strict=True):
        heights = np.array(amounts, dtype=float) / XUSD_PER_USD  # for drawing only
        axes.bar(days, heights, bottom=base, width=0.8, label=meter, color=colour)
        base += heights
    axes.set_xlim(0.4, length + 0.6)
    axes.set_xticks(days, [str(d) for d in days], fontsize=8)
    axes.set_xlabel(f"day of {month_name} (UTC)")
    axes.set_ylabel("amount (USD)")
    axes.set_title("Daily amount by meter", loc="left", fontsize=11)
    _usd_axis(axes.yaxis, float(base.max()) if length else 0.0)
    axes.grid(axis="y", color="#dddddd", linewidth=0.8)
    axes.set_axisbelow(True)
    axes.spines[["top", "right"]].set_visible(False)
    if shown:
        # Listed top down as the parts stack, bottom up.
        handles, labels = axes.get_legend_handles_labels()
        axes.legend(handles[::-1], labels[::-1], title="meter", loc="upper left",
                    bbox_to_anchor=(1.01, 1.0), fontsize=8, title_fontsize=9, frameon=False)


def _draw_features(axes: Any, usage: MonthUsage) -> None:
    """Horizontal bars: the features of the largest amounts, largest on top."""
    top = usage.features[:TOP_FEATURES]
    count = len(usage.features)
    title = (f"Top {len(top)} of {count} features" if count > len(top)
             else f"Features ({count})")
    axes.set_title(f"{title} by amount", loc="left", fontsize=11)
    # Bars from the top down, each as thick as in a chart of five features or more.
    slots = max(len(top), 5)
    positions = [slots - 1 - i for i in range(len(top))]
    amounts = [amount for _, amount in top]
    widths = [amount / XUSD_PER_USD for amount in amounts]  # for drawing only
    axes.barh(positions, widths, height=0.6, color="#4c72b0")
    axes.set_yticks(positions, [_cut(code, 32) for code, _ in top], fontsize=9)
    axes.set_ylim(-0.5, slots - 0.5)
    _usd_axis(axes.xaxis, max(widths, default=0.0))
    axes.set_xlim(0, axes.get_xlim()[1] * 1.25)  # room for the labels at the bars' ends
    for position, amount, width in zip(positions, amounts, widths, strict=True):
        axes.annotate(f"{format_usd(amount)} USD", (width, position),
                      xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    axes.set_xlabel("amount in the month (USD)")
    axes.grid(axis="x", color="#dddddd", linewidth=0.8)
    axes.set_axisbelow(True)
    axes.spines[["top", "right"]].set_visible(False)
    if not top:
        axes.set_yticks([])
        axes.text(0.5, 0.5, "no usage", transform=axes.transAxes, ha="center", va="center")


def _usd_axis(axis: Any, largest: float) -> None:
    """USD ticks in plain decimals (no exponent, no offset): ticks 1, 2 or 5 times a power of
    ten apart, each shown with the decimals of that step, so every tick reads exactly; an axis
    of amounts under 10 xusd still spans 10 xusd (ticks never closer than 1 xusd)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    axis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 5, 10]))
    axes = axis.axes
    span = max(largest, 10 / XUSD_PER_USD)
    if axis is axes.yaxis:
        axes.set_ylim(0, span * 1.08)
    else:
        axes.set_xlim(0, span * 1.08)

    def label(value: float, _: Any) -> str:
        ticks = axis.get_majorticklocs()
        step = min((b - a for a, b in zip(ticks, ticks[1:], strict=False) if b > a), default=1.0)
        places = min(6, max(0, -math.floor(math.log10(step) + 1e-9)))
        return f"{value:,.{places}f}"

    axis.set_major_formatter(FuncFormatter(label))


def _colours(meters: Sequence[str]) -> list[Any]:
    """A colour per meter, the same for a meter in every chart where it can be: each meter
    (in order) takes the colour its name hashes to, or the next one no meter has taken.
    Grey, the colour of the other meters, is left out."""
    from matplotlib import colormaps

    tab10 = colormaps["tab10"]
    palette = [tab10(i) for i in range(10) if i != 7]
    taken: list[int] = []
    for meter in meters:
        index = int(hashlib.sha256(meter.encode()).hexdigest()[:8], 16) % len(palette)
        while index in taken and len(taken) < len(palette):
            index = (index + 1) % len(palette)
        taken.append(index)
    return [palette[i] for i in taken]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _replace(path: Path, data: bytes) -> None:
    staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    staging.write_bytes(data)
    os.replace(staging, path)


