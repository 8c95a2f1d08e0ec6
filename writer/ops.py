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
    "OPS",
    "RESULT_TYPES",
    "AuthorizeOp",
    "CancelOp",
    "CommitOp",
    "GateOutcome",
    "IdemKey",
    "IngestOp",
    "MeterLine",
    "RecordOutcomeOp",
]


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
    body_canonical: bytes  # the body as canonical JSON: "equal as JSON" is byte equality here
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


OPS = IngestOp | AuthorizeOp | CommitOp | CancelOp | RecordOutcomeOp
# What each op's outcome decodes as, on the HTTP process's side of the socket.
RESULT_TYPES: dict[type, Any] = {op: op.result_type for op in OPS.__args__}
