"""SVC-AUTH: verifying (and, for our own CLI and tests, producing) signed requests.

    Authorization: SVC-AUTH keyId=<id>,sig=<b64>,ts=<iso8601>,nonce=<str>,alg=HMAC-SHA256

`sig` is base64 HMAC-SHA256, keyed by the base64-decoded secret, over twelve lines: method,
path with query as received, ts, nonce, content-digest, content-type, x-realm-id,
x-principal-id, x-user-id, x-billing-account-id, x-billing-user-id, idempotency-key. The
Content-Digest header must match the body. `ts` must lie within the skew window of the server
clock and a nonce is accepted once within it, across restarts and HTTP workers too: the one
place that decides (`api.shared.StateBook`) appends every accepted nonce to the data folder's
nonce log (`NonceLog`) before the request is answered, and loads the log's nonces still in
force at start. Checks run so that nothing about a key is
told to a caller who has not proved they hold its secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import msgspec

from api.errors import BadRequest, Forbidden, Unauthorized
from core.clock import SYSTEM_CLOCK, Clock
from warehouse.keys import ServiceKey

__all__ = ["AuthContext", "Authenticator", "NonceLog", "SignedHead", "content_digest", "replayed",
           "sign_headers"]

log = logging.getLogger("tollgate.auth")

_AUTH = re.compile(
    r"SVC-AUTH keyId=([^,\s]+),sig=([A-Za-z0-9+/=]+),ts=([^,\s]+),nonce=([^,\s]+),alg=HMAC-SHA256"
)
_SIGNED = (
    "x-realm-id", "x-principal-id", "x-user-id", "x-billing-account-id", "x-billing-user-id",
    "idempotency-key",
)


@dataclass(frozen=True, slots=True)
class AuthContext:
    key_id: str
    realm: str
    principal_id: str | None
    billing_account_id: str | None
    user_id: str | None
    idempotency_key: str | None


def content_digest(body: bytes) -> str:
    return "sha-256=:" + binascii.b2a_base64(hashlib.sha256(body).digest(), newline=False).decode() + ":"


def _canonical(method: str, path: str, ts: str, nonce: str, headers: dict[str, str]) -> bytes:
    lines = [
        method.upper(),
        path,
        f"ts:{ts}",
        f"nonce:{nonce}",
        f"content-digest:{headers.get('content-digest', '')}",
        f"content-type:{headers.get('content-type', '')}",
    ]
    lines.extend(f"{name}:{headers.get(name, '')}" for name in _SIGNED)
    return "\n".join(lines).encode()


def sign_headers(
    *, key_id: str, secret: str, method: str, path: str, body: bytes, realm: str,
    principal_id: str | None = None, billing_account_id: str | None = None,
    user_id: str | None = None, idempotency_key: str | None = None,
    ts: str | None = None, nonce: str | None = None,
    content_type: str = "application/json",
) -> dict[str, str]:
    """Headers of a signed request (what the official client sends), for our CLI and tests."""
    headers = {"content-type": content_type, "content-digest": content_digest(body), "x-realm-id": realm}
    for name, value in (("x-principal-id", principal_id), ("x-billing-account-id", billing_account_id),
                        ("x-user-id", user_id), ("idempotency-key", idempotency_key)):
        if value is not None:
            headers[name] = value
    ts = ts or SYSTEM_CLOCK.now().isoformat()
    nonce = nonce or secrets.token_hex(16)
    mac = hmac.digest(base64.b64decode(secret), _canonical(method, path, ts, nonce, headers), "sha256")
    sig = binascii.b2a_base64(mac, newline=False).decode()
    headers["authorization"] = f"SVC-AUTH keyId={key_id},sig={sig},ts={ts},nonce={nonce},alg=HMAC-SHA256"
    return headers


class _NonceWindow:
    """Nonces seen within the skew window, forgotten in arrival order once they age out."""

    def __init__(self, ttl_seconds: float) -> None:
        self.ttl = ttl_seconds
        self._seen: set[tuple[str, str]] = set()
        self._order: deque[tuple[float, tuple[str, str]]] = deque()

    def first_use(self, key_id: str, nonce: str) -> bool:
        now = time.monotonic()
        while self._order and self._order[0][0] <= now:
            self._seen.discard(self._order.popleft()[1])
        entry = (key_id, nonce)
        if entry in self._seen:
            return False
        self._seen.add(entry)
        self._order.append((now + self.ttl, entry))
        return True

    def seen(self, key_id: str, nonce: str) -> bool:
        """Whether the nonce is in force now, without recording it."""
        now = time.monotonic()
        while self._order and self._order[0][0] <= now:
            self._seen.discard(self._order.popleft()[1])
        return (key_id, nonce) in self._seen

    def preload(self, entries: list[tuple[float, str, str]]) -> None:
        """Nonces of an earlier process, (seconds left, key id, nonce): refused until then.
        Called before any request, so the order stays by expiry (a new nonce's `ttl` is
        never shorter than what a loaded one has left)."""
        now = time.monotonic()
        for left, key_id, nonce in sorted(entries):
            entry = (key_id, nonce)
            if entry not in self._seen:
                self._seen.add(entry)
                self._order.append((now + left, entry))


class NonceLog:
    """Accepted nonces on disk, so a restarted service still refuses them while their `ts`
    could pass the skew check.

    One line per nonce, `<expiry, epoch seconds>\t<key id>\t<nonce>\n`, appended with one
    `write` to a segment file per `span` seconds of expiry (`<folder>/<n>.log`, mode 0600),
    before the request is answered. The write reaches the kernel at once, so a killed or
    restarted process loses none; `sync()` (every second, in a thread) makes them survive a
    power loss too, without a sync on the request's path. A segment whose every nonce has
    expired is deleted, so the folder holds at most the nonces of the last two skew windows.
    """

    def __init__(self, folder: Path, span_seconds: int) -> None:
        self.folder = folder
        self.span = max(1, span_seconds)
        self._fds: dict[int, int] = {}
        self._dirty: set[int] = set()
        self._failed = False

    def load(self, now: float) -> list[tuple[float, str, str]]:
        """The nonces not yet expired at `now` (epoch seconds), as (seconds left, key id,
        nonce); expired segments are deleted. A torn last line is skipped."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        found: list[tuple[float, str, str]] = []
        for path in sorted(self.folder.glob("*.log")):
            bucket = _bucket_of(path)
            if bucket is None:
                continue
            if (bucket + 1) * self.span <= now:
                path.unlink(missing_ok=True)
                continue
            for line in path.read_bytes().split(b"\n"):
                parts = line.split(b"\t")
                if len(parts) != 3:
                    continue
                try:
                    expiry = int(parts[0])
                except ValueError:
                    continue
                if expiry > now:
                    found.append((expiry - now, parts[1].decode(errors="replace"),
                                  parts[2].decode(errors="replace")))
        return found

    def append(self, key_id: str, nonce: str, expiry: int) -> None:
        bucket = expiry // self.span
        fd = self._fds.get(bucket)
        try:
            if fd is None:
                fd = self._fds[bucket] = os.open(self.folder / f"{bucket}.log",
                                                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, f"{expiry}\t{key_id}\t{nonce}\n".encode())
        except OSError:
            # The nonce is still refused by this process; only a restart could forget it.
            if not self._failed:
                log.exception("could not record a nonce in %s", self.folder)
            self._failed = True
            return
        self._failed = False
        self._dirty.add(bucket)

    def sync(self, now: float) -> None:
        """Sync what was appended since the last call; close and delete expired segments."""
        dirty, self._dirty = self._dirty, set()
        for bucket in dirty:
            fd = self._fds.get(bucket)
            if fd is not None:
                try:
                    os.fdatasync(fd)
                except OSError:
                    log.exception("could not sync the nonce log")
        for bucket in [b for b in list(self._fds) if (b + 1) * self.span <= now]:
            os.close(self._fds.pop(bucket))
        for path in self.folder.glob("*.log"):
            old = _bucket_of(path)
            if old is not None and (old + 1) * self.span <= now and old not in self._fds:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.fdatasync(fd)
            except OSError:
                pass
            os.close(fd)
        self._fds.clear()


