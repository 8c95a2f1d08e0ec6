"""SVC-AUTH exactly as the SVC-AUTH signing rules."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

from api.auth import sign_headers
from tests.conftest import Key, Service, tollgate

PATH = "/mgt/v1/events"
BODY = {"semantic_kind": "activity", "event_type": "auth.check", "occurred_at": "2026-11-20T10:00:00Z"}


def send(service: Service, headers: dict[str, str], body: bytes | None = None):
    data = json.dumps(BODY).encode() if body is None else body
    return service.client.post(service.base_url + PATH, content=data, headers=headers)


def signed(service: Service, key: Key | None = None, **kw) -> dict[str, str]:
    key = key or service.key
    data = kw.pop("body", json.dumps(BODY).encode())
    params = {"realm": "acme", "billing_account_id": "acct_events", **kw}
    return sign_headers(key_id=key.key_id, secret=key.secret, method="POST", path=PATH, body=data, **params)


def code(response) -> tuple[int, str]:
    return response.status_code, response.json()["code"]


def test_missing_realm_is_400(service: Service) -> None:
    headers = signed(service)
    del headers["x-realm-id"]
    assert code(send(service, headers)) == (400, "AUTH.MISSING_REALM")


def test_missing_or_malformed_authorization_is_401(service: Service) -> None:
    headers = signed(service)
    del headers["authorization"]
    assert code(send(service, headers)) == (401, "AUTH.UNAUTHORIZED")
    headers = signed(service)
    headers["authorization"] = headers["authorization"].replace(",sig=", ", sig=")
    assert code(send(service, headers)) == (401, "AUTH.UNAUTHORIZED")
    headers = signed(service)
    headers["authorization"] = "Bearer abc"
    assert code(send(service, headers)) == (401, "AUTH.UNAUTHORIZED")


def test_unknown_key_is_401(service: Service) -> None:
    headers = signed(service, key=Key("tgk_unknown", service.key.secret))
    assert code(send(service, headers)) == (401, "AUTH.SERVICE_KEY_NOT_FOUND")


def test_bad_signature_is_401(service: Service) -> None:
    headers = signed(service, key=Key(service.key.key_id, "c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0MTI="))
    assert code(send(service, headers)) == (401, "AUTH.INVALID_SERVICE_SIGNATURE")
    # a signed header changed after signing
    headers = signed(service)
    headers["x-billing-account-id"] = "acct_prepaid"
    assert code(send(service, headers)) == (401, "AUTH.INVALID_SERVICE_SIGNATURE")


def test_wrong_digest_is_401(service: Service) -> None:
    headers = signed(service)
    tampered = json.dumps({**BODY, "event_type": "auth.tampered"}).encode()
    assert code(send(service, headers, tampered)) == (401, "AUTH.INVALID_SERVICE_SIGNATURE")


def test_stale_ts_is_401(service: Service) -> None:
    old = (datetime.now(timezone.utc) - timedelta(seconds=301)).isoformat()
    assert code(send(service, signed(service, ts=old))) == (401, "AUTH.STALE_SIGNATURE")
    ahead = (datetime.now(timezone.utc) + timedelta(seconds=301)).isoformat()
    assert code(send(service, signed(service, ts=ahead))) == (401, "AUTH.STALE_SIGNATURE")


def test_replayed_nonce_is_401(service: Service) -> None:
    headers = signed(service, nonce="nonce-once-" + str(time.time()))
    assert send(service, headers).status_code in (200, 201)
    assert code(send(service, headers)) == (401, "AUTH.REPLAYED_NONCE")


def test_key_of_another_realm_is_403(service: Service) -> None:
    headers = signed(service, realm="globex")
    assert code(send(service, headers)) == (403, "AUTH.SERVICE_KEY_REALM_FORBIDDEN")


def test_disabled_key_is_403_within_two_seconds_and_enable_restores(service: Service) -> None:
    created = json.loads(tollgate("keys", "create", "--realm", "acme", data_dir=service.data_dir).stdout)
    key = Key(created["key_id"], created["secret"])
    deadline = time.monotonic() + 2.5
    while send(service, signed(service, key=key)).status_code == 401:  # new key visible within 2 s
        assert time.monotonic() < deadline
        time.sleep(0.1)
    tollgate("keys", "disable", key.key_id, data_dir=service.data_dir)
    deadline = time.monotonic() + 2.5
    while True:
        r = send(service, signed(service, key=key))
        if r.status_code == 403:
            assert r.json()["code"] == "AUTH.SERVICE_KEY_DISABLED"
            break
        assert time.monotonic() < deadline, "disable did not take effect within 2 s"
        time.sleep(0.1)


def test_keys_file_is_readable_only_by_its_owner(service: Service) -> None:
    mode = (service.data_dir / "keys.json").stat().st_mode & 0o777
    assert mode == 0o600


def test_key_changes_made_at_the_same_time_are_all_kept(tmp_path) -> None:
    from concurrent.futures import ProcessPoolExecutor

    from warehouse.keys import ServiceKeyStore

    store = ServiceKeyStore(tmp_path / "keys.json")
    first = store.create("acme")
    with ProcessPoolExecutor(4) as pool:
        made = list(pool.map(_create_key, [str(tmp_path / "keys.json")] * 12))
        disabled = pool.submit(_disable_key, str(tmp_path / "keys.json"), first.key_id)
        made += list(pool.map(_create_key, [str(tmp_path / "keys.json")] * 4))
        disabled.result()
    keys = store.load()
    assert set(made) <= set(keys) and len(keys) == 17
    assert keys[first.key_id].disabled


def _create_key(path: str) -> str:
    from pathlib import Path

    from warehouse.keys import ServiceKeyStore

    return ServiceKeyStore(Path(path)).create("acme").key_id


def _disable_key(path: str, key_id: str) -> None:
    from pathlib import Path

    from warehouse.keys import ServiceKeyStore

    ServiceKeyStore(Path(path)).set_disabled(key_id)


def test_a_key_is_made_only_for_a_realm_id_and_an_unknown_realm_is_noted(service: Service) -> None:
    before = (service.data_dir / "keys.json").read_text()
    for bad in ("", " acme", "acme realm"):
        made = tollgate("keys", "create", "--realm", bad, data_dir=service.data_dir, check=False)
        assert made.returncode == 2 and "is not a realm id" in made.stderr, made.stderr
    assert (service.data_dir / "keys.json").read_text() == before
    made = tollgate("keys", "create", "--realm", "not-applied", data_dir=service.data_dir)
    assert "has no realm 'not-applied'" in made.stderr
    assert json.loads(made.stdout)["key_id"]


def test_a_nonce_answered_before_a_restart_is_refused_after_it_and_holds_nothing(
        fresh_service: Service) -> None:
    svc = fresh_service
    svc.start()
    path = "/mgt/v1/gate/authorize"
    body = json.dumps({"feature_code": "gate.unit", "estimated_quantity_minor": "10"}).encode()
    headers = sign_headers(key_id=svc.key.key_id, secret=svc.key.secret, method="POST", path=path,
                           body=body, realm="acme", principal_id="funds-p")

    def held() -> str:
        r = svc.request("GET", "/mgt/v1/wallet/balance", principal="funds-p")
        assert r.status_code == 200, r.text
        return str(r.json()["data"]["held_xusd"])

    assert svc.client.post(svc.base_url + path, content=body, headers=headers).status_code == 200
    before = held()
    svc.stop()
    svc.start()
    again = svc.client.post(svc.base_url + path, content=body, headers=headers)
    assert code(again) == (401, "AUTH.REPLAYED_NONCE")
    assert held() == before  # the replay took no hold
    assert (svc.data_dir / "nonces").is_dir()


def test_the_nonce_log_forgets_what_has_expired(tmp_path) -> None:
    from api.auth import NonceLog

    log = NonceLog(tmp_path / "nonces", 300)
    assert log.load(1_000_000.0) == []
    log.append("k", "old", 1_000_100)
    log.append("k", "new", 1_000_700)
    log.sync(1_000_000.0)
    assert sorted(n for _, _, n in NonceLog(tmp_path / "nonces", 300).load(1_000_200.0)) == ["new"]
    log.sync(1_000_400.0)  # the first segment has expired: closed and deleted
    assert len(list((tmp_path / "nonces").glob("*.log"))) == 1
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (tmp_path / "nonces").glob("*.log"))
    log.close()
