"""The limits held before and around authentication (docs/api.md, "Limits"): each limit's
answer, and hostile clients in bounded numbers and time while a signed gate call still answers
quickly and the HTTP process's memory stays bounded."""

from __future__ import annotations

import json
import resource
import selectors
import signal
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.auth import content_digest, sign_headers
from tests.conftest import Service, make_service, processes_of

pytestmark = pytest.mark.server

HEADER_TIMEOUT = 2.0
REQUEST_TIMEOUT = 4.0
MAX_CONNECTIONS = 2100
MAX_BODY = 2 * 1024 * 1024
LIMITS = {
    "TOLLGATE_SCHEDULES": "off",
    "TOLLGATE_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT),
    "TOLLGATE_REQUEST_TIMEOUT_SECONDS": str(REQUEST_TIMEOUT),
    "TOLLGATE_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    "TOLLGATE_MAX_BODY_BYTES": str(MAX_BODY),
}
AUTHORIZE = "/mgt/v1/gate/authorize"
EVENTS = "/mgt/v1/events"


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = make_service(tmp_path_factory.mktemp("limits"))
    svc.env = dict(LIMITS)
    svc.start()
    yield svc
    svc.stop()


# ---- helpers ------------------------------------------------------------------------------

def _answer(data: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body) if body else {}


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _exchange(port: int, data: bytes, timeout: float = 10) -> tuple[int, dict[str, str], dict[str, Any], float]:
    """Send `data`, read until the service closes: the answer and how long it took."""
    began = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        if data:
            s.sendall(data)
        got = _read_all(s, timeout)
    status, headers, body = _answer(got)
    return status, headers, body, time.monotonic() - began


def _refusal(body: dict[str, Any], status: int, code: str) -> None:
    assert body["ok"] is False and body["code"] == code, body
    assert body["meta"] == {"status": status} and body["trace_id"]


def _signed_head(svc: Service, path: str, body: bytes, *, length: int | None = None,
                 **kw: Any) -> bytes:
    headers = sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method="POST", path=path,
                           body=body, realm="acme", **kw)
    headers["content-length"] = str(len(body) if length is None else length)
    lines = [f"POST {path} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _unsigned_head(svc: Service, path: str, length: int) -> bytes:
    """A head that names a real key but whose signature nobody computed."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"X-Realm-Id: acme\r\nX-Principal-Id: gate-p\r\n"
            f"Content-Digest: {content_digest(b'x')}\r\nContent-Length: {length}\r\n"
            f"Authorization: SVC-AUTH keyId={svc.key.key_id},sig=AAAA,ts={now},"
            f"nonce=n{time.monotonic_ns()},alg=HMAC-SHA256\r\n\r\n").encode()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _http_rss_kib(svc: Service) -> int:
    """The resident memory of the service's HTTP workers, together."""
    return sum(_rss_kib(pid) for pid in processes_of(svc.data_dir, "api.worker"))


def _gate_call_ms(svc: Service, client: httpx.Client) -> float:
    body = json.dumps({"feature_code": "gate.unit", "estimated_quantity_minor": "1"}).encode()
    headers = sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method="POST",
                           path=AUTHORIZE, body=body, realm="acme", principal_id="gate-p")
    began = time.perf_counter()
    r = client.post(svc.base_url + AUTHORIZE, content=body, headers=headers)
    took = (time.perf_counter() - began) * 1000
    assert r.status_code == 200, r.text
    return took


def _gate_calls_ms(svc: Service, count: int = 5) -> list[float]:
    """Signed authorizes, each on a new connection (so the connection cap and the accept
    queue are part of what is measured)."""
    took = []
    for _ in range(count):
        with httpx.Client(timeout=10) as client:
            took.append(_gate_call_ms(svc, client))
    return took


# ---- each limit's answer ------------------------------------------------------------------

