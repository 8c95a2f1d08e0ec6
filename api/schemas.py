"""The bodies of the API as msgspec Structs: what each route accepts and answers.

The handlers read their bodies field by field and build their answers as dicts (the hot
path); these Structs describe exactly those shapes for the OpenAPI document (`api.openapi`),
and `tests/test_openapi.py` checks real responses against them. Response Structs forbid
unknown fields, so a field a handler adds without adding it here fails that test. Money and
quantities are decimal integer strings (`"1500"`), never JSON numbers, except the amounts in
hints, which are JSON integers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

__all__ = [
    "Amounts", "AuthorizeData", "AuthorizeRequest", "BalanceData", "BatchData", "BatchItemAccepted",
    "BatchItemDuplicate", "BatchItemFailed", "BatchItemInvalid", "CancelData", "CancelRequest",
    "CommitBatchData", "CommitBatchItem", "CommitBatchRequest", "CommitData", "CommitItemCommitted",
    "CommitItemDuplicate", "CommitItemError", "CommitItemFailed", "CommitItemInvalid", "CommitLine",
    "CommitRequest", "ComparedTime", "Conversion", "DimensionFilter", "ErrorEnvelope", "EventBatchRequest",
    "EventData", "EventRequest", "FeatureLimits", "FieldFault", "GrantView", "HealthData", "Hint",
    "IngestData", "IngestRequest", "MeterCoverage", "MeterEntry", "MeterLimits", "MeterPricing",
    "MetricFilter", "QuotaView", "RateView", "ReportMeta", "ReportTime", "UsageReportData",
    "UsageReportRequest", "UsageRow",
]

# ---- shared field types ------------------------------------------------------------------
Code = Annotated[str, Meta(
    pattern=r"^[a-z0-9]([a-z0-9._/@:-]{0,126}[a-z0-9])?$",
    description="A catalog code: 1-128 lower-case characters of [a-z0-9._/@:-], alphanumeric at both ends.",
    examples=["llm.chat"])]
Quantity = Annotated[str, Meta(
    pattern=r"^[0-9]+$",
    description="A non-negative integer, as a decimal string, within signed 64-bit (at most 9223372036854775807).",
    examples=["1500"])]
Xusd = Annotated[str, Meta(
    pattern=r"^[0-9]+$",
    description="An amount in micro-USD (1 USD = 1000000), as a decimal integer string.",
    examples=["225"])]
SignedXusd = Annotated[str, Meta(
    pattern=r"^-?[0-9]+$",
    description="An amount in micro-USD as a decimal integer string; negative when the account owes.",
    examples=["4999775"])]
Instant = Annotated[str, Meta(
    pattern=r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}Z$",
    description="An instant in UTC with microseconds: YYYY-MM-DDTHH:MM:SS.ffffffZ.",
    examples=["2026-11-01T12:00:00.000000Z"])]
GateLabels = Annotated[dict[str, Annotated[str, Meta(max_length=256)]], Meta(
    max_length=32,
    description="At most 32 string values; keys of at most 64 characters, values of at most 256.")]
LeaseToken = Annotated[str, Meta(
    min_length=1, max_length=512,
    description="The lease_token that authorize answered (`tgl_` and 43 base64url characters).",
    examples=["tgl_3q2-7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"])]
LabelValue = Annotated[str, Meta(max_length=256)] | bool | int | float


# ---- hints ----------------------------------------------------------------------------------
class _Hint(Struct, tag_field="type", forbid_unknown_fields=True):
    pass


class QuotaRemainingHint(_Hint, tag="quota.remaining"):
    """A quota's quantity left in its window: on a refusal, or on a success leaving under a fifth."""

    max_quantity_minor: int


class BudgetLowHeadroomHint(_Hint, tag="budget.low_headroom"):
    """A success that leaves under a fifth of a budget."""

    budget_id: str
    headroom_xusd: int


class BudgetShortfallHint(_Hint, tag="budget.shortfall"):
    """What a refused authorize lacked in a budget."""

    budget_id: str
    shortfall_xusd: int


