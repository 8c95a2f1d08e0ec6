"""The application's errors. Each carries its HTTP status and wire code; one handler in
`api.envelope` turns any of them into the error envelope.

    AppError                      (status, code, message, errors[], hints[], headers)
    ├── BadRequest          400   VALIDATION.MALFORMED_JSON, VALIDATION.MISSING_CONTEXT, AUTH.MISSING_REALM,
    │                             AUTH.NONCE_TOO_LONG, IDEMPOTENCY.KEY_TOO_LONG
    ├── Unauthorized        401   AUTH.UNAUTHORIZED, AUTH.SERVICE_KEY_NOT_FOUND, AUTH.INVALID_SERVICE_SIGNATURE,
    │                             AUTH.STALE_SIGNATURE, AUTH.REPLAYED_NONCE
    ├── PaymentRequired     402   QUOTA.EXHAUSTED, BUDGET.EXHAUSTED, FUNDING.INSUFFICIENT
    ├── Forbidden           403   AUTH.SERVICE_KEY_DISABLED, AUTH.SERVICE_KEY_REALM_FORBIDDEN,
    │                             AUTH.BILLING_ACCOUNT_MISMATCH
    ├── Conflict            409   IDEMPOTENCY.*, LEASE.ALREADY_COMMITTED, LEASE.CANCELLED
    ├── PayloadTooLarge     413   VALIDATION.BODY_TOO_LARGE
    ├── Unprocessable       422   VALIDATION.INVALID_INPUT, VALIDATION.BATCH_TOO_LARGE, RESOURCE.NOT_FOUND,
    │                             LEASE.*, FEATURE.METER_NOT_ALLOWED
    ├── RateLimited         429   LIMIT.RATE_EXCEEDED
    └── ServiceUnavailable  503   STORAGE.UNAVAILABLE, STORAGE.BUSY, SERVICE.BUSY
    (`AppError.of_status`: 408 REQUEST.TIMEOUT and 431 REQUEST.HEADERS_TOO_LARGE, answered by
    `api.http_protocol`)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AppError",
    "BadRequest",
    "Conflict",
    "Forbidden",
    "PayloadTooLarge",
    "PaymentRequired",
    "RateLimited",
    "ServiceUnavailable",
    "Unauthorized",
    "Unprocessable",
]


class AppError(Exception):
    status = 500

    def __init__(
        self,
        code: str,
        message: str,
        *,
        errors: list[dict[str, Any]] | None = None,
        hints: list[dict[str, Any]] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.errors = errors or []
        self.hints = hints or []
        self.headers = headers or {}

    def to_wire(self) -> dict[str, Any]:
        """The error as it crosses from the writer process to the service."""
        return {"status": self.status, "code": self.code, "message": self.message,
                "errors": self.errors, "hints": self.hints, "headers": self.headers}

    @staticmethod
    def of_status(status: int, code: str, message: str, *,
                  errors: list[dict[str, Any]] | None = None,
                  hints: list[dict[str, Any]] | None = None,
                  headers: dict[str, str] | None = None) -> AppError:
        """The error of this status (an outcome decided elsewhere, e.g. by the writer)."""
        cls = _BY_STATUS.get(status)
        error = (cls or AppError)(code, message, errors=errors, hints=hints, headers=headers)
        if cls is None:
            error.status = status  # a status with no class of its own keeps its number
        return error

    @staticmethod
    def from_wire(payload: dict[str, Any]) -> AppError:
        return AppError.of_status(int(payload.get("status", 500)),
                                  str(payload.get("code", "INTERNAL.ERROR")),
                                  str(payload.get("message", "")), errors=payload.get("errors"),
                                  hints=payload.get("hints"), headers=payload.get("headers"))


class BadRequest(AppError):
    status = 400


class Unauthorized(AppError):
    status = 401


class PaymentRequired(AppError):
    status = 402


class Forbidden(AppError):
    status = 403


class Conflict(AppError):
    status = 409


class PayloadTooLarge(AppError):
    status = 413


class Unprocessable(AppError):
    status = 422


class RateLimited(AppError):
    status = 429


class ServiceUnavailable(AppError):
    status = 503


_BY_STATUS: dict[int, type[AppError]] = {
    cls.status: cls
    for cls in (BadRequest, Unauthorized, PaymentRequired, Forbidden, Conflict, PayloadTooLarge,
                Unprocessable, RateLimited, ServiceUnavailable)
}
