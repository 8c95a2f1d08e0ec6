r"""Canonical JSON, the event `request_hash` and the deterministic `event_id`.

The dedupe identity of an event is (realm, billing_account_id, request_hash). The hash is
taken over the canonical JSON of the event's facts, so two requests that carry the same facts
in another key order, other spacing or another spelling of the same instant hash the same.

Canonical JSON here: keys sorted by code point at every depth, no whitespace, UTF-8, numbers
in shortest round-trip form and integral numbers written as integers (``1.0`` -> ``1``, as
JSON Canonicalization Scheme does, so a client that sends ``1.0`` and one that sends ``1``
describe the same fact).

>>> canonical_json({"b": 1.0, "a": [2.5, "é"]})
b'{"a":[2.5,"\xc3\xa9"],"b":1}'
>>> request_hash("acct", "activity", "x", "2026-11-01T00:00:00.000000Z", None, {})
'92tqnn78oGALwpLPD0eozLIJ4Hm6WduTGH3XxNnWsi0'
"""

from __future__ import annotations

import base64
import hashlib
import math
from typing import Any

import msgspec

__all__ = ["canonical_json", "event_id", "float_hook", "request_hash"]

_VARIANT = {c: "89ab"[int(c, 16) & 0x3] for c in "0123456789abcdef"}

_encode_sorted = msgspec.json.Encoder(order="sorted").encode


# JCS (RFC 8785) writes a number below 1e21 without an exponent: an integral float below it
# is written as the integer it is, so `1e16` and `10000000000000000` are the same fact.
_INTEGRAL_BELOW = 1e21


def float_hook(text: str) -> int | float:
    """Decode a JSON float; an integral one below 1e21 becomes an int (``1.0`` -> ``1``,
    ``1e16`` -> ``10000000000000000``). A number beyond the float range (``1e400``) is
    refused: no finite value stands for it, and writing it as null would make it another
    fact's twin.

    Given to the request decoders, so canonicalization needs no second walk over the payload.
    """
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is beyond the range of a double")
    if value.is_integer() and abs(value) < _INTEGRAL_BELOW:
        return int(value)
    return value


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float):
        return float_hook(repr(value)) if math.isfinite(value) else value
    if isinstance(value, dict):
        return {k: _integral_floats_as_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral_floats_as_ints(v) for v in value]
    return value


def canonical_json(value: Any, *, floats_normalized: bool = False) -> bytes:
    """Canonical UTF-8 JSON bytes of a decoded JSON value.

    `floats_normalized` says the value was decoded with `float_hook`, which already did the
    one rewrite canonicalization needs.
    """
    if not floats_normalized:
        value = _integral_floats_as_ints(value)
    return _encode_sorted(value)


def request_hash(
    billing_account_id: str,
    semantic_kind: str,
    event_type: str,
    occurred_at: str,
    subject_ref: str | None,
    payload: dict[str, Any] | None = None,
    *,
    payload_json: bytes | None = None,
) -> str:
    """base64url (unpadded) sha256 of the canonical facts of one event; labels are not facts.

    Pass `payload_json` (the payload's canonical JSON) when it is at hand: the facts object is
    then assembled around it, in sorted key order, without encoding the payload again.
    """
    if payload_json is None:
        payload_json = canonical_json(payload or {})
    enc = _encode_sorted
    facts = b"".join((
        b'{"billing_account_id":', enc(billing_account_id),
        b',"event_type":', enc(event_type),
        b',"occurred_at":', enc(occurred_at),
        b',"payload":', payload_json,
        b',"semantic_kind":', enc(semantic_kind),
        b',"subject_ref":', enc(subject_ref),
        b"}",
    ))
    digest = hashlib.sha256(facts).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def event_id(realm: str, billing_account_id: str, request_hash_: str) -> str:
    """A UUID (version 8, RFC 9562) derived from the dedupe identity, so replays share it.

    >>> import uuid; u = uuid.UUID(event_id("acme", "acct", "h")); (u.version, u.variant)
    (8, 'specified in RFC 4122')
    """
    digest = hashlib.sha256(
        b"\x00".join((realm.encode(), billing_account_id.encode(), request_hash_.encode()))
    ).digest()
    h = digest[:16].hex()
    # version 8 in the 13th hex digit, variant 10xx in the 17th
    return (f"{h[:8]}-{h[8:12]}-8{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}")
