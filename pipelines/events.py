"""Validation of one incoming event into the facts that are hashed, stored and rated.

Rules: `semantic_kind` in {activity, outcome}; `event_type` 1-128
characters after trim; `subject_ref` at most 256 characters, empty means absent; `occurred_at`
RFC 3339 with an offset, normalized to UTC microseconds, at most `max_future_skew` ahead;
`payload` that is not an object becomes `{}`; `labels` at most 32, keys lower-cased and matching
`[a-z][a-z0-9_.-]{0,63}`, values a string of at most 256 characters, a boolean or a number.
Every fault of an event is reported, each with the field it concerns.
"""

from __future__ import annotations

import re
import sys
from datetime import datetime, timedelta, timezone
from typing import Any

import msgspec

from pipelines.canonical import canonical_json, event_id, float_hook, request_hash

__all__ = [
    "EventIn",
    "FieldError",
    "LabelValue",
    "parse_instant",
    "ValidEvent",
    "decode_event",
    "format_instant",
    "validate_event",
]

SEMANTIC_KINDS = frozenset({"activity", "outcome"})
MAX_EVENT_TYPE = 128
MAX_SUBJECT_REF = 256
MAX_LABELS = 32
MAX_LABEL_TEXT = 256
_LABEL_NUMBER_MAX = int(sys.float_info.max)
_LABEL_KEY = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
_RFC3339 = re.compile(
    r"\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.[0-9]+)?([Zz]|[+-]\d{2}:\d{2})"
)
# msgspec reads at most 9 fraction digits and rounds half up at the 7th, so the digits past
# the 9th, which RFC 3339 allows, cannot change the microsecond: they are cut before parsing.
_MAX_FRACTION = 9
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)

LabelValue = str | bool | int | float


class EventIn(msgspec.Struct):
    """One event as it arrives; every field is checked by `validate_event`, not by the decoder,
    so that all faults of an item are reported together."""

    semantic_kind: Any = None
    event_type: Any = None
    occurred_at: Any = None
    subject_ref: Any = None
    payload: Any = None
    labels: Any = None


class FieldError(msgspec.Struct, frozen=True):
    field: str
    code: str
    message: str


class ValidEvent(msgspec.Struct, frozen=True):
    """The facts of an accepted-shape event, with its identity."""

    event_id: str
    request_hash: str
    billing_account_id: str
    semantic_kind: str
    event_type: str
    occurred_at: str
    occurred_at_us: int
    subject_ref: str | None
    payload: dict[str, Any]
    payload_json: bytes
    labels: dict[str, LabelValue]


def format_instant(moment: datetime) -> str:
    """The one text form of an instant: UTC, microseconds, `Z`.

    >>> format_instant(datetime(2026, 11, 1, 13, 0, tzinfo=timezone(timedelta(hours=1))))
    '2026-11-01T12:00:00.000000Z'
    """
    if moment.utcoffset():
        moment = moment.astimezone(timezone.utc)
    # isoformat is C code; its "+00:00" tail becomes "Z"
    return moment.isoformat(timespec="microseconds")[:26] + "Z"


decode_event = msgspec.json.Decoder(EventIn, float_hook=float_hook).decode
"""Decode one event; integral floats arrive as ints, as canonicalization wants them."""


def parse_instant(text: str) -> datetime | None:
    """An RFC 3339 instant with an offset (at most microseconds kept), or None."""
    return _parse_instant(text)


def _parse_instant(text: str) -> datetime | None:
    match = _RFC3339.fullmatch(text)
    if not match:
        return None
    fraction_end = match.end(1)
    if fraction_end - match.start(1) > 1 + _MAX_FRACTION:
        text = text[:match.start(1) + 1 + _MAX_FRACTION] + text[fraction_end:]
    try:
        moment = msgspec.convert(text, datetime)
        if moment.tzinfo is None:
            return None
        moment.astimezone(timezone.utc)  # e.g. 0001-01-01T00:00:00+01:00 has no UTC instant
    except (msgspec.ValidationError, OverflowError):
        return None
    return moment