class FundingShortfallHint(_Hint, tag="funding.xusd_shortfall"):
    """What a refused authorize lacked in a prepaid account's funds."""

    shortfall_xusd: int


class RateLimitHint(_Hint, tag="rate.limit"):
    """The rate limit a 429 hit and when its window resets."""

    limit: int
    remaining: int
    reset_at: Annotated[str, Meta(description="The window's end, ISO 8601 in UTC (`Z`).")]


class LeaseExpiredHint(_Hint, tag="lease.expired"):
    """A commit booked after its lease expired."""

    expires_at: Instant


class PricingNotConfiguredHint(_Hint, tag="pricing.not_configured"):
    """A commit whose meters have no price in force: their lines cost 0."""

    feature_code: str
    meters: list[str]


Hint = (QuotaRemainingHint | BudgetLowHeadroomHint | BudgetShortfallHint | FundingShortfallHint
        | RateLimitHint | LeaseExpiredHint | PricingNotConfiguredHint)


# ---- errors ---------------------------------------------------------------------------------
class FieldFault(Struct, forbid_unknown_fields=True):
    """One fault of the request, with the field it concerns (e.g. `meters[0].quantity_minor`)."""

    field: str
    code: str
    message: str


class ErrorMeta(Struct, forbid_unknown_fields=True):
    status: int


class ErrorEnvelope(Struct, forbid_unknown_fields=True):
    """Every error: `code` names it (see docs/api.md), `errors` lists field faults, `trace_id`
    equals the X-Request-Id response header."""

    ok: Literal[False]
    code: str
    message: str
    trace_id: Annotated[str, Meta(
        pattern=r"^[A-Za-z0-9._:-]{1,128}$",
        description="The request's trace id: its X-Request-Id when valid, else a new one.")]
    meta: ErrorMeta
    errors: list[FieldFault]
    hints: list[Hint]


# ---- health ---------------------------------------------------------------------------------
class HealthData(Struct, forbid_unknown_fields=True):
    status: Annotated[Literal["ready", "starting", "down"], Meta(
        description="`ready`; `starting` until the writer has opened the data folder; `down` "
                    "while the writer is gone (being restarted, or for good) or refuses writes "
                    "because the operational file does (a full disk).")]
    reasons: Annotated[list[Literal["starting", "writer restarting", "writer down",
                                    "storage refuses writes"]], Meta(
        description="Why the service is not ready; empty when it is. `storage refuses writes`: "
                    "the operational file refuses writes and the journal holds as many rows "
                    "beyond it as it may (`TOLLGATE_MAX_BACKLOG_ROWS`); writes get 503 "
                    "`STORAGE.UNAVAILABLE` until it takes them again.")]
    catalog: Annotated[str, Meta(description="The fingerprint of the applied catalog.")]
    schema_version: Annotated[int, Meta(description="The operational file's schema version.")]
    writer: Annotated[Literal["running", "restarting", "down"], Meta(
        description="`restarting` from the writer's end until a new writer has applied the journal.")]


# ---- gate -----------------------------------------------------------------------------------
class AuthorizeRequest(Struct):
    """Ask to run `estimated_quantity_minor` of a feature: holds its price and quota in a lease."""

    feature_code: Code
    estimated_quantity_minor: Annotated[Quantity | None, Meta(
        description="The quantity to hold; absent, the hold is the price of one block of the "
                    "feature's primary meter (held_quantity_minor \"0\").")] = None
    feature_family_code: Code | None = None
    labels: GateLabels | None = None


class AuthorizeData(Struct, forbid_unknown_fields=True):
    lease_token: Annotated[str, Meta(description="The secret that commits or cancels this lease; only its sha256 is stored.")]
    lease: Annotated[str, Meta(description="The same value as lease_token (for clients that read `lease`).")]
    lease_id: str
    feature_code: str
    feature_family_code: Annotated[str, Meta(description="The feature's family, or \"\" when it has none.")]
    window_start: Instant
    window_end: Instant
    expires_at: Instant
    held_quantity_minor: Quantity
    held_amount_xusd: Xusd


class MeterEntry(Struct):
    meter_code: Code
    quantity_minor: Quantity


