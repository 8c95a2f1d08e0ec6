"""Service keys: a JSON file of their own under the data folder, readable only by the owner.

A key has an id, a realm, a secret (base64 of 32 random bytes) and a disabled flag. The file
is replaced atomically on every change, so a running server that polls it never reads half a
file. Keys never go to the lake.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec

from core.clock import SYSTEM_CLOCK, Clock
from warehouse.durable import sync_dir

__all__ = ["KeyNotFound", "ServiceKey", "ServiceKeyStore"]


class KeyNotFound(Exception):
    pass


@dataclass(frozen=True, slots=True)
class ServiceKey:
    key_id: str
    realm: str
    secret: str
    disabled: bool
    created_at: str

    @property
    def secret_bytes(self) -> bytes:
        return base64.b64decode(self.secret)


class _KeyRecord(msgspec.Struct):
    realm: str
    secret: str
    created_at: str
    disabled: bool = False


class ServiceKeyStore:
    def __init__(self, path: Path, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self.path = path

    def signature(self) -> tuple[int, int] | None:
        """Changes whenever the file is replaced; the server polls it."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_ino)

    def load(self) -> dict[str, ServiceKey]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            records = msgspec.json.decode(raw, type=dict[str, _KeyRecord])
        except msgspec.DecodeError as exc:  # an OSError, so the CLI says it in one line
            raise OSError(f"the key file {self.path} is not readable as keys: {exc}") from exc
        return {
            kid: ServiceKey(kid, r.realm, r.secret, r.disabled, r.created_at)
            for kid, r in records.items()
        }

    def _save(self, keys: dict[str, ServiceKey]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        records = {
            k.key_id: _KeyRecord(k.realm, k.secret, k.created_at, k.disabled) for k in keys.values()
        }
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, msgspec.json.format(msgspec.json.encode(records)))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
        sync_dir(self.path.parent)  # the rename itself survives a power loss

    @contextlib.contextmanager
    def _changing(self) -> Iterator[dict[str, ServiceKey]]:
        """The keys, read and written back under an exclusive lock on a file beside them, so
        two commands at once never lose a change (a disable undone by a create's write)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(f".{self.path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            keys = self.load()
            yield keys
            self._save(keys)
        finally:
            os.close(fd)  # releases the lock

    def create(self, realm: str) -> ServiceKey:
        with self._changing() as keys:
            return self._add(keys, realm)

    def _add(self, keys: dict[str, ServiceKey], realm: str) -> ServiceKey:
        key = ServiceKey(
            key_id="tgk_" + secrets.token_hex(12),
            realm=realm,
            secret=base64.b64encode(secrets.token_bytes(32)).decode(),
            disabled=False,
            created_at=self.clock.now().isoformat(),
        )
        keys[key.key_id] = key
        return key

    def set_disabled(self, key_id: str, disabled: bool = True) -> ServiceKey:
        with self._changing() as keys:
            if key_id not in keys:
                raise KeyNotFound(key_id)
            old = keys[key_id]
            keys[key_id] = ServiceKey(old.key_id, old.realm, old.secret, disabled, old.created_at)
            return keys[key_id]

