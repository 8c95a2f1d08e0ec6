"""`tollgate serve`: run the service on one data folder.

This module owns what happens before the service answers: the checks that the data folder is
usable and no other service holds it (its lock file, then DuckDB's own lock), binding the
address, the first start's demo catalog and key, and the banner that says how to call it.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import socket
import sys
from pathlib import Path

from cli.call import base_url
from cli.catalog import apply_catalog
from cli.shared import CommandError, DataDir, Host, Port
from core.layout import DataFolder
from core.logs import setup_logging
from core.settings import Settings

__all__ = ["serve"]


def serve(*, host: Host = None, port: Port = None, data_dir: DataDir = None) -> int:
    """Run the service: the HTTP API, the writer and the flows' schedules.

    On its first start in a data folder it applies the demo catalog, creates a
    demo service key and prints how to call it. One service per data folder.

    Parameters
    ----------
    host
        address to listen on (TOLLGATE_HOST; default 127.0.0.1)
    port
        port to listen on (TOLLGATE_PORT; default 8040)
    """
    # Imported here: uvicorn, the API and Prefect's launcher take a while to load, and the
    # other commands (and --help) need none of them.
    import uvicorn

    from api.app import create_app
    from api.metrics import clear_process_files
    from flows.launcher import FlowScheduler

    settings = Settings.from_env(data_dir, host, port)
    # JSON lines unless TOLLGATE_LOG_FORMAT says text; the writer and the scheduler inherit
    # the environment, so the same choice reaches them (core.logs).
    os.environ.setdefault("TOLLGATE_LOG_FORMAT", settings.log_format or "json")
    setup_logging("http", settings.log_format or "json")
    try:
        settings.folder.create()  # 0700: it holds the service keys and every account's usage
    except OSError as exc:
        raise CommandError(f"cannot create the data folder {settings.data_dir}:"
                           f" {exc.strerror or exc}", 2) from None
    if not os.access(settings.data_dir, os.W_OK | os.X_OK):
        raise CommandError(f"the data folder {settings.data_dir} is not writable", 2)
    if _lock_data_dir(settings.data_dir) is None:
        raise CommandError(f"the data folder {settings.data_dir} is in use by another"
                           " `tollgate serve`; one service per data folder", 2)
    held = _held_by_another_process(settings.operational_path)
    if held:
        raise CommandError(f"the data folder {settings.data_dir} is in use by another process"
                           f" ({held}); one service per data folder", 2)
    _check_journal(settings)
    try:
        sock = _listen(settings)
    except OSError as exc:
        raise CommandError(f"cannot listen on {settings.host}:{settings.port}:"
                           f" {exc.strerror or exc}", 2) from None
    _bootstrap(settings)
    _prepare_lake(settings)
    # The flows' schedules run in a process of their own beside the HTTP process and the
    # writer; they read and write the lake only. The app stops them as it shuts down
    # (uvicorn ends this process by the signal that stopped it, so the `finally` below is
    # not sure to run).
    clear_process_files(settings.folder.metrics)  # an earlier service's writer and scheduler
    scheduler = FlowScheduler.start(settings)
    app = create_app(settings, on_stop=[scheduler.stop])
    _banner(settings)
    from api.http_protocol import http_protocol

    _raise_open_files(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, loop="uvloop",
                            http=http_protocol(settings), lifespan="on", log_level="warning",
                            log_config=None,  # uvicorn's records go through core.logs
                            access_log=False,  # api/observe.py writes the access log
                            timeout_keep_alive=settings.keep_alive_seconds, proxy_headers=False)
    server = uvicorn.Server(config)
    runtime = app.state.runtime
    # A writer that cannot be kept running (it refused its journal, or ended too often) stops
    # the server as a signal would, and this command then exits 1 so its supervisor acts.
    runtime.on_fatal = lambda: setattr(server, "should_exit", True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn re-raises Ctrl-C once it has shut down gracefully: nothing more to report.
        return 130
    finally:
        scheduler.stop()
    if runtime.fatal is not None:
        raise CommandError(runtime.fatal, 1)
    if not server.started:
        # The app's start failed (a writer that refused its journal, say): uvicorn returns
        # quietly after logging it, and a service that never served must not exit 0.
        raise CommandError("the service did not start (the reason is above)", 1)
    return 0


def _raise_open_files(settings: Settings) -> None:
    """Let this process open a file per connection it may hold (`max_connections`) and the
    files it needs beside them: the soft limit of open files is raised toward the hard one.
    Past the limit, accepting fails before the connection cap can answer 503."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = settings.max_connections + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            target = soft
        if target < wanted:
            print(f"tollgate: this process may open {target} files, fewer than"
                  f" TOLLGATE_MAX_CONNECTIONS ({settings.max_connections}) needs; raise its limit"
                  " (ulimit -n) or lower the setting", file=sys.stderr)