class CommitRequest(Struct):
    """Report what the work used; `meters` prices several meters of the feature instead of
    `quantity_minor` on its primary meter. The same body again replays the first answer."""

    lease_token: LeaseToken
    feature_code: Code
    quantity_minor: Quantity
    meters: Annotated[list[MeterEntry], Meta(min_length=1, max_length=64)] | None = None
    labels: GateLabels | None = None


class CommitLine(Struct, forbid_unknown_fields=True):
    line_id: str
    meter_code: str
    quantity_minor: Quantity
    unit_price_xusd: Xusd
    unit_quantity_minor: Quantity
    amount_xusd: Xusd
    pricing_fingerprint: Annotated[str | None, Meta(description="The price row's id and terms, hashed; null when unpriced.")]


class IngestData(Struct, forbid_unknown_fields=True):
    """What a commit booked; an ingest answers this (it has no lease)."""

    commit_id: str
    amount_xusd: Xusd
    lines: list[CommitLine]
    balance_xusd: SignedXusd


class CommitData(IngestData, forbid_unknown_fields=True):
    lease_id: str


class CancelRequest(Struct):
    """Release the hold of an active lease."""

    lease_token: LeaseToken
    reason: Annotated[str, Meta(max_length=512)] | None = None


class CancelData(Struct, forbid_unknown_fields=True):
    cancelled: Annotated[bool, Meta(description="false when the lease had already ended (see state).")]
    state: Literal["cancelled", "committed", "expired"]
    released_cap: Annotated[Quantity, Meta(description="The quantity whose hold this call released.")]
    lease_id: str


class CommitBatchItem(Struct):
    """One commit of a batch: a commit's body and the item's own idempotency key."""

    lease_token: LeaseToken
    feature_code: Code
    quantity_minor: Quantity
    idempotency_key: Annotated[str, Meta(
        min_length=1, max_length=255,
        description="The item's idempotency scope is (principal, lease, idempotency_key): the "
                    "same item again answers `duplicate` with its first commit.")]
    meters: Annotated[list[MeterEntry], Meta(min_length=1, max_length=64)] | None = None
    labels: GateLabels | None = None


class CommitBatchRequest(Struct):
    """1 to 100 commits, each decided as a commit of its own, in order."""

    items: Annotated[list[CommitBatchItem], Meta(min_length=1, max_length=100)]
    merge_advice: Annotated[Literal["none", "by_pricing_fingerprint"] | None, Meta(
        description="Accepted, without effect: each line is priced with its carried remainder, "
                    "so merging would not change a total.")] = None


class CommitItemError(Struct, forbid_unknown_fields=True):
    """Why an item was not committed: `type` as the official client names it, and the code."""

    type: Literal["invalid_request", "invalid_lease", "feature_mismatch", "meter_not_allowed_for_feature",
                  "conflict"]
    code: Literal["VALIDATION.INVALID_INPUT", "VALIDATION.INVALID_TYPE", "LEASE.NOT_FOUND",
                  "LEASE.FEATURE_MISMATCH", "FEATURE.METER_NOT_ALLOWED", "RESOURCE.NOT_FOUND",
                  "LEASE.ALREADY_COMMITTED", "LEASE.CANCELLED", "IDEMPOTENCY.CONFLICT"]
    details: Annotated[str, Meta(description="The message of the refusal.")]
    errors: Annotated[list[FieldFault], Meta(
        description="Present when there are field faults; fields are named from the batch "
                    "(`items[2].quantity_minor`).")] | UnsetType = UNSET


class _CommitItem(Struct, tag_field="status", forbid_unknown_fields=True):
    pass


class CommitItemCommitted(_CommitItem, tag="committed"):
    index: int
    commit: CommitData
    hints: Annotated[list[Hint], Meta(description="The commit's hints (lease.expired, "
                                                   "pricing.not_configured), when it has any.")] | UnsetType = UNSET


class CommitItemDuplicate(_CommitItem, tag="duplicate"):
    """The same item (key and body) was committed before: its first commit."""

    index: int
    commit: CommitData
    hints: Annotated[list[Hint], Meta(description="The first commit's hints, when it had any.")] | UnsetType = UNSET