def _bucket_of(path: Path) -> int | None:
    try:
        return int(path.stem)
    except ValueError:
        return None


def replayed() -> Unauthorized:
    return Unauthorized("AUTH.REPLAYED_NONCE", "this nonce was already used")


@dataclass(slots=True)
class SignedHead:
    """A request whose head passed the signature and `ts` checks (`check`, `check_head`); its
    nonce is decided next, then `accept`."""

    key: ServiceKey
    key_id: str
    nonce: str
    signed_at: datetime
    realm: str


class Authenticator:
    def __init__(self, skew_seconds: int, clock: Clock = SYSTEM_CLOCK, *, max_nonce_chars: int = 128,
                 max_idempotency_key_chars: int = 255) -> None:
        self.skew = skew_seconds
        self.clock = clock
        self.max_nonce_chars = max_nonce_chars
        self.max_idempotency_key_chars = max_idempotency_key_chars
        self.keys: dict[str, ServiceKey] = {}
        self._secrets: dict[str, bytes] = {}  # decoded secrets, by the key's base64 text
        # `verify`'s own nonces (the service's are decided in `api.shared`).
        self._nonces = _NonceWindow(2 * skew_seconds + 1)

    def verify(self, method: str, path: str, headers: dict[str, str], body: bytes) -> AuthContext:
        """Every check of a request whose body is read, in the documented order: realm header,
        header format, key id, Content-Digest, signature, `ts`, nonce, key disabled, key's
        realm; the nonce in this object's own window (the service asks `api.shared`, which
        decides for every worker: `check`, then `accept`)."""
        head = self.check(method, path, headers, body)
        if not self._nonces.first_use(head.key_id, head.nonce):
            raise replayed()
        return self.accept(head, headers)

    def check(self, method: str, path: str, headers: dict[str, str], body: bytes) -> SignedHead:
        """The checks before the nonce of a request whose body is read."""
        realm, key_id, sig, ts, nonce, key = self._parse(headers)
        self._check_digest(headers, body)
        signed_at = self._check_signature(key, method, path, sig, ts, nonce, headers)
        return SignedHead(key, key_id, nonce, signed_at, realm)

    def check_head(self, method: str, path: str, headers: dict[str, str]) -> SignedHead:
        """The checks that need no body, for a body too large to read before the caller has
        proved they hold the key's secret: the signature covers the declared Content-Digest,
        so a request nobody signed is refused before its body is read. The caller refuses a
        nonce already used here too, but consumes none: it does that once the body matches
        (`check_body`)."""
        realm, key_id, sig, ts, nonce, key = self._parse(headers)
        signed_at = self._check_signature(key, method, path, sig, ts, nonce, headers)
        return SignedHead(key, key_id, nonce, signed_at, realm)

    def check_body(self, head: SignedHead, headers: dict[str, str], body: bytes) -> None:
        """The body of a `check_head` request, once it has arrived, against its digest."""
        self._check_digest(headers, body)

    def _parse(self, headers: dict[str, str]) -> tuple[str, str, str, str, str, ServiceKey]:
        realm = headers.get("x-realm-id")
        if not realm:
            raise BadRequest("AUTH.MISSING_REALM", "the X-Realm-Id header is required")
        match = _AUTH.fullmatch(headers.get("authorization", ""))
        if match is None:
            raise Unauthorized("AUTH.UNAUTHORIZED",
                               "Authorization must be 'SVC-AUTH keyId=..,sig=..,ts=..,nonce=..,alg=HMAC-SHA256'")
        key_id, sig, ts, nonce = match.groups()
        if len(nonce) > self.max_nonce_chars:
            raise BadRequest("AUTH.NONCE_TOO_LONG",
                             f"the nonce is longer than {self.max_nonce_chars} characters")
        idem = headers.get("idempotency-key")
        if idem is not None and len(idem) > self.max_idempotency_key_chars:
            raise BadRequest("IDEMPOTENCY.KEY_TOO_LONG",
                             f"Idempotency-Key is longer than {self.max_idempotency_key_chars} characters")
        key = self.keys.get(key_id)
        if key is None:
            raise Unauthorized("AUTH.SERVICE_KEY_NOT_FOUND", "unknown service key")
        return realm, key_id, sig, ts, nonce, key

    @staticmethod
    def _check_digest(headers: dict[str, str], body: bytes) -> None:
        if not hmac.compare_digest(headers.get("content-digest", "").encode(), content_digest(body).encode()):
            raise Unauthorized("AUTH.INVALID_SERVICE_SIGNATURE", "Content-Digest does not match the body")

    def _check_signature(self, key: ServiceKey, method: str, path: str, sig: str, ts: str, nonce: str,
                         headers: dict[str, str]) -> datetime:
        """The HMAC over the head (the declared Content-Digest included), then `ts`."""
        secret = self._secrets.get(key.secret)
        if secret is None:
            if len(self._secrets) > 1024:
                self._secrets.clear()
            secret = self._secrets[key.secret] = key.secret_bytes
        expected = hmac.digest(secret, _canonical(method, path, ts, nonce, headers), "sha256")
        try:
            given = binascii.a2b_base64(sig, strict_mode=True)
        except binascii.Error:
            given = b""
        if not hmac.compare_digest(given, expected):
            raise Unauthorized("AUTH.INVALID_SERVICE_SIGNATURE", "signature does not match")
        try:
            signed_at = msgspec.convert(ts, datetime)
        except msgspec.ValidationError:
            signed_at = None
        if signed_at is None or signed_at.tzinfo is None:
            raise Unauthorized("AUTH.STALE_SIGNATURE", "ts is not an ISO 8601 time with an offset")
        if abs((self.clock.now() - signed_at).total_seconds()) > self.skew:
            raise Unauthorized("AUTH.STALE_SIGNATURE",
                               f"ts is more than {self.skew} s away from the server clock")
        return signed_at

    def accept(self, head: SignedHead, headers: dict[str, str]) -> AuthContext:
        """After the nonce: the key's state, then the context of the call."""
        key = head.key
        if key.disabled:
            raise Forbidden("AUTH.SERVICE_KEY_DISABLED", "this service key is disabled")
        if key.realm != head.realm:
            raise Forbidden("AUTH.SERVICE_KEY_REALM_FORBIDDEN", "this service key belongs to another realm")
        return AuthContext(
            key_id=head.key_id,
            realm=head.realm,
            principal_id=headers.get("x-principal-id") or None,
            billing_account_id=headers.get("x-billing-account-id") or None,
            user_id=headers.get("x-user-id") or None,
            idempotency_key=headers.get("idempotency-key") or None,
        )
