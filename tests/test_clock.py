"""Time is injected (`core.clock`): the parts that read it are tested by moving a
`ManualClock`, not by sleeping."""

from __future__ import annotations

import base64
from datetime import datetime, timezone
from pathlib import Path

import pytest

from api.auth import Authenticator, sign_headers
from api.errors import Unauthorized
from api.gate.limits import RateLimiter
from core.clock import ManualClock
from pipelines.catalog import load_catalog
from warehouse.keys import ServiceKey

FIXTURES = Path(__file__).parent / "fixtures"
NOW = datetime(2026, 11, 1, 12, 0, 0, tzinfo=timezone.utc)


def test_a_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(NOW)
    assert clock.now() == NOW == clock.now()
    clock.advance(1.5)
    assert (clock.now() - NOW).total_seconds() == 1.5
    with pytest.raises(ValueError):
        ManualClock(datetime(2026, 11, 1))  # naive: no offset


def test_a_rate_window_refuses_when_full_and_opens_again_when_time_moves() -> None:
    realm = load_catalog((FIXTURES / "catalog.toml").read_text()).realms["acme"]  # 3 per 2 s
    clock = ManualClock(NOW)
    limiter = RateLimiter()

    def admit() -> object:
        return limiter.admit(realm, "gate.rated", "p", "acct_gate", clock.now())

    assert [admit() for _ in range(3)] == [None, None, None]
    refusal = admit()
    assert refusal is not None and refusal.limit == 3 and refusal.retry_after_seconds == 2
    clock.advance(1.9)
    assert admit() is not None  # the same window
    clock.advance(0.1)
    assert admit() is None  # the next window


def test_a_signature_is_accepted_within_the_skew_and_stale_beyond_it() -> None:
    secret = base64.b64encode(b"k" * 32).decode()
    key = ServiceKey("tgk_test", "acme", secret, False, NOW.isoformat())
    clock = ManualClock(NOW)
    auth = Authenticator(300, clock)
    auth.keys = {key.key_id: key}

    def verify(nonce: str) -> object:
        headers = sign_headers(key_id=key.key_id, secret=secret, method="POST", path="/x",
                               body=b"{}", realm="acme", ts=NOW.isoformat(), nonce=nonce)
        return auth.verify("POST", "/x", headers, b"{}")

    clock.advance(299)
    assert verify("n1").realm == "acme"
    clock.advance(2)  # 301 s after it was signed
    with pytest.raises(Unauthorized) as refused:
        verify("n2")
    assert refused.value.code == "AUTH.STALE_SIGNATURE"