class CommitItemInvalid(_CommitItem, tag="invalid"):
    """A malformed item, an unknown lease, a feature or meter mismatch (a commit's 422)."""

    index: int
    error: CommitItemError


class CommitItemFailed(_CommitItem, tag="failed"):
    """A cancelled lease, a lease committed with another body, the item's key with another
    body (a commit's 409)."""

    index: int
    error: CommitItemError


class CommitBatchData(Struct, forbid_unknown_fields=True):
    items: Annotated[list[CommitItemCommitted | CommitItemDuplicate | CommitItemInvalid | CommitItemFailed],
                     Meta(description="One result per item, in input order.")]
    committed_count: Annotated[int, Meta(description="committed and duplicate items together.")]
    failed_count: Annotated[int, Meta(description="invalid and failed items together.")]


class IngestRequest(Struct):
    """Usage that ran without a lease, booked like a commit with no limit checked. Give
    `quantity_minor`, `meters`, or both; without `quantity_minor` the feature's quantity is the
    sum of its primary meter's lines."""

    feature_code: Code
    quantity_minor: Quantity | None = None
    meters: Annotated[list[MeterEntry], Meta(min_length=1, max_length=64)] | None = None
    occurred_at: Annotated[str, Meta(
        extra_json_schema={"format": "date-time"}, examples=["2026-11-01T12:00:00Z"],
        description="RFC 3339; prices are those in force then. Now when absent; at most the "
                    "realm's max_future_skew_seconds ahead.")] | None = None
    labels: GateLabels | None = None
    budget_id: Annotated[str, Meta(max_length=128, description="Kept with the usage; not enforced.")] | None = None
    metadata: Annotated[dict[str, Any], Meta(description="Kept with the usage.")] | None = None


class QuotaView(Struct, forbid_unknown_fields=True):
    """A quota in the window open now."""

    quota_id: str
    subject_scope: Annotated[Literal["user", "account"], Meta(description="The official client's name of scope (principal: user).")]
    scope: Literal["principal", "account"]
    window: Literal["day", "month"]
    window_start: Instant
    window_end: Instant
    limit_minor: Quantity
    used_minor: Annotated[Quantity, Meta(description="Committed in the window.")]
    held_minor: Annotated[Quantity, Meta(description="Held by active leases.")]
    remaining_minor: Annotated[Quantity, Meta(description="limit - used - held, at least 0.")]


class RateView(Struct, forbid_unknown_fields=True):
    """A rate limit in the fixed window open now (counted by the HTTP process)."""

    rate_limit_id: str
    subject_scope: Literal["user", "account"]
    scope: Literal["principal", "account"]
    window_start: Instant
    window_end: Instant
    limit_minor: Quantity
    used_minor: Annotated[Quantity, Meta(description="Authorizes counted in the window.")]
    remaining_minor: Quantity


class FeatureLimits(Struct, forbid_unknown_fields=True):
    """An active feature's limits for the principal in context."""

    feature_code: str
    feature_family_code: str | None
    unit: Annotated[str | None, Meta(description="The primary meter's unit.")]
    primary_meter: str
    quotas: Annotated[list[QuotaView], Meta(description="The quotas that apply to the principal's account.")]
    rates: list[RateView]
    meters: Annotated[list[str], Meta(description="The meters a commit of the feature may name.")]


class MeterPricing(Struct, forbid_unknown_fields=True):
    """The price row in force now."""

    unit_price_xusd: Xusd
    unit_quantity_minor: Quantity
    rounding: Literal["floor", "nearest", "ceil"]
    effective_at: Instant
    fingerprint: Annotated[str, Meta(description="As a commit line's pricing_fingerprint.")]
    unit: str
    price_id: str


class MeterCoverage(Struct, forbid_unknown_fields=True):
    """What a prepaid account's available funds buy of the meter: advisory (carried
    remainders and other calls change what a commit costs)."""

    basis: Literal["xusd"]
    balance_xusd: Annotated[SignedXusd, Meta(description="Available: grants in force - committed + credit limit - held.")]
    max_quantity_minor_estimated: Annotated[Quantity, Meta(
        description="floor(available / unit_price_xusd) x unit_quantity_minor; 0 when nothing is available.")]
    advisory: Literal[True]
    as_of: Instant


