"""`tollgate keys create|list|disable|enable`: the service keys of a data folder.

Each line printed is one JSON object. The keys live in `keys.json` (mode 0600) in the data
folder; a running service reads a change within 2 s.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

from cyclopts import App, Parameter

from cli.shared import OPTIONS, CommandError, DataDir
from core.settings import Settings

__all__ = ["app"]

app = App(name="keys", help="Create, list, disable or enable service keys.",
          group_parameters=OPTIONS)

KeyId = Annotated[str, Parameter(metavar="KEY_ID", help="the key's id (tgk_...)")]

# The stores and the catalog are imported inside the commands: `tollgate --help` and the
# other commands do not pay for them.


@app.command(sort_key=1)
def create(*, realm: Annotated[str, Parameter(metavar="REALM")], data_dir: DataDir = None) -> int:
    """Create a key; prints its id and secret once, as JSON.

    Parameters
    ----------
    realm
        the realm the key signs for
    """
    from pipelines.catalog import ID_PATTERN, CatalogInvalid, load_catalog
    from warehouse.catalog_store import CatalogStore
    from warehouse.keys import ServiceKeyStore

    settings = Settings.from_env(data_dir)
    store = ServiceKeyStore(settings.keys_path)
    if not ID_PATTERN.fullmatch(realm):
        raise CommandError(f"{realm!r} is not a realm id (letters, digits and ._:@/-,"
                           " 1-128 characters)", 2)
    applied = CatalogStore(settings.catalog_dir).read()
    if applied is not None:
        try:
            realms = load_catalog(applied).realms
        except CatalogInvalid:
            realms = None
        if realms is not None and realm not in realms:
            # Keys may be made before their realm is applied: say so, and go on.
            print(f"tollgate: note: the applied catalog has no realm {realm!r}"
                  f" (it has: {', '.join(sorted(realms)) or 'none'})", file=sys.stderr)
    key = store.create(realm)
    print(json.dumps({"key_id": key.key_id, "secret": key.secret}))
    return 0


@app.command(name="list", sort_key=2)
def list_keys(*, data_dir: DataDir = None) -> int:
    """List the keys, one JSON object a line (no secrets)."""
    from warehouse.keys import ServiceKeyStore

    for key in ServiceKeyStore(Settings.from_env(data_dir).keys_path).load().values():
        print(json.dumps({"key_id": key.key_id, "realm": key.realm, "disabled": key.disabled,
                          "created_at": key.created_at}))
    return 0


@app.command(sort_key=3)
def disable(key_id: KeyId, /, *, data_dir: DataDir = None) -> int:
    """Disable a key: the service refuses requests it signs."""
    return _set_disabled(key_id, True, data_dir)


@app.command(sort_key=4)
def enable(key_id: KeyId, /, *, data_dir: DataDir = None) -> int:
    """Enable a disabled key again."""
    return _set_disabled(key_id, False, data_dir)


def _set_disabled(key_id: str, disabled: bool, data_dir: str | None) -> int:
    from warehouse.keys import KeyNotFound, ServiceKeyStore

    try:
        key = ServiceKeyStore(Settings.from_env(data_dir).keys_path).set_disabled(key_id, disabled)
    except KeyNotFound:
        raise CommandError(f"no service key {key_id!r}", 1) from None
    print(json.dumps({"key_id": key.key_id, "disabled": key.disabled}))
    return 0
