"""The Prefect API the flows of a data folder run on, kept between runs.

Every flow run is a Prefect flow run, so it needs a Prefect API. When PREFECT_API_URL is set
(in the environment or the Prefect profile) that API is used, always. Otherwise Prefect
boots a temporary API server in every process that runs a flow and stops it when the process
ends: about 5 s to start and 1 s to stop on each `tollgate flows run`, the most of a run with
nothing to do (docs/measurements.md). So tollgate keeps one local API per data folder, this
module run as `python -m flows.prefect_api`, and records its address in the data folder
(`prefect-api.json`, `core.layout`):

- `tollgate flows run` runs on the API recorded there when it answers. When none answers it
  starts one, detached, which ends by itself once it has served no request for
  TOLLGATE_PREFECT_API_IDLE_SECONDS (600); the first run pays for the start, the runs after
  it do not. With TOLLGATE_PREFECT_API_IDLE_SECONDS=0 none is kept: each run boots Prefect's
  temporary API, as before.
- The scheduler of `tollgate serve` starts an API of its own at its first run and records
  it, so a `flows run` beside a running service uses the service's API. That one is the
  scheduler's child: it ends with the scheduler, that is with the service.

The API is what Prefect's temporary server runs (its REST API without the UI, the services of
an ephemeral server, the Prefect database of PREFECT_HOME), on a free loopback port. Every
Prefect server tollgate starts, this one or a temporary one, runs with
PREFECT_SERVER_ANALYTICS_ENABLED=false unless that is set: offline, the server's analytics
heartbeat logged an ERROR in every run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from core.layout import DataFolder, keep_private
from core.lifetime import end_with_parent
from core.settings import Settings

__all__ = ["ApiDidNotStart", "flow_api", "local_api", "main", "server_environment"]

# How long a starting API may take before the run gives up (Prefect's own default is 20 s;
# a loaded machine with a new Prefect database needs more).
_START_TIMEOUT = 90.0
# The server's settings as Prefect's temporary server sets them: no UI, ephemeral services.
_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
               "PREFECT__SERVER_FINAL": "1"}


class ApiDidNotStart(RuntimeError):
    """The local Prefect API ended or did not answer at its start; the message says where its
    output is."""


def server_environment(base: Mapping[str, str]) -> dict[str, str]:
    """`base` for a process that starts a Prefect server: its analytics off unless `base` says.

    >>> server_environment({})["PREFECT_SERVER_ANALYTICS_ENABLED"]
    'false'
    >>> server_environment({"PREFECT_SERVER_ANALYTICS_ENABLED": "true"})["PREFECT_SERVER_ANALYTICS_ENABLED"]
    'true'
    """
    env = dict(base)
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    return env


@contextlib.contextmanager
def flow_api(data_dir: Path, *, owned: bool = False) -> Iterator[str | None]:
    """Run the flows inside on the Prefect API of PREFECT_API_URL when set, else on the data
    folder's local API (`local_api`), else (none kept) on Prefect's temporary API; yields
    the API's URL, None for the temporary one."""
    # Prefect's temporary server takes this process's environment when it starts.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_UI_URL,
        get_current_settings,
        temporary_settings,
    )

    settings = Settings.from_env(data_dir)
    if get_current_settings().api.url or (not owned and settings.prefect_api_idle_seconds == 0):
        yield get_current_settings().api.url
        return
    url = local_api(settings.data_dir, owned=owned,
                    idle_seconds=0 if owned else settings.prefect_api_idle_seconds)
    # The local API serves no UI: no "View at" link to a page nobody serves (unless the
    # user names a UI).
    ui = get_current_settings().ui_url or ""
    with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_UI_URL: ui}):
        yield url


# The APIs this process started as its children (the scheduler's), by data folder.
_OWN: dict[Path, tuple[str, subprocess.Popen[bytes]]] = {}