def test_a_head_past_the_byte_limit_is_431_and_closed(limited: Service) -> None:
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n"
    status, headers, body, took = _exchange(limited.port, head)
    assert status == 431 and headers["connection"] == "close" and took < 3
    _refusal(body, 431, "REQUEST.HEADERS_TOO_LARGE")
    assert headers["x-request-id"] == body["trace_id"]


def test_more_headers_than_allowed_is_431(limited: Service) -> None:
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(101))
    status, _, body, _ = _exchange(limited.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
    assert status == 431
    _refusal(body, 431, "REQUEST.HEADERS_TOO_LARGE")
    # 100 lines pass: Connection and 99 more
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(99))
    status, *_ = _exchange(limited.port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n" + lines + b"\r\n")
    assert status == 200


def test_a_connection_that_sends_nothing_or_half_a_head_gets_408(limited: Service) -> None:
    for sent in (b"", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):
        status, headers, body, took = _exchange(limited.port, sent)
        assert status == 408 and headers["connection"] == "close"
        _refusal(body, 408, "REQUEST.TIMEOUT")
        assert HEADER_TIMEOUT - 0.2 < took < HEADER_TIMEOUT + 2


def test_a_body_that_stalls_gets_408_within_the_request_timeout(limited: Service) -> None:
    payload = json.dumps({"feature_code": "gate.unit", "estimated_quantity_minor": "1"}).encode()
    head = _signed_head(limited, AUTHORIZE, payload, principal_id="gate-p")
    status, _, body, took = _exchange(limited.port, head + payload[:5])
    assert status == 408
    _refusal(body, 408, "REQUEST.TIMEOUT")
    assert REQUEST_TIMEOUT - 0.2 < took < REQUEST_TIMEOUT + 2


def test_a_large_body_without_a_valid_signature_is_refused_before_it_is_read(limited: Service) -> None:
    # Declares 1 MiB (past the 64 KiB read before the signature) and sends none of it.
    status, headers, body, took = _exchange(limited.port, _unsigned_head(limited, AUTHORIZE, 1024 * 1024))
    assert status == 401 and headers["connection"] == "close" and took < 2
    _refusal(body, 401, "AUTH.INVALID_SERVICE_SIGNATURE")
    # A declared length past the body limit: 413 before the signature.
    status, _, body, _ = _exchange(limited.port, _unsigned_head(limited, AUTHORIZE, MAX_BODY + 1))
    assert status == 413
    _refusal(body, 413, "VALIDATION.BODY_TOO_LARGE")
    assert body["message"] == "request body is larger than 2 MiB"


def test_a_large_signed_body_is_read_after_its_head_and_its_nonce_is_used_only_once_it_matches(
        limited: Service) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    event = {"semantic_kind": "activity", "event_type": "big.one", "occurred_at": now,
             "payload": {"blob": "x" * 200_000}}
    raw = json.dumps(event).encode()
    nonce = f"large-{time.monotonic_ns()}"
    kw: dict[str, Any] = {"billing_account_id": "acct_prepaid", "nonce": nonce}
    # The head is signed for `raw`, but another body of the same length arrives: refused, and
    # the nonce is still unused.
    other = raw.replace(b"x" * 10, b"y" * 10, 1)
    status, _, body, _ = _exchange(limited.port, _signed_head(limited, EVENTS, raw, **kw) + other)
    assert status == 401
    _refusal(body, 401, "AUTH.INVALID_SERVICE_SIGNATURE")
    r = limited.post(EVENTS, raw=raw, account="acct_prepaid", nonce=nonce)
    assert r.status_code == 201, r.text
    # The same head again: refused as a replay, from the head alone.
    status, _, body, _ = _exchange(limited.port, _signed_head(limited, EVENTS, raw, **kw))
    assert status == 401
    _refusal(body, 401, "AUTH.REPLAYED_NONCE")


def test_a_chunked_body_is_authenticated_from_its_head_then_read(limited: Service) -> None:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    raw = json.dumps({"semantic_kind": "activity", "event_type": "chunked.one", "occurred_at": now,
                      "payload": {"n": time.monotonic_ns()}}).encode()
    headers = sign_headers(key_id=limited.key.key_id, secret=limited.key.secret, method="POST",
                           path=EVENTS, body=raw, realm="acme", billing_account_id="acct_prepaid")
    r = limited.client.post(limited.base_url + EVENTS, headers=headers,
                            content=iter([raw[:10], raw[10:]]))
    assert r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 201, r.text


def test_nonce_and_idempotency_key_lengths(limited: Service) -> None:
    body = {"feature_code": "gate.unit", "estimated_quantity_minor": "1"}
    r = limited.post(AUTHORIZE, body, principal="gate-p", nonce="n" * 129)
    assert r.status_code == 400
    _refusal(r.json(), 400, "AUTH.NONCE_TOO_LONG")
    r = limited.post(AUTHORIZE, body, principal="gate-p", idempotency_key="k" * 256)
    assert r.status_code == 400
    _refusal(r.json(), 400, "IDEMPOTENCY.KEY_TOO_LONG")
    assert limited.post(AUTHORIZE, body, principal="gate-p", nonce="n" * 128,
                        idempotency_key="k" * 255).status_code == 200


def test_a_commit_keeps_only_the_fields_it_compares(limited: Service) -> None:
    auth = limited.post(AUTHORIZE, {"feature_code": "gate.unit", "estimated_quantity_minor": "5"},
                        principal="gate-p").json()["data"]
    commit = {"lease_token": auth["lease_token"], "feature_code": "gate.unit", "quantity_minor": "4"}
    first = limited.post("/mgt/v1/gate/commits", {**commit, "note": "n" * 100_000}, principal="gate-p")
    assert first.status_code == 200, first.text
    # Unknown fields are not part of "the same body": without them, the first answer again.
    again = limited.post("/mgt/v1/gate/commits", commit, principal="gate-p")
    assert again.status_code == 200 and again.json()["data"] == first.json()["data"]
    other = limited.post("/mgt/v1/gate/commits", {**commit, "quantity_minor": "3"}, principal="gate-p")
    assert other.status_code == 409 and other.json()["code"] == "LEASE.ALREADY_COMMITTED"


# ---- hostile clients ----------------------------------------------------------------------

def test_hostile_clients_leave_gate_calls_fast_and_memory_bounded(limited: Service) -> None:
    assert limited.proc is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 3000:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    keep = httpx.Client(timeout=10)   # a client connected before the flood
    for _ in range(3):
        _gate_call_ms(limited, keep)
    base_rss = _http_rss_kib(limited)
    medians: dict[str, float] = {}

    # 1. 2,000 idle connections, then 200 more: past the cap, 503 SERVICE.BUSY at once.
    began = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", limited.port), timeout=5) for _ in range(2000)]
    took = _gate_calls_ms(limited) + [_gate_call_ms(limited, keep) for _ in range(3)]
    medians["idle"] = statistics.median(took)
    extra = [socket.create_connection(("127.0.0.1", limited.port), timeout=5) for _ in range(200)]
    busy = 0
    refused = selectors.DefaultSelector()
    for s in extra:
        refused.register(s, selectors.EVENT_READ)
    wait_until = time.monotonic() + 1.0    # well within the head timeout
    while time.monotonic() < wait_until:
        for key, _ in refused.select(timeout=0.1):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            status, headers, body = _answer(_read_all(sock, 1))
            assert status == 503 and headers["retry-after"] == "1", (status, body)
            _refusal(body, 503, "SERVICE.BUSY")
            busy += 1
            refused.unregister(sock)
    for s in extra:
        s.close()
    assert busy >= 50, busy
    # Every idle connection is answered 408 and closed once the head timeout has passed.
    selector = selectors.DefaultSelector()
    for s in idle:
        s.setblocking(False)
        selector.register(s, selectors.EVENT_READ, bytearray())
    open_ = len(idle)
    timed_out = 0
    deadline = began + HEADER_TIMEOUT + 10
    while open_ and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0.5):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if chunk:
                key.data.extend(chunk)
                continue
            if bytes(key.data).startswith(b"HTTP/1.1 408 "):
                timed_out += 1
            selector.unregister(sock)
            sock.close()
            open_ -= 1
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    assert open_ == 0 and timed_out == len(idle), (open_, timed_out)

    # 2. A 100 MB header: refused after 32 KiB, nowhere near 100 MB held.
    sent = 0
    outcome: list[bytes] = []

    def send_big_header() -> None:
        nonlocal sent
        with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as s:
            chunk = b"a" * (1024 * 1024)
            try:
                s.sendall(b"POST /mgt/v1/gate/authorize HTTP/1.1\r\nHost: x\r\nX-Big: ")
                while sent < 100 * 1024 * 1024:
                    s.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            outcome.append(_read_all(s, 2))

    began = time.monotonic()
    sender = threading.Thread(target=send_big_header)
    sender.start()
    took = _gate_calls_ms(limited)
    sender.join(30)
    assert not sender.is_alive()
    assert time.monotonic() - began < 15
    assert sent < 50 * 1024 * 1024, sent  # stopped long before 100 MB
    if outcome[0]:                         # the answer, unless the reset overtook it
        assert outcome[0].startswith(b"HTTP/1.1 431 ")
    medians["big header"] = statistics.median(took)

    # 3. 200 slow uploads without a valid signature: 100 declare a large body (refused from
    # the head, none of it read), 100 declare a small one and trickle it (408 on time).
    began = time.monotonic()
    large = [socket.create_connection(("127.0.0.1", limited.port), timeout=5) for _ in range(100)]
    small = [socket.create_connection(("127.0.0.1", limited.port), timeout=5) for _ in range(100)]
    for s in large:
        s.sendall(_unsigned_head(limited, AUTHORIZE, 1_000_000) + b"{")
    for s in small:
        s.sendall(_unsigned_head(limited, AUTHORIZE, 60_000) + b"{")
    took = _gate_calls_ms(limited)
    for s in small:
        s.sendall(b" " * 10)  # still uploading, slowly
    took += _gate_calls_ms(limited)
    medians["slow uploads"] = statistics.median(took)
    for s in large:
        status, _, body = _answer(_read_all(s, 5))
        assert status == 401
        _refusal(body, 401, "AUTH.INVALID_SERVICE_SIGNATURE")
        s.close()
    assert time.monotonic() - began < 3   # answered from the head, without waiting for a body
    for s in small:
        status, _, body = _answer(_read_all(s, REQUEST_TIMEOUT + 5))
        assert status == 408
        _refusal(body, 408, "REQUEST.TIMEOUT")
        s.close()
    assert time.monotonic() - began < REQUEST_TIMEOUT + 5

    grown = _http_rss_kib(limited) - base_rss
    keep.close()
    print(f"median gate call ms by phase: {medians}; the HTTP process grew by {grown} KiB")
    for phase, median in medians.items():
        assert median < 100, (phase, medians)
    assert grown < 40 * 1024, f"the HTTP process grew by {grown} KiB"


def test_a_stalled_upload_does_not_hold_the_shutdown(limited: Service) -> None:
    """Last in this module: it stops the service."""
    assert limited.proc is not None
    payload = json.dumps({"feature_code": "gate.unit", "estimated_quantity_minor": "1"}).encode()
    with socket.create_connection(("127.0.0.1", limited.port), timeout=10) as s:
        s.sendall(_signed_head(limited, AUTHORIZE, payload, principal_id="gate-p") + payload[:5])
        time.sleep(0.3)
        began = time.monotonic()
        limited.proc.send_signal(signal.SIGTERM)
        status, _, body = _answer(_read_all(s, 10))
        assert status == 503
        _refusal(body, 503, "SERVICE.BUSY")
        assert time.monotonic() - began < REQUEST_TIMEOUT - 1  # not the request timeout's 408
    limited.proc.wait(timeout=20)