def _check_labels(raw: Any, errors: list[FieldError], field: str) -> dict[str, LabelValue]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        errors.append(FieldError(field, "VALIDATION.INVALID_TYPE", "labels must be an object"))
        return {}
    if len(raw) > MAX_LABELS:
        errors.append(
            FieldError(field, "VALIDATION.TOO_MANY", f"at most {MAX_LABELS} labels, got {len(raw)}")
        )
        return {}
    labels: dict[str, LabelValue] = {}
    for key, value in raw.items():
        norm = key.lower()
        where = f"{field}.{key}"
        if not _LABEL_KEY.fullmatch(norm):
            errors.append(
                FieldError(where, "VALIDATION.INVALID_VALUE",
                           "label key must match [a-z][a-z0-9_.-]{0,63} after lower-casing")
            )
            continue
        if norm in labels:
            errors.append(
                FieldError(where, "VALIDATION.DUPLICATE_KEY",
                           f"label key {norm!r} is given twice once lower-cased")
            )
            continue
        if isinstance(value, str):
            if len(value) > MAX_LABEL_TEXT:
                errors.append(
                    FieldError(where, "VALIDATION.TOO_LONG",
                               f"label text is at most {MAX_LABEL_TEXT} characters")
                )
                continue
        elif not isinstance(value, (bool, int, float)):
            errors.append(
                FieldError(where, "VALIDATION.INVALID_TYPE",
                           "label value must be a string, a boolean or a number")
            )
            continue
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > _LABEL_NUMBER_MAX:
            # The typed number slot is a double: beyond its range the slot would read inf.
            errors.append(
                FieldError(where, "VALIDATION.INVALID_VALUE",
                           "label number is beyond the range of a double (about 1.8e308)")
            )
            continue
        labels[norm] = value
    return labels


def validate_event(
    item: EventIn,
    *,
    realm: str,
    billing_account_id: str,
    now: datetime,
    max_future_skew_seconds: int,
    prefix: str = "",
    floats_normalized: bool = False,
) -> ValidEvent | list[FieldError]:
    """The event's facts and identity, or every fault found (field paths under `prefix`).

    `floats_normalized`: the item came from `decode_event`, so its payload needs no rewrite.
    """
    errors: list[FieldError] = []

    kind = item.semantic_kind
    if kind is None:
        errors.append(FieldError(prefix + "semantic_kind", "VALIDATION.REQUIRED", "semantic_kind is required"))
    elif not isinstance(kind, str) or kind not in SEMANTIC_KINDS:
        errors.append(
            FieldError(prefix + "semantic_kind", "VALIDATION.INVALID_VALUE",
                       "semantic_kind must be 'activity' or 'outcome'")
        )

    event_type = item.event_type
    if event_type is None:
        errors.append(FieldError(prefix + "event_type", "VALIDATION.REQUIRED", "event_type is required"))
    elif not isinstance(event_type, str):
        errors.append(FieldError(prefix + "event_type", "VALIDATION.INVALID_TYPE", "event_type must be a string"))
    else:
        event_type = event_type.strip()
        if not event_type:
            errors.append(FieldError(prefix + "event_type", "VALIDATION.REQUIRED", "event_type is empty"))
        elif len(event_type) > MAX_EVENT_TYPE:
            errors.append(
                FieldError(prefix + "event_type", "VALIDATION.TOO_LONG",
                           f"event_type is at most {MAX_EVENT_TYPE} characters")
            )

    subject_ref = item.subject_ref
    if subject_ref is not None:
        if not isinstance(subject_ref, str):
            errors.append(
                FieldError(prefix + "subject_ref", "VALIDATION.INVALID_TYPE", "subject_ref must be a string")
            )
        elif len(subject_ref) > MAX_SUBJECT_REF:
            errors.append(
                FieldError(prefix + "subject_ref", "VALIDATION.TOO_LONG",
                           f"subject_ref is at most {MAX_SUBJECT_REF} characters")
            )
        elif not subject_ref:
            subject_ref = None

    occurred: datetime | None = None
    if item.occurred_at is None:
        errors.append(FieldError(prefix + "occurred_at", "VALIDATION.REQUIRED", "occurred_at is required"))
    elif not isinstance(item.occurred_at, str) or (occurred := _parse_instant(item.occurred_at)) is None:
        errors.append(
            FieldError(prefix + "occurred_at", "VALIDATION.INVALID_TIMESTAMP",
                       "occurred_at must be an RFC 3339 timestamp with an offset, e.g. 2026-11-01T12:00:00Z")
        )
    elif occurred - now > timedelta(seconds=max_future_skew_seconds):
        errors.append(
            FieldError(prefix + "occurred_at", "VALIDATION.IN_FUTURE",
                       f"occurred_at is more than {max_future_skew_seconds} s ahead of the server clock")
        )

    labels = _check_labels(item.labels, errors, prefix + "labels")
    if errors:
        return errors
    assert occurred is not None

    payload = item.payload if isinstance(item.payload, dict) else {}
    payload_json = canonical_json(payload, floats_normalized=floats_normalized)
    occurred_at = format_instant(occurred)
    delta = occurred - _EPOCH
    occurred_us = (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds
    rh = request_hash(billing_account_id, kind, event_type, occurred_at, subject_ref,
                      payload_json=payload_json)
    return ValidEvent(
        event_id=event_id(realm, billing_account_id, rh),
        request_hash=rh,
        billing_account_id=billing_account_id,
        semantic_kind=kind,
        event_type=event_type,
        occurred_at=occurred_at,
        occurred_at_us=occurred_us,
        subject_ref=subject_ref,
        payload=payload,
        payload_json=payload_json,
        labels=labels,
    )