def local_api(data_dir: Path, *, owned: bool = False, idle_seconds: int = 600) -> str:
    """The URL of the data folder's local Prefect API, started if none answers.

    An `owned` API is this process's child, started at the first call, reused after, and
    ending with this process. Otherwise the API recorded in the data folder is used when it
    answers, or one is started, detached, that ends after `idle_seconds` without a request
    (0: never). Either way the data folder records the API started last."""
    folder = DataFolder(data_dir)
    if owned:
        mine = _OWN.get(folder.root)
        if mine is not None and mine[1].poll() is None and _answers(mine[0]):
            return mine[0]
    else:
        found = _answering(folder.prefect_api)
        if found:
            return found
    with _locked(folder.prefect_api_lock):
        if not owned:
            found = _answering(folder.prefect_api)  # another run started one meanwhile
            if found:
                return found
        url, proc = _start(folder, owned, idle_seconds)
        if owned:
            _OWN[folder.root] = url, proc
        return url


def _answering(record: Path) -> str | None:
    """The URL recorded in `record` when an API answers there."""
    try:
        url = str(json.loads(record.read_text())["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return url if _answers(url) else None


def _answers(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as reply:
            return bool(reply.status == 200 and reply.read().strip() == b"true")
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time starts a data folder's API (two runs at once share one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _start(folder: DataFolder, owned: bool,
           idle_seconds: int) -> tuple[str, subprocess.Popen[bytes]]:
    argv = [sys.executable, "-m", "flows.prefect_api", "--data-dir", str(folder.root),
            "--idle-seconds", str(idle_seconds)]
    if owned:
        argv += ["--parent-pid", str(os.getpid())]
    with open(folder.prefect_api_log, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=not owned,
                                env={**server_environment(os.environ), **_SERVER_ENV})
    deadline = time.monotonic() + _START_TIMEOUT
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise ApiDidNotStart(f"the local Prefect API ended at its start (exit code {code});"
                               f" see {folder.prefect_api_log}")
        try:
            record = json.loads(folder.prefect_api.read_text())
        except (OSError, ValueError):
            record = {}
        if isinstance(record, dict) and record.get("pid") == proc.pid:
            url = _answering(folder.prefect_api)
            if url:
                return url, proc
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise ApiDidNotStart(f"the local Prefect API did not start in {_START_TIMEOUT:.0f} s;"
                       f" see {folder.prefect_api_log}")


# --- the API's own process ------------------------------------------------------------------

_Asgi = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]],
                  Callable[[MutableMapping[str, Any]], Awaitable[None]]], Awaitable[None]]


class _Activity:
    """The Prefect app, counting the requests and connections under way and when the last
    one ended (read by the idle watch)."""

    def __init__(self, app: _Asgi) -> None:
        self.app = app
        self.open = 0
        self.last = time.monotonic()

    async def __call__(self, scope: MutableMapping[str, Any],
                       receive: Callable[[], Awaitable[Any]],
                       send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
            self.last = time.monotonic()

    def idle_for(self) -> float:
        return 0.0 if self.open else time.monotonic() - self.last


def _write_record(record: Path, url: str) -> None:
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(tmp, record)


def _forget_record(record: Path) -> None:
    """Remove the record if it still names this process (a newer API may have replaced it)."""
    try:
        if json.loads(record.read_text()).get("pid") == os.getpid():
            record.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.prefect_api")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--idle-seconds", type=int, default=600,
                        help="end after this long without a request (0: never)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="end with this process (the scheduler of `tollgate serve`)")
    args = parser.parse_args(argv)
    keep_private()
    # With the scheduler as its parent it ends with it; started by hand, it lives on its own.
    if args.parent_pid is not None and not end_with_parent(signal.SIGTERM, args.parent_pid):
        return 0
    for name, value in {**_SERVER_ENV, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}.items():
        os.environ.setdefault(name, value)
    import uvicorn
    from prefect.server.api.server import create_app

    folder = Settings.from_env(args.data_dir).folder
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/api"
    app = _Activity(create_app(ephemeral=True, final=True))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="on"))

    def watch() -> None:
        while not server.started:
            if server.should_exit:
                return
            time.sleep(0.05)
        _write_record(folder.prefect_api, url)
        while not server.should_exit:
            if args.idle_seconds and app.idle_for() > args.idle_seconds:
                server.should_exit = True
            time.sleep(1.0)

    threading.Thread(target=watch, name="idle-watch", daemon=True).start()
    try:
        server.run(sockets=[sock])
    finally:
        _forget_record(folder.prefect_api)
    return 0


if __name__ == "__main__":
    sys.exit(main())
