"""The `tollgate` command: serve, keys, catalog, call, sql.

Every subcommand takes `--data-dir` (or TOLLGATE_DATA_DIR); `serve` also takes `--host` and
`--port` (TOLLGATE_HOST, TOLLGATE_PORT). On its first start `serve` applies the demo catalog
and creates a demo service key when the data folder has none, and prints how to call it.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shlex
import shutil
import socket
import sys
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

from cli import sql as sql_command
from core.settings import ConfigError, Settings, parse_port
from pipelines.catalog import ID_PATTERN, CatalogInvalid, load_catalog
from pipelines.catalog_rules import grant_changes
from warehouse.catalog_store import CatalogStore
from warehouse.keys import KeyNotFound, ServiceKeyStore

__all__ = ["main"]


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.from_env(args.data_dir, getattr(args, "host", None), getattr(args, "port", None))


def _demo_catalog() -> str:
    return resources.files("cli").joinpath("demo/catalog.toml").read_text(encoding="utf-8")


def apply_catalog(settings: Settings, text: str) -> tuple[bool, str]:
    """Validate a whole catalog and apply it atomically; the message names every fault."""
    try:
        catalog = load_catalog(text)
    except CatalogInvalid as exc:
        return False, "\n".join(f"  {f}" for f in exc.faults)
    store = CatalogStore(settings.catalog_dir)
    # One apply at a time: another one between our check of the grants and our switch could
    # bring a grant id back changed, or leave the lake and the service on different catalogs.
    with store.locked():
        faults = grant_changes(_applied_documents(store), catalog)
        if faults:
            return False, "\n".join(f"  {f}" for f in faults)
        from warehouse.catalog_history import record_catalog  # DuckDB loads only when applying

        # The lake first: the flows rate under the catalog the lake records last, so a catalog
        # the lake could not record is not applied at all (the service keeps the one before).
        try:
            record_catalog(settings.data_dir, catalog)
        except Exception as exc:  # noqa: BLE001 (any failure: nothing is applied, say why)
            return False, f"  the lake could not record the catalog, so it was not applied: {exc}"
        store.apply(text, catalog.fingerprint)
    realms = ", ".join(sorted(catalog.realms)) or "(none)"
    return True, f"catalog {catalog.fingerprint} applied (realms: {realms})"


def _applied_documents(store: CatalogStore) -> list[str]:
    """Every catalog applied to this data folder, oldest first (the history, then the current
    document in case it predates the history)."""
    history = store.folder / "history"
    texts = [p.read_text(encoding="utf-8") for p in sorted(history.glob("*.toml"))] if history.is_dir() else []
    current = store.read()
    if current is not None:
        texts.append(current)
    return texts


def _bootstrap(settings: Settings) -> None:
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
        print("tollgate: no service key yet, created a demo key for realm 'acme' "
              f"(stored in {settings.keys_path}, mode 0600):")
        print(json.dumps({"key_id": key.key_id, "secret": key.secret}))


def _base_url(settings: Settings) -> str:
    host = f"[{settings.host}]" if ":" in settings.host else settings.host  # IPv6
    return f"http://{host}:{settings.port}"


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
    base = _base_url(settings)
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
    fd = os.open(data_dir / ".serve.lock", os.O_RDWR | os.O_CREAT, 0o600)
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


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.app import create_app
    from flows.launcher import FlowScheduler

    settings = _settings(args)
    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"tollgate: cannot create the data folder {settings.data_dir}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    if not os.access(settings.data_dir, os.W_OK | os.X_OK):
        print(f"tollgate: the data folder {settings.data_dir} is not writable", file=sys.stderr)
        return 2
    if _lock_data_dir(settings.data_dir) is None:
        print(f"tollgate: the data folder {settings.data_dir} is in use by another `tollgate serve`;"
              " one service per data folder", file=sys.stderr)
        return 2
    held = _held_by_another_process(settings.operational_path)
    if held:
        print(f"tollgate: the data folder {settings.data_dir} is in use by another process ({held});"
              " one service per data folder", file=sys.stderr)
        return 2
    try:
        sock = _listen(settings)
    except OSError as exc:
        print(f"tollgate: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    _bootstrap(settings)
    app = create_app(settings)
    _banner(settings)
    from api.http_protocol import http_protocol

    config = uvicorn.Config(app, host=settings.host, port=settings.port, loop="uvloop",
                            http=http_protocol(), lifespan="on", log_level="warning",
                            access_log=False, timeout_keep_alive=30, proxy_headers=False)
    # The flows' schedules run in a process of their own beside the HTTP process and the
    # writer; they read and write the lake only.
    scheduler = FlowScheduler.start(settings)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        # uvicorn re-raises Ctrl-C once it has shut down gracefully: nothing more to report.
        return 130
    finally:
        scheduler.stop()
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    store = ServiceKeyStore(_settings(args).keys_path)
    if args.keys_cmd == "create":
        if not ID_PATTERN.fullmatch(args.realm):
            print(f"tollgate: {args.realm!r} is not a realm id (letters, digits and ._:@/-,"
                  " 1-128 characters)", file=sys.stderr)
            return 2
        applied = CatalogStore(_settings(args).catalog_dir).read()
        if applied is not None:
            try:
                realms = load_catalog(applied).realms
            except CatalogInvalid:
                realms = None
            if realms is not None and args.realm not in realms:
                # Keys may be made before their realm is applied: say so, and go on.
                print(f"tollgate: note: the applied catalog has no realm {args.realm!r}"
                      f" (it has: {', '.join(sorted(realms)) or 'none'})", file=sys.stderr)
        key = store.create(args.realm)
        print(json.dumps({"key_id": key.key_id, "secret": key.secret}))
        return 0
    if args.keys_cmd == "list":
        for key in store.load().values():
            print(json.dumps({"key_id": key.key_id, "realm": key.realm, "disabled": key.disabled,
                              "created_at": key.created_at}))
        return 0
    try:
        key = store.set_disabled(args.key_id, args.keys_cmd == "disable")
    except KeyNotFound:
        print(f"tollgate: no service key {args.key_id!r}", file=sys.stderr)
        return 1
    print(json.dumps({"key_id": key.key_id, "disabled": key.disabled}))
    return 0


def cmd_catalog(args: argparse.Namespace) -> int:
    try:
        text = Path(args.file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"tollgate: cannot read the catalog {args.file}: {exc}", file=sys.stderr)
        return 2
    if args.catalog_cmd == "check":
        try:
            catalog = load_catalog(text)
        except CatalogInvalid as exc:
            print(f"catalog {args.file} is invalid ({len(exc.faults)} faults):", file=sys.stderr)
            print("\n".join(f"  {f}" for f in exc.faults), file=sys.stderr)
            return 1
        print(f"catalog {args.file} is valid (fingerprint {catalog.fingerprint}, "
              f"realms: {', '.join(sorted(catalog.realms))})")
        return 0
    ok, message = apply_catalog(_settings(args), text)
    print(message if ok else f"catalog {args.file} was not applied:\n{message}",
          file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def cmd_call(args: argparse.Namespace) -> int:
    from api.auth import sign_headers

    settings = _settings(args)
    if not args.path.startswith("/"):
        print(f"tollgate: the path must start with '/' (e.g. /mgt/v1/events), not {args.path!r}",
              file=sys.stderr)
        return 2
    keys = [k for k in ServiceKeyStore(settings.keys_path).load().values() if not k.disabled]
    if args.key_id:
        keys = [k for k in keys if k.key_id == args.key_id]
    elif args.realm:
        keys = [k for k in keys if k.realm == args.realm]  # a key of another realm is refused
    if not keys:
        which = f" {args.key_id!r}" if args.key_id else f" of realm {args.realm!r}" if args.realm else ""
        print(f"tollgate: no enabled service key{which} in the data folder {settings.data_dir}",
              file=sys.stderr)
        return 1
    key = keys[0]
    body = (args.data or "").encode()
    headers = sign_headers(key_id=key.key_id, secret=key.secret, method=args.method, path=args.path,
                           body=body, realm=args.realm or key.realm, principal_id=args.principal,
                           billing_account_id=args.account, idempotency_key=args.idempotency_key)
    request = urllib.request.Request(f"{_base_url(settings)}{args.path}",
                                     data=body if body else None, method=args.method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        print(f"tollgate: cannot reach {_base_url(settings)} ({reason});"
              " is `tollgate serve` running there?", file=sys.stderr)
        return 2
    print(f"HTTP {status}")
    try:
        print(json.dumps(json.loads(text), indent=2))
    except ValueError:
        print(text)
    return 0 if status < 400 else 1


def _port_arg(text: str) -> int:
    try:
        return parse_port(text)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"not a port number from 1 to 65535: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tollgate", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def with_data_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--data-dir", help="data folder (TOLLGATE_DATA_DIR; default ./var)")
        return p

    def with_address(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--host", help="bind address (TOLLGATE_HOST; default 127.0.0.1)")
        p.add_argument("--port", type=_port_arg, help="port (TOLLGATE_PORT; default 8040)")
        return p

    serve = with_address(with_data_dir(sub.add_parser("serve", help="run the service")))
    serve.set_defaults(func=cmd_serve)

    keys = sub.add_parser("keys", help="service keys")
    keys_sub = keys.add_subparsers(dest="keys_cmd", required=True)
    create = with_data_dir(keys_sub.add_parser("create", help="create a key; prints its secret once"))
    create.add_argument("--realm", required=True)
    with_data_dir(keys_sub.add_parser("list", help="list keys (no secrets)"))
    for name in ("disable", "enable"):
        p = with_data_dir(keys_sub.add_parser(name, help=f"{name} a key"))
        p.add_argument("key_id")
    keys.set_defaults(func=cmd_keys)

    catalog = sub.add_parser("catalog", help="check or apply a catalog")
    cat_sub = catalog.add_subparsers(dest="catalog_cmd", required=True)
    for name in ("check", "apply"):
        p = with_data_dir(cat_sub.add_parser(name, help=f"{name} a catalog TOML file"))
        p.add_argument("file")
    catalog.set_defaults(func=cmd_catalog)

    call = with_address(with_data_dir(sub.add_parser("call", help="send one signed request")))
    call.add_argument("method", type=str.upper)
    call.add_argument("path")
    call.add_argument("--data", help="JSON body")
    call.add_argument("--account", help="X-Billing-Account-Id")
    call.add_argument("--principal", help="X-Principal-Id")
    call.add_argument("--realm", help="X-Realm-Id (default: the key's realm)")
    call.add_argument("--key-id")
    call.add_argument("--idempotency-key")
    call.set_defaults(func=cmd_call)
    sql_command.register(sub)
    from cli.flows import register as register_flows
    register_flows(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader of our output went away (`tollgate sql ... | head`): not an error here.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except ConfigError as exc:  # a setting from the environment (flags are checked by argparse)
        print(f"tollgate: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the data folder cannot be read or written: say so in one line
        print(f"tollgate: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
