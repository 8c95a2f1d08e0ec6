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
from msgspec import Meta, Struct

__all__ = [
    "AuthorizeData", "AuthorizeRequest", "BatchData", "BatchItemAccepted", "BatchItemDuplicate",
    "BatchItemFailed", "BatchItemInvalid", "CancelData", "CancelRequest", "CommitData", "CommitLine",
    "CommitRequest", "ErrorEnvelope", "EventBatchRequest", "EventData", "EventRequest", "FieldFault",
    "HealthData", "Hint", "MeterEntry",
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
    trace_id: str
    meta: ErrorMeta
    errors: list[FieldFault]
    hints: list[Hint]


# ---- health ---------------------------------------------------------------------------------
class HealthData(Struct, forbid_unknown_fields=True):
    status: Literal["ready", "starting"]
    catalog: Annotated[str, Meta(description="The fingerprint of the applied catalog.")]
    realms: list[str]
    schema_version: Annotated[int, Meta(description="The operational file's schema version.")]
    writer: Literal["running", "down"]


# ---- gate -----------------------------------------------------------------------------------
class AuthorizeRequest(Struct):
    """Ask to run `estimated_quantity_minor` of a feature: holds its price and quota in a lease."""

    feature_code: Code
    estimated_quantity_minor: Quantity
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
    meters: Annotated[list[MeterEntry], Meta(max_length=64)] | None = None
    labels: GateLabels | None = None


class CommitLine(Struct, forbid_unknown_fields=True):
    line_id: str
    meter_code: str
    quantity_minor: Quantity
    unit_price_xusd: Xusd
    unit_quantity_minor: Quantity
    amount_xusd: Xusd
    pricing_fingerprint: Annotated[str | None, Meta(description="The price row's id and terms, hashed; null when unpriced.")]


class CommitData(Struct, forbid_unknown_fields=True):
    commit_id: str
    amount_xusd: Xusd
    lines: list[CommitLine]
    balance_xusd: SignedXusd
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


def example(struct: type[Struct], **fields: Any) -> dict[str, Any]:
    """An example body of `struct`, checked against it here."""
    msgspec.convert(fields, struct)
    return fields
