"""POST /mgt/v1/reports/usage: usage over a time range from the lake, in the official
client's GateOpsUsageReportQuery shape.

The sums are those of `warehouse.usage_query`: the current ratings and the gate's commits,
as exported to the lake (a few seconds behind the service). Supported: granularity day or
month; group_by any of DIMENSIONS (bucket_start is added when missing); aggregate series,
total or group_total; metrics of METRICS (quantity_minor and amount_xusd by default);
dim_filters eq/in; metric_filters; top_k with order_by_metric and order; compare previous;
limit (1-5000, default 1000) with an opaque cursor. billing_user_id, cost and attribution
dimensions and cost metrics are not recorded by tollgate: asking for them is a 422 that names
them. A call with X-Billing-Account-Id (or X-Principal-Id) sees only that account.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from datetime import datetime, timedelta
from typing import Any

import msgspec
from litestar import Controller, Request, post

from api.envelope import Reply
from api.errors import BadRequest, Forbidden, Unprocessable
from api.requests import account_in_context, read_signed
from api.runtime import Runtime
from pipelines.events import format_instant, parse_instant
from warehouse.lake import with_lake_retry
from warehouse.usage_query import DIMENSIONS, METRICS, LakeReader, UsageSlice

__all__ = ["ReportsController"]

_encode = msgspec.json.encode
DEFAULT_LIMIT = 1000
MAX_LIMIT = 5000
MAX_DAYS = {"day": 400, "month": 3660}


def _fault(errors: list[dict[str, Any]], field: str, code: str, message: str) -> None:
    errors.append({"field": field, "code": code, "message": message})


def _instant(errors: list[dict[str, Any]], body: dict[str, Any], name: str) -> datetime | None:
    value = body.get(name)
    moment = parse_instant(value) if isinstance(value, str) and value.endswith("Z") else None
    if moment is None:
        _fault(errors, f"time.{name}", "VALIDATION.INVALID_TIMESTAMP",
               f"time.{name} must be an RFC 3339 instant in UTC ending with 'Z'")
    return moment


class _Query(msgspec.Struct):
    realm: str
    start: datetime
    end: datetime
    granularity: str
    group_by: list[str]
    metrics: list[str]
    aggregate: str
    filters: list[tuple[str, tuple[str, ...]]]
    metric_filters: list[tuple[str, str, int]]
    top_k: int | None
    order_by: str
    order: str
    compare: bool
    limit: int
    offset: int


def _parse(body: Any, realm: str, account: str | None) -> _Query:
    errors: list[dict[str, Any]] = []
    if not isinstance(body, dict):
        raise BadRequest("VALIDATION.MALFORMED_JSON", "body must be a JSON object")
    time_range = body.get("time")
    if not isinstance(time_range, dict):
        raise Unprocessable("VALIDATION.INVALID_INPUT", "the request is invalid", errors=[
            {"field": "time", "code": "VALIDATION.REQUIRED", "message": "time {from, to, granularity} is required"}])
    start, end = _instant(errors, time_range, "from"), _instant(errors, time_range, "to")
    granularity = time_range.get("granularity")
    if granularity not in ("day", "month"):
        _fault(errors, "time.granularity", "VALIDATION.INVALID_VALUE", "granularity must be day or month")
    elif start and end:
        if start >= end:
            _fault(errors, "time.to", "VALIDATION.INVALID_VALUE", "time.to must be after time.from")
        elif end - start > timedelta(days=MAX_DAYS[granularity]):
            _fault(errors, "time.to", "VALIDATION.INVALID_VALUE",
                   f"a {granularity} report spans at most {MAX_DAYS[granularity]} days")
    group_by = body.get("group_by")
    if not isinstance(group_by, list) or not group_by or not all(isinstance(d, str) for d in group_by):
        _fault(errors, "group_by", "VALIDATION.INVALID_VALUE", "group_by must be a non-empty array of dimension keys")
        group_by = ["bucket_start"]
    unknown = [d for d in group_by if d not in DIMENSIONS]
    if unknown:
        _fault(errors, "group_by", "VALIDATION.UNSUPPORTED_DIMENSION",
               f"not recorded by tollgate: {', '.join(unknown)}; supported: {', '.join(DIMENSIONS)}")
    group_by = list(dict.fromkeys(["bucket_start", *group_by] if "bucket_start" not in group_by else group_by))
    metrics = body.get("metrics") or ["quantity_minor", "amount_xusd"]
    if not isinstance(metrics, list) or not all(isinstance(m, str) for m in metrics):
        _fault(errors, "metrics", "VALIDATION.INVALID_VALUE", "metrics must be an array of metric keys")
        metrics = []
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        _fault(errors, "metrics", "VALIDATION.UNSUPPORTED_METRIC",
               f"not recorded by tollgate: {', '.join(bad)}; supported: {', '.join(METRICS)}")
    metrics = list(dict.fromkeys(metrics))
    aggregate = body.get("aggregate") or "series"
    if aggregate not in ("series", "total", "group_total"):
        _fault(errors, "aggregate", "VALIDATION.INVALID_VALUE", "aggregate must be series, total or group_total")
    elif aggregate == "total" and group_by != ["bucket_start"]:
        _fault(errors, "aggregate", "VALIDATION.INVALID_VALUE", "aggregate total needs group_by [bucket_start] only")
    filters: dict[str, tuple[str, ...]] = {}
    dim_filters = body.get("dim_filters") or []
    if not isinstance(dim_filters, list):
        _fault(errors, "dim_filters", "VALIDATION.INVALID_TYPE", "dim_filters must be an array")
        dim_filters = []
    for i, f in enumerate(dim_filters):
        field, op, value = (f.get("field"), f.get("op"), f.get("value")) if isinstance(f, dict) else (None, None, None)
        values = (value,) if op == "eq" and isinstance(value, str) else (
            tuple(value) if op == "in" and isinstance(value, list) and value and all(isinstance(v, str) for v in value)
            else None)
        if not isinstance(field, str) or field not in DIMENSIONS or field == "bucket_start" or values is None:
            _fault(errors, f"dim_filters[{i}]", "VALIDATION.INVALID_VALUE",
                   "a dim filter is {field, op: eq|in, value}: a supported dimension other than bucket_start,"
                   " a string for eq and a non-empty array of strings for in")
            continue
        filters[field] = tuple(v for v in values if v in filters[field]) if field in filters else values
    if account is not None:
        asked = filters.get("billing_account_id")
        if asked is not None and account not in asked:
            raise Forbidden("AUTH.BILLING_ACCOUNT_MISMATCH", "the filter names another billing account than the context")
        filters["billing_account_id"] = (account,)
    metric_filters: list[tuple[str, str, int]] = []
    metric_filters_in = body.get("metric_filters") or []
    if not isinstance(metric_filters_in, list):
        _fault(errors, "metric_filters", "VALIDATION.INVALID_TYPE", "metric_filters must be an array")
        metric_filters_in = []
    for i, f in enumerate(metric_filters_in):
        field, op, value = (f.get("field"), f.get("op"), f.get("value")) if isinstance(f, dict) else (None, None, None)
        if (field not in metrics or op not in ("gte", "lte", "gt", "lt") or not isinstance(value, str)
                or not value.lstrip("-").isdigit()):
            _fault(errors, f"metric_filters[{i}]", "VALIDATION.INVALID_VALUE",
                   "a metric filter is {field: one of the metrics asked, op: gte|lte|gt|lt, value: an integer string}")
            continue
        metric_filters.append((str(field), str(op), int(value)))
    top_k = body.get("top_k")
    ranked = [d for d in group_by if d in ("feature_code", "feature_family_code")]
    if top_k is not None:
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= 100:
            _fault(errors, "top_k", "VALIDATION.INVALID_VALUE", "top_k must be an integer from 1 to 100")
        elif len(ranked) != 1:
            _fault(errors, "top_k", "VALIDATION.INVALID_VALUE",
                   "top_k needs exactly one of feature_code and feature_family_code in group_by")
    order_by = body.get("order_by_metric") or (metrics[0] if metrics else "amount_xusd")
    if order_by not in metrics:
        _fault(errors, "order_by_metric", "VALIDATION.INVALID_VALUE", "order_by_metric must be one of the metrics asked")
    order = body.get("order") or "desc"
    if order not in ("asc", "desc"):
        _fault(errors, "order", "VALIDATION.INVALID_VALUE", "order must be asc or desc")
    compare = body.get("compare")
    if compare not in (None, "previous"):
        _fault(errors, "compare", "VALIDATION.INVALID_VALUE", "compare must be previous")
    elif compare and not (aggregate == "total" or group_by == ["bucket_start"]):
        _fault(errors, "compare", "VALIDATION.INVALID_VALUE",
               "compare needs aggregate total or group_by [bucket_start] only")
    limit = body.get("limit")
    limit = DEFAULT_LIMIT if limit is None else limit
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        _fault(errors, "limit", "VALIDATION.INVALID_VALUE", f"limit must be an integer from 1 to {MAX_LIMIT}")
    offset = 0
    cursor = body.get("cursor")
    if cursor is not None:
        # A cursor is the next row's offset and a digest of the query it pages through.
        try:
            text, _, digest = base64.urlsafe_b64decode(cursor.encode()).decode().partition(":")
            offset = int(text)
            if offset < 0 or not text.isdigit() or digest != query_digest(body):
                raise ValueError(cursor)
        except (ValueError, AttributeError, UnicodeDecodeError, binascii.Error):
            _fault(errors, "cursor", "VALIDATION.INVALID_VALUE",
                   "cursor is not one this service returned for this query")
    if errors:
        raise Unprocessable("VALIDATION.INVALID_INPUT", "the request is invalid", errors=errors)
    assert start is not None and end is not None
    return _Query(realm, start, end, str(granularity), group_by, metrics, aggregate, list(filters.items()),
                  metric_filters, top_k, order_by, order, bool(compare), limit, offset)


def query_digest(body: dict[str, Any]) -> str:
    """What a cursor is bound to: the query without its cursor and limit, canonical."""
    rest = {k: v for k, v in body.items() if k not in ("cursor", "limit")}
    return hashlib.sha256(msgspec.json.encode(rest, order="sorted")).hexdigest()[:16]


def _keep(row: dict[str, Any], metric_filters: list[tuple[str, str, int]]) -> bool:
    for field, op, value in metric_filters:
        have = row[field]
        if not {"gte": have >= value, "lte": have <= value, "gt": have > value, "lt": have < value}[op]:
            return False
    return True


def _top(rows: list[dict[str, Any]], q: _Query) -> list[dict[str, Any]]:
    dim = next(d for d in q.group_by if d in ("feature_code", "feature_family_code"))
    totals: dict[Any, int] = {}
    for row in rows:
        totals[row[dim]] = totals.get(row[dim], 0) + row[q.order_by]
    ranked = sorted(totals, key=lambda k: (totals[k], str(k)), reverse=q.order == "desc")
    keep = set(ranked[:q.top_k])
    return [row for row in rows if row[dim] in keep]


def _render_row(row: dict[str, Any], q: _Query) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in q.group_by:
        value = row.get(d)
        out[d] = format_instant(value) if d == "bucket_start" and value is not None else value
    for m in q.metrics:
        out[m] = row[m] if m.endswith("_count") else str(row[m])
    return out


def _totals(rows: list[dict[str, Any]], metrics: list[str]) -> dict[str, int]:
    return {m: sum(r[m] for r in rows) for m in metrics if m != "distinct_billing_account_count"}


class ReportsController(Controller):
    path = "/mgt/v1/reports"
    tags = ["reports"]

    @post("/usage", operation_id="gate_query_usage_reports", status_code=200)
    async def usage(self, request: Request[Any, Any, Any]) -> Reply:
        """Usage (quantity, amount, counts) per bucket and dimension over a time range."""
        runtime: Runtime = request.app.state.runtime
        ctx, raw = await read_signed(runtime, request)
        realm = runtime.realm(ctx)
        account = account_in_context(realm, ctx)
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            raise BadRequest("VALIDATION.MALFORMED_JSON", "body is not valid JSON") from None
        q = _parse(body, realm.id, account)
        families = tuple((f.code, f.family) for f in realm.features.values() if f.family)
        reader: LakeReader = runtime.lake_reader

        def run(start: datetime, end: datetime) -> list[dict[str, Any]]:
            usage = UsageSlice(q.realm, start, end, q.granularity, tuple(q.group_by), tuple(q.metrics),
                               tuple(q.filters), families, collapse_buckets=q.aggregate != "series")
            return with_lake_retry(lambda: reader.query(usage))

        try:
            rows = await asyncio.to_thread(run, q.start, q.end)
            previous = (await asyncio.to_thread(run, q.start - (q.end - q.start), q.start)
                        if q.compare else None)
        except FileNotFoundError:
            rows, previous = [], ([] if q.compare else None)
        rows = [r for r in rows if _keep(r, q.metric_filters)]
        if q.top_k is not None:
            rows = _top(rows, q)
        page = rows[q.offset:q.offset + q.limit]
        more = q.offset + q.limit < len(rows)
        totals = _totals(rows, q.metrics)
        data: dict[str, Any] = {
            "granularity": q.granularity, "group_by": q.group_by, "metrics": q.metrics,
            "rows": [_render_row(r, q) for r in page],
            "totals": {m: str(v) for m, v in totals.items()},
        }
        if previous is not None:
            before = _totals(previous, q.metrics)
            data["compare_time"] = {"from": format_instant(q.start - (q.end - q.start)),
                                    "to": format_instant(q.start), "granularity": q.granularity}
            data["compare_rows"] = [_render_row(r, q) for r in previous]
            data["compare_totals"] = {m: str(v) for m, v in before.items()}
            data["delta"] = {m: str(totals[m] - before[m]) for m in totals}
            # A ratio for display, not money: the only float in a reply.
            data["delta_pct"] = {m: (round((totals[m] - before[m]) * 100 / before[m], 2) if before[m] else None)
                                 for m in totals}
        next_cursor = (base64.urlsafe_b64encode(f"{q.offset + q.limit}:{query_digest(body)}".encode()).decode()
                       if more else None)
        meta = {"next_cursor": next_cursor, "has_more": more, "limit": q.limit}
        return Reply(_encode({"ok": True, "code": "OK", "data": data, "meta": meta}), 200, None)