def _check_journal(settings: Settings) -> None:
    """Refuse to start, in one paragraph, when the writer's recovery would (a journal that may
    have lost an acknowledged group; `warehouse.journal_scan`). The writer checks again as it
    opens the file, and exits with the same paragraph; said here, it is not buried under the
    app's failed start."""
    from warehouse.journal_scan import applied_seq, scan_journal

    if not settings.folder.journal.is_dir():
        return
    scan = scan_journal(settings.folder.journal, applied_seq(settings.operational_path),
                        keep_tables=False)
    if not scan.ok:
        raise CommandError(scan.refusal(), 1)


def _demo_catalog() -> str:
    from importlib import resources  # only at a first start

    return resources.files("cli").joinpath("demo/catalog.toml").read_text(encoding="utf-8")


def _bootstrap(settings: Settings) -> None:
    """The first start's set-up: the demo catalog when none is applied, a demo key when the
    folder has none (its id printed, its secret left in the key file)."""
    from warehouse.catalog_store import CatalogStore
    from warehouse.keys import ServiceKeyStore

    store = CatalogStore(settings.catalog_dir)
    if store.read() is None:
        ok, message = apply_catalog(settings, _demo_catalog())
        if ok:
            print(f"tollgate: no catalog yet, applied the demo catalog: {message}")
        else:
            print(f"tollgate: no catalog yet, and the demo catalog could not be applied:\n{message}",
                  file=sys.stderr)
    keys = ServiceKeyStore(settings.keys_path)
    if not keys.load():
        key = keys.create("acme")
        # The secret stays in the key file, never in the output (which often ends in a log):
        # `tollgate call`, the banner's example, reads it from there.
        print(f"tollgate: no service key yet, created the demo key {key.key_id} for realm 'acme';"
              f" its secret is in {settings.keys_path} (mode 0600)")


def _prepare_lake(settings: Settings) -> None:
    """Attach the lake once, writable, before anything serves: a new data folder gets its
    lake, and a lake written by an older version gets its upgrades (the usage rollup of
    every line it holds, `warehouse.usage_days`) before a report reads it."""
    import time

    from warehouse.lake import connect_lake

    began = time.monotonic()
    conn = connect_lake(settings.data_dir)
    conn.close()
    took = time.monotonic() - began
    if took > 5:
        print(f"tollgate: the lake took {took:.0f} s to prepare (a one-time upgrade)")


def _cli_command() -> str:
    """This command as a shell can run it from any folder: `tollgate` when that is the one on
    PATH, else its full path (the venv need not be active)."""
    script = Path(sys.executable).parent / "tollgate"
    if not script.exists():
        return f"{shlex.quote(sys.executable)} -m cli"
    found = shutil.which("tollgate")
    if found and Path(found).resolve() == script.resolve():
        return "tollgate"
    return shlex.quote(str(script))


def _banner(settings: Settings) -> None:
    base = base_url(settings)
    host_flag = f" --host {shlex.quote(settings.host)}" if settings.host != "127.0.0.1" else ""
    data_flag = f" --data-dir {shlex.quote(str(settings.data_dir))}"
    print(f"""tollgate serving on {base}  (data: {settings.data_dir})
  health:   curl {base}/healthz
  OpenAPI:  {base}/schema
  try it (signs with the stored demo key):
    {_cli_command()} call POST /mgt/v1/events --account acct_prepaid{host_flag} --port {settings.port}{data_flag} \\
      --data '{{"semantic_kind":"activity","event_type":"llm.completion","occurred_at":"2026-11-01T12:00:00Z","payload":{{"usage":{{"input_tokens":1200,"output_tokens":300}}}}}}'
""", flush=True)


def _held_by_another_process(path: Path) -> str | None:
    """Who holds the operational file's lock, if another process does (DuckDB allows one
    writing process); None when it is free or does not exist yet."""
    if not path.exists():
        return None
    import duckdb

    try:
        duckdb.connect(str(path)).close()
    except duckdb.IOException as exc:
        found = re.search(r"PID \d+", str(exc))
        if "lock" in str(exc):
            return found.group(0) if found else "its lock is held"
        raise
    return None


def _lock_data_dir(data_dir: Path) -> int | None:
    """An exclusive lock on a file in the data folder, held for the life of this process (the
    file descriptor stays open); None when another `tollgate serve` holds it. Taken before
    anything is written, so two services started at once never both set the folder up."""
    fd = os.open(DataFolder(data_dir).serve_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _listen(settings: Settings) -> socket.socket:
    """The listening address, bound before anything is set up, so a port in use is said at
    once (and the banner never names an address the service does not hold)."""
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError:
        sock.close()
        raise
    return sock
