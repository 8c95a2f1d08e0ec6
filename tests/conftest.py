"""Fixtures that run the real service: a subprocess `tollgate serve` on loopback over a real
data folder, a real catalog applied with the real CLI, and real service keys.

Markers (README.md, "Test it"): `server` on a test that starts `tollgate serve` (any test
that uses the `service` or `fresh_service` fixture is marked by `pytest_collection_modifyitems`;
a module that starts one itself says so with `pytestmark`), `prefect` on a test that runs
Prefect flows, `lake` on one that builds a lake or runs the `tollgate` command.
`-m "not server and not prefect and not lake"` is the fast subset; run that way, a test that
starts a service or the command anyway fails and names the marker it lacks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.auth import sign_headers

FIXTURES = Path(__file__).parent / "fixtures"
# The markers this run excludes, in the environment rather than in a global: test modules
# import this file as `tests.conftest`, a second module beside the plugin pytest loaded.
_EXCLUDED = "TOLLGATE_TESTS_EXCLUDED"


def pytest_configure(config: pytest.Config) -> None:
    expr = config.option.markexpr or ""
    excluded = [m for m in ("server", "prefect", "lake") if f"not {m}" in expr]
    os.environ[_EXCLUDED] = ",".join(excluded)
    if "prefect" in excluded:
        # A flow run then fails at once on an API nobody serves, naming the marker it lacks.
        os.environ["PREFECT_API_URL"] = "http://127.0.0.1:9/api"


def _refuse_if_excluded(marker: str, what: str) -> None:
    if marker in os.environ.get(_EXCLUDED, "").split(","):
        raise RuntimeError(f"this test {what}: mark it `{marker}`")


def examples(count: int) -> int:
    """Hypothesis examples for a property test: `count`, or a tenth of it in the fast subset
    (a quick loop while working; the whole suite runs them all)."""
    return max(10, count // 10) if "lake" in os.environ.get(_EXCLUDED, "").split(",") else count


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if {"service", "fresh_service"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


def processes_of(data_dir: Path, module: str) -> list[int]:
    """Pids of the `python -m <module>` processes started for `data_dir` (reads /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in argv and str(data_dir).encode() in argv:
            found.append(int(entry.name))
    return found


def stop_local_prefect_apis(under: Path, timeout: float = 20) -> None:
    """End the local Prefect APIs (`python -m flows.prefect_api`) kept for data folders under
    `under`: one that `tollgate flows run` starts outlives the run (reads /proc)."""
    prefix = str(under).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"flows.prefect_api" in argv and any(arg.startswith(prefix) for arg in argv):
            pids.append(int(entry.name))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for pid in pids:
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (reads /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tollgate(*args: str, data_dir: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    _refuse_if_excluded("lake", "runs the `tollgate` command")
    return subprocess.run([sys.executable, "-m", "cli", *args, "--data-dir", str(data_dir)],
                          capture_output=True, text=True, check=check)


@dataclass
class Key:
    key_id: str
    secret: str
    realm: str = "acme"


@dataclass
class Service:
    data_dir: Path
    port: int
    key: Key
    proc: subprocess.Popen[bytes] | None = None
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30))
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # settings of this service (TOLLGATE_...)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, ready: bool = True) -> None:
        """Start `tollgate serve` and wait until /healthz answers 200 (any answer when not
        `ready`: a service that starts not ready)."""
        _refuse_if_excluded("server", "starts `tollgate serve`")
        self.log_path = self.data_dir / "serve.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--port", str(self.port),
             "--data-dir", str(self.data_dir)],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1).status_code == 200 or not ready:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server did not become ready")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def request(self, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
                key: Key | None = None, realm: str | None = None, account: str | None = None,
                principal: str | None = None, idempotency_key: str | None = None,
                headers: dict[str, str] | None = None, **sign_kw: Any) -> httpx.Response:
        key = key or self.key
        data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
        signed = sign_headers(key_id=key.key_id, secret=key.secret, method=method, path=path, body=data,
                              realm=realm or key.realm, principal_id=principal,
                              billing_account_id=account, idempotency_key=idempotency_key, **sign_kw)
        signed.update(headers or {})
        return self.client.request(method, self.base_url + path, content=data, headers=signed)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return self.request("POST", path, body, **kw)


def make_service(tmp: Path, catalog: Path = FIXTURES / "catalog.toml") -> Service:
    tollgate("catalog", "apply", str(catalog), data_dir=tmp)
    out = tollgate("keys", "create", "--realm", "acme", data_dir=tmp).stdout
    created = json.loads(out)
    return Service(data_dir=tmp, port=free_port(), key=Key(created["key_id"], created["secret"]))


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = make_service(tmp_path_factory.mktemp("svc"))
    svc.start()
    yield svc
    svc.stop()


@pytest.fixture()
def fresh_service(tmp_path: Path) -> Iterator[Service]:
    """A service of its own, for tests that kill or restart it."""
    svc = make_service(tmp_path)
    yield svc
    svc.stop(signal.SIGKILL)