class MeterLimits(Struct, forbid_unknown_fields=True):
    """A meter of the realm, for the principal in context."""

    meter_code: str
    unit: str
    features: Annotated[list[str], Meta(description="The active features that use the meter.")]
    feature_family_codes: list[str]
    quotas: Annotated[list[QuotaView], Meta(description="The quotas of the features whose primary meter it is.")]
    rates: Annotated[list[RateView], Meta(
        max_length=0, description="Always empty: rate limits count a feature's authorizes (GET /gate/limits).")]
    pricing: Annotated[MeterPricing, Meta(description="Absent when the meter has no price in force.")] | UnsetType = UNSET
    coverage: Annotated[MeterCoverage, Meta(description="Present for a prepaid account when the meter is priced.")] | UnsetType = UNSET


# ---- wallet ---------------------------------------------------------------------------------
class Amounts(Struct, forbid_unknown_fields=True):
    xusd: SignedXusd
    usd: Annotated[str, Meta(pattern=r"^-?[0-9]+$", description="USD cents, truncated toward zero.",
                             examples=["599"])]


class Conversion(Struct, forbid_unknown_fields=True):
    as_of: Annotated[Instant, Meta(description="The gate book's time of the read.")]
    usd_per_xusd: Literal["0.000001"]


class GrantView(Struct, forbid_unknown_fields=True):
    """A grant in force; grants are consumed oldest first, so a deficit shows on the newest."""

    grant_id: str
    status: Literal["active"]
    on_ledger: Literal[True]
    window_start: Annotated[Instant, Meta(description="The grant's effective_at.")]
    issued: Amounts
    remaining: Amounts
    consumed_xusd: Xusd


class BalanceData(Struct, forbid_unknown_fields=True):
    """The money of the account in context, in the official client's shape and spelled out."""

    billing_account_id: str
    billing_user_id: Annotated[str, Meta(description="X-User-Id, else X-Principal-Id, else \"\".")]
    balances: Annotated[Amounts, Meta(description="Available: what an authorize may still hold.")]
    outstanding_balances: Annotated[Amounts, Meta(description="The balance: grants in force - committed.")]
    conversion: Conversion
    grants: list[GrantView]
    funding: Literal["prepaid", "postpaid"]
    granted_xusd: Annotated[Xusd, Meta(description="The grants in force (effective_at <= now).")]
    committed_xusd: Annotated[Xusd, Meta(description="What commits and ingested usage booked, ever.")]
    balance_xusd: Annotated[SignedXusd, Meta(description="granted - committed.")]
    held_xusd: Annotated[Xusd, Meta(description="What the account's active leases hold.")]
    credit_limit_xusd: Xusd
    available_xusd: Annotated[SignedXusd, Meta(description="balance + credit limit - held.")]


# ---- events ---------------------------------------------------------------------------------
class EventRequest(Struct):
    """A business event. Its facts (account, kind, type, occurred_at, subject, payload) make its
    identity: the same facts again are a duplicate. Labels are not facts."""

    semantic_kind: Literal["activity", "outcome"]
    event_type: Annotated[str, Meta(min_length=1, max_length=128, examples=["llm.completion"],
                                    description="1-128 characters after trimming.")]
    occurred_at: Annotated[str, Meta(
        extra_json_schema={"format": "date-time"}, examples=["2026-11-01T12:00:00Z"],
        description="RFC 3339 with an offset; at most the realm's max_future_skew_seconds ahead.")]
    subject_ref: Annotated[str, Meta(max_length=256, description="Empty means absent.")] | None = None
    payload: Annotated[Any, Meta(description="Any JSON object; anything else is stored as {}.")] = None
    labels: Annotated[dict[str, LabelValue], Meta(
        max_length=32,
        description="At most 32; keys match [a-z][a-z0-9_.-]{0,63} once lower-cased (two keys equal "
                    "once lower-cased are refused); values are strings of at most 256 characters, "
                    "booleans or numbers.")] | None = None


