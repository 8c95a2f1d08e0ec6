"""`tollgate call METHOD PATH`: send one request to the service, signed with a stored key, and
print its status line and body (JSON indented).

This module also owns the service's base URL, which `serve` prints in its banner.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

from cyclopts import Parameter

from cli.shared import CommandError, DataDir, Host, Port
from core.settings import Settings

__all__ = ["base_url", "call"]


def base_url(settings: Settings) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host  # IPv6
    return f"http://{host}:{settings.port}"


def _body(data: str | None) -> bytes:
    """The request body of --data: the text itself, or (curl's convention) the bytes of the
    file after an @, standard input for @-; sent as they are, so the signature covers them."""
    if not data:
        return b""
    if not data.startswith("@"):
        return data.encode()
    name = data[1:]
    if name == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(name).read_bytes()
    except OSError as exc:
        raise CommandError(f"--data {data}: cannot read {name!r}: {exc.strerror or exc}", 2) from None


def call(method: Annotated[str, Parameter(metavar="METHOD")],
         path: Annotated[str, Parameter(metavar="PATH")], /, *,
         data: Annotated[str | None, Parameter(metavar="JSON|@FILE")] = None,
         account: Annotated[str | None, Parameter(metavar="ACCOUNT")] = None,
         principal: Annotated[str | None, Parameter(metavar="PRINCIPAL")] = None,
         realm: Annotated[str | None, Parameter(metavar="REALM")] = None,
         key_id: Annotated[str | None, Parameter(metavar="KEY_ID")] = None,
         idempotency_key: Annotated[str | None, Parameter(metavar="KEY")] = None,
         host: Host = None, port: Port = None, data_dir: DataDir = None) -> int:
    """Send one signed request to the service.

    Signs with an enabled key of the data folder: the one --key-id names, else
    one of the realm --realm names, else the first. Prints HTTP <status> and the
    body (JSON indented). Exit code 1 when the status is 400 or more, 2 when
    the service cannot be reached.

    Parameters
    ----------
    method
        HTTP method (upper-cased: post is POST)
    path
        request path, starting with / (e.g. /mgt/v1/events)
    data
        JSON body; @FILE reads it from FILE, @- from standard input
    account
        X-Billing-Account-Id
    principal
        X-Principal-Id
    realm
        X-Realm-Id (default: the key's realm)
    key_id
        the stored key to sign with
    idempotency_key
        Idempotency-Key
    host
        the service's address (TOLLGATE_HOST; default 127.0.0.1)
    port
        the service's port (TOLLGATE_PORT; default 8040)
    """
    # Imported here, not at the top: the other commands and --help do not pay for them.
    import urllib.error
    import urllib.request

    from api.auth import sign_headers
    from warehouse.keys import ServiceKeyStore

    method = method.upper()
    settings = Settings.from_env(data_dir, host, port)
    if not path.startswith("/"):
        raise CommandError(f"the path must start with '/' (e.g. /mgt/v1/events), not {path!r}", 2)
    keys = [k for k in ServiceKeyStore(settings.keys_path).load().values() if not k.disabled]
    if key_id:
        keys = [k for k in keys if k.key_id == key_id]
    elif realm:
        keys = [k for k in keys if k.realm == realm]  # a key of another realm is refused
    if not keys:
        which = f" {key_id!r}" if key_id else f" of realm {realm!r}" if realm else ""
        raise CommandError(f"no enabled service key{which} in the data folder {settings.data_dir}", 1)
    key = keys[0]
    body = _body(data)
    headers = sign_headers(key_id=key.key_id, secret=key.secret, method=method, path=path,
                           body=body, realm=realm or key.realm, principal_id=principal,
                           billing_account_id=account, idempotency_key=idempotency_key)
    request = urllib.request.Request(f"{base_url(settings)}{path}",
                                     data=body if body else None, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CommandError(f"cannot reach {base_url(settings)} ({reason});"
                           " is `tollgate serve` running there?", 2) from None
    print(f"HTTP {status}")
    try:
        print(json.dumps(json.loads(text), indent=2))
    except ValueError:
        print(text)
    return 0 if status < 400 else 1
