"""The ops the HTTP process sends to the writer process, and their outcomes: the protocol
between the two (msgspec, array-like, tagged).

`IngestOp` stores events; the gate's ops authorize, commit and cancel leases. An outcome
of a gate op is what the endpoint answers: a status with data and hints, or an error. The
writer returns outcomes rather than raising, because an outcome may be stored under an
Idempotency-Key and replayed later exactly.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from warehouse.outbox import EventRecord, Stored

__all__ = [
    "BULK_OPS",
    "COMMIT_FIELDS_KEPT",
    "OPS",
    "RESULT_TYPES",
    "AuthorizeOp",
    "CancelOp",
    "CommitBatchOp",
    "CommitOp",
    "GateOutcome",
    "IdemKey",
    "IngestOp",
    "MeterLine",
    "QuotaUse",
    "RecordOutcomeOp",
    "Standing",
    "StandingOp",
    "UsageOp",
    "commit_body_kept",
]


# What a commit keeps of its body to tell a replay from another body (the lease holds it for
# 7 days after it ends, the `commits` row for good): the fields a commit decides on. Unknown
# fields are dropped before the comparison, so they neither cost memory nor make a body
# "another" one. `lease` counts only when `lease_token` is absent, as the commit reads it.
COMMIT_FIELDS_KEPT = ("lease_token", "feature_code", "quantity_minor", "meters", "labels")

_sorted_json = msgspec.json.Encoder(order="sorted").encode


def commit_body_kept(body: dict[str, Any]) -> bytes:
    """The canonical JSON (keys sorted) of the fields of a commit's body that are kept.

    >>> commit_body_kept({"quantity_minor": "3", "lease_token": "tgl_x", "note": "n" * 9999})
    b'{"lease_token":"tgl_x","quantity_minor":"3"}'
    >>> commit_body_kept({"lease": "tgl_x", "feature_code": "f"})
    b'{"feature_code":"f","lease":"tgl_x"}'
    """
    kept = {name: body[name] for name in COMMIT_FIELDS_KEPT if name in body}
    if "lease_token" not in body and "lease" in body:
        kept["lease"] = body["lease"]
    return _sorted_json(kept)


class IdemKey(msgspec.Struct, array_like=True, frozen=True):
    """Idempotency scope (realm, principal, endpoint, key) and the sha256 of the raw body."""

    realm: str
    principal_id: str
    endpoint: str
    key: str
    body_sha256: str


class GateOutcome(msgspec.Struct, array_like=True):
    status: int
    data: dict[str, Any] | None = None
    code: str = "OK"
    message: str = ""
    errors: list[dict[str, Any]] = []
    hints: list[dict[str, Any]] = []
    headers: dict[str, str] = {}
    replayed: bool = False

    @property
    def storable(self) -> bool:
        """Stored under an Idempotency-Key: 2xx, 402, 409 lease conflicts and 422."""
        if 200 <= self.status < 300 or self.status in (402, 422):
            return True
        return self.status == 409 and self.code.startswith("LEASE.")


class MeterLine(msgspec.Struct, array_like=True, frozen=True):
    meter_code: str
    quantity_minor: int


class AuthorizeOp(msgspec.Struct, tag="authorize", array_like=True, frozen=True):
    result_type: ClassVar[Any] = GateOutcome
    realm: str
    principal_id: str
    billing_account_id: str
    user_id: str | None
    feature_code: str
    estimated_quantity_minor: int
    labels: dict[str, str]
    idem: IdemKey | None
    at_least_a_block: bool = False  # no estimate sent: hold the price of one block


class CommitOp(msgspec.Struct, tag="commit", array_like=True, frozen=True):
    result_type: ClassVar[Any] = GateOutcome
    realm: str
    principal_id: str
    billing_account_id: str
    lease_token: str
    feature_code: str
    quantity_minor: int
    meters: list[MeterLine] | None
    labels: dict[str, str]
    body_canonical: bytes  # `commit_body_kept`: "the same body" is byte equality here
    idem: IdemKey | None


class CancelOp(msgspec.Struct, tag="cancel", array_like=True, frozen=True):
    result_type: ClassVar[Any] = GateOutcome
    realm: str
    principal_id: str
    lease_token: str
    reason: str | None
    idem: IdemKey | None


class RecordOutcomeOp(msgspec.Struct, tag="record_outcome", array_like=True, frozen=True):
    """An outcome decided in the service (a 422 on validation) that an Idempotency-Key must
    remember; the writer answers with an earlier record of the key if there is one."""

    result_type: ClassVar[Any] = GateOutcome
    idem: IdemKey
    outcome: GateOutcome


class IngestOp(msgspec.Struct, tag="ingest", array_like=True, frozen=True):
    """Store these events of one realm; the outcome is one `Stored` per event, in order."""

    result_type: ClassVar[Any] = list[Stored]
    realm: str
    path: str  # single | batch
    events: list[EventRecord]


class CommitBatchOp(msgspec.Struct, tag="commit_batch", array_like=True, frozen=True):
    """Several commits in one call (POST /gate/commits/batch). Each item carries its own
    idempotency scope; `idem` is the whole batch's Idempotency-Key. The outcome's data holds
    one outcome per item, in order, under "items"."""

    result_type: ClassVar[Any] = GateOutcome
    items: list[CommitOp]
    idem: IdemKey | None


class UsageOp(msgspec.Struct, tag="usage", array_like=True, frozen=True):
    """Usage that ran without a lease (POST /gate/ingest): priced at `occurred_at` and
    booked like a commit, without any limit check (the work has already happened)."""

    result_type: ClassVar[Any] = GateOutcome
    realm: str
    principal_id: str
    billing_account_id: str
    feature_code: str
    quantity_minor: int
    meters: list[MeterLine] | None
    labels: dict[str, str]
    occurred_at: str  # RFC 3339, UTC
    body_canonical: bytes
    idem: IdemKey | None


class QuotaUse(msgspec.Struct, array_like=True, frozen=True):
    """A quota's window now: what commits used and what active leases hold."""

    quota_id: str
    used_minor: int
    held_minor: int


class Standing(msgspec.Struct, array_like=True, frozen=True):
    """An account's money and a principal's quotas as the gate book has them now."""

    grants: list[tuple[str, int, str]]  # (grant id, amount xusd, effective_at) recorded
    committed_xusd: int
    held_xusd: int
    quotas: list[QuotaUse]
    as_of: str


class StandingOp(msgspec.Struct, tag="standing", array_like=True, frozen=True):
    """Read the standing of an account (and, when given, the principal's quotas): the
    balance and limit endpoints. Answered in queue order, so a read sees every write that
    was answered before it was sent."""

    result_type: ClassVar[Any] = Standing
    realm: str
    billing_account_id: str
    principal_id: str | None


# The ops of the ingest lane: the writer commits them in groups of their own, after the gate's
# waiting ops (`warehouse.writer.run_writer`); every other op is the gate's.
BULK_OPS: tuple[type, ...] = (IngestOp,)
OPS = IngestOp | AuthorizeOp | CommitOp | CancelOp | RecordOutcomeOp | CommitBatchOp | UsageOp | StandingOp
# What each op's outcome decodes as, on the HTTP process's side of the socket.
RESULT_TYPES: dict[type, Any] = {op: op.result_type for op in OPS.__args__}