class EventData(Struct, forbid_unknown_fields=True):
    event_id: Annotated[str, Meta(extra_json_schema={"format": "uuid"}, description="A UUID v8 from the realm, account and request_hash.")]
    request_hash: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{43}$", description="sha256 of the event's facts as canonical JSON, base64url without padding.")]
    billing_account_id: str
    semantic_kind: Literal["activity", "outcome"]
    event_type: str
    occurred_at: Instant
    subject_ref: str | None
    payload: dict[str, Any]
    labels: dict[str, str | bool | int | float]
    created_at: Annotated[Instant | None, Meta(description="When the event was first accepted.")]


class EventBatchRequest(Struct):
    events: Annotated[list[EventRequest], Meta(min_length=1, max_length=1000)]


class ItemError(Struct, forbid_unknown_fields=True):
    code: str
    message: Annotated[str, Meta(description="Every fault of the item; code and field name the first.")]
    field: str


class ItemFailure(Struct, forbid_unknown_fields=True):
    code: Literal["STORAGE.UNAVAILABLE"]
    message: str


class _Item(Struct, tag_field="status", forbid_unknown_fields=True):
    pass


class BatchItemAccepted(_Item, tag="accepted"):
    index: int
    event_id: str
    request_hash: str


class BatchItemDuplicate(_Item, tag="duplicate"):
    index: int
    event_id: str
    request_hash: str


class BatchItemInvalid(_Item, tag="invalid"):
    index: int
    error: ItemError


class BatchItemFailed(_Item, tag="failed"):
    """Not stored (storage unavailable): retry exactly these."""

    index: int
    event_id: str
    request_hash: str
    error: ItemFailure


class BatchData(Struct, forbid_unknown_fields=True):
    results: Annotated[list[BatchItemAccepted | BatchItemDuplicate | BatchItemInvalid | BatchItemFailed],
                       Meta(description="One result per event, in input order.")]
    accepted_count: int
    duplicate_count: int
    invalid_count: int
    failed_count: Annotated[int, Meta(description="invalid and failed items together.")]


# ---- reports --------------------------------------------------------------------------------
Dimension = Literal["bucket_start", "billing_account_id", "feature_code", "feature_family_code",
                    "meter_code", "pricing_fingerprint"]
FilterDimension = Literal["billing_account_id", "feature_code", "feature_family_code", "meter_code",
                          "pricing_fingerprint"]
Metric = Literal["quantity_minor", "amount_xusd", "line_count", "commit_count",
                 "distinct_billing_account_count"]
UtcTime = Annotated[str, Meta(
    extra_json_schema={"format": "date-time"}, pattern=r"Z$", examples=["2026-11-01T00:00:00Z"],
    description="RFC 3339 in UTC, ending with `Z`.")]
SignedInteger = Annotated[str, Meta(pattern=r"^-?[0-9]+$", description="A sum, as a decimal integer string.",
                                    examples=["2250"])]


class ReportTime(Struct):
    from_: Annotated[UtcTime, Meta(description="Inclusive.")] = msgspec.field(name="from")
    to: Annotated[UtcTime, Meta(description="Exclusive; after `from`, at most 400 days later (day) or 3660 (month).")]
    granularity: Literal["day", "month"]


class DimensionFilter(Struct):
    field: FilterDimension
    op: Literal["eq", "in"]
    value: Annotated[str | Annotated[list[str], Meta(min_length=1)], Meta(
        description="A string for eq, a non-empty array of strings for in.")]


class MetricFilter(Struct):
    field: Annotated[Metric, Meta(description="One of the metrics asked.")]
    op: Literal["gte", "lte", "gt", "lt"]
    value: Annotated[str, Meta(pattern=r"^-?[0-9]+$", description="An integer, as a string.")]


class UsageReportRequest(Struct):
    """The official client's GateOpsUsageReportQuery, as far as tollgate records it: the other
    dimensions and metrics of that query are refused (422, VALIDATION.UNSUPPORTED_DIMENSION /
    VALIDATION.UNSUPPORTED_METRIC)."""

    time: ReportTime
    group_by: Annotated[list[Dimension], Meta(min_length=1, description="bucket_start is added when missing.")]
    metrics: Annotated[list[Metric], Meta(description="quantity_minor and amount_xusd when absent or empty.")] | None = None
    aggregate: Annotated[Literal["series", "total", "group_total"], Meta(
        description="series (the default); total: one row, group_by [bucket_start] only; group_total: one "
                    "row per group, bucket_start = time.from.")] | None = None
    dim_filters: list[DimensionFilter] | None = None
    metric_filters: Annotated[list[MetricFilter], Meta(description="On the result rows.")] | None = None
    top_k: Annotated[int, Meta(ge=1, le=100, description=(
        "The top k values of the one feature_code or feature_family_code in group_by, ranked over the "
        "whole range by order_by_metric."))] | None = None
    order_by_metric: Annotated[Metric, Meta(description="One of the metrics asked; the first by default.")] | None = None
    order: Annotated[Literal["asc", "desc"], Meta(description="desc by default.")] | None = None
    compare: Annotated[Literal["previous"], Meta(
        description="The window of the same length before; needs aggregate total or group_by [bucket_start] only.")] | None = None
    limit: Annotated[int, Meta(ge=1, le=5000, description="Rows per page.")] = 1000
    cursor: Annotated[str, Meta(description="meta.next_cursor of the page before.")] | None = None


class UsageRow(Struct, forbid_unknown_fields=True):
    """One row: the dimensions of group_by (null when the lines have none, e.g. a feature
    without family, an unpriced line) and the metrics asked."""

    bucket_start: Instant
    billing_account_id: str | None | UnsetType = UNSET
    feature_code: str | None | UnsetType = UNSET
    feature_family_code: str | None | UnsetType = UNSET
    meter_code: str | None | UnsetType = UNSET
    pricing_fingerprint: Annotated[str | None, Meta(description="The price row's id.")] | UnsetType = UNSET
    quantity_minor: SignedInteger | UnsetType = UNSET
    amount_xusd: Annotated[SignedInteger, Meta(description="micro-USD.")] | UnsetType = UNSET
    line_count: int | UnsetType = UNSET
    commit_count: Annotated[int, Meta(description="Current sources: events, aggregate days, commits.")] | UnsetType = UNSET
    distinct_billing_account_count: int | UnsetType = UNSET


class ComparedTime(Struct, forbid_unknown_fields=True):
    from_: Instant = msgspec.field(name="from")
    to: Instant
    granularity: Literal["day", "month"]


class UsageReportData(Struct, forbid_unknown_fields=True):
    granularity: Literal["day", "month"]
    group_by: Annotated[list[Dimension], Meta(description="As asked, bucket_start first when it was added.")]
    metrics: list[Metric]
    rows: Annotated[list[UsageRow], Meta(description="This page's rows.")]
    totals: Annotated[dict[str, SignedInteger], Meta(
        description="Each metric (but distinct_billing_account_count) summed over every row of every page.")]
    compare_time: Annotated[ComparedTime, Meta(description="With compare: the window before.")] | UnsetType = UNSET
    compare_rows: list[UsageRow] | UnsetType = UNSET
    compare_totals: dict[str, SignedInteger] | UnsetType = UNSET
    delta: Annotated[dict[str, SignedInteger], Meta(description="totals - compare_totals.")] | UnsetType = UNSET
    delta_pct: Annotated[dict[str, float | None], Meta(
        description="delta / compare_totals x 100, to 2 decimals; null when compare_totals is 0. A ratio "
                    "for display, never money.")] | UnsetType = UNSET


class ReportMeta(Struct, forbid_unknown_fields=True):
    next_cursor: Annotated[str | None, Meta(description="The cursor of the next page; null on the last.")]
    has_more: bool
    limit: int


def example(struct: type[Struct], **fields: Any) -> dict[str, Any]:
    """An example body of `struct`, checked against it here."""
    msgspec.convert(fields, struct)
    return fields
