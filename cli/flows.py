"""`tollgate flows`: run a Prefect flow once, now, in this process.

    tollgate flows list
    tollgate flows run NAME [--param k=v ...] [--data-dir D]

NAME is one of rate-events, rerate, close-aggregate-days, publish-usage-reports,
compact-lake. A `--param` value is read as JSON when it parses as JSON, else taken as a
string, so `--param accounts='["acct_a"]'` passes a list and
`--param occurred_from=2026-11-01T00:00:00Z` a string. The run is a Prefect flow run: on the
API of PREFECT_API_URL when set, else on a temporary local one. Exit code 0 when the run
completed, 1 when it failed; its result is printed as JSON.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
from typing import Any

from core.settings import Settings

__all__ = ["cmd_flows", "parse_params", "register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `flows` subcommand to the `tollgate` parser."""
    from flows import FLOWS

    p = sub.add_parser("flows", help="run the Prefect flows (rating, reports, compaction)",
                       description="Run a Prefect flow once, now.")
    flows_sub = p.add_subparsers(dest="flows_cmd", required=True)
    listing = flows_sub.add_parser("list", help="list the flows")
    listing.add_argument("--data-dir", help="data folder (TOLLGATE_DATA_DIR; default ./var); not read")
    run = flows_sub.add_parser("run", help="run one flow now")
    run.add_argument("name", metavar="NAME", help=", ".join(FLOWS))
    run.add_argument("--param", action="append", default=[], metavar="K=V",
                     help="a flow parameter; V is JSON when it parses, else a string")
    run.add_argument("--data-dir", help="data folder (TOLLGATE_DATA_DIR; default ./var)")
    p.set_defaults(func=cmd_flows)


def parse_params(pairs: list[str]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--param {pair!r}: expected K=V")
        try:
            params[key] = json.loads(text)
        except ValueError:
            params[key] = text
    return params


def cmd_flows(args: argparse.Namespace) -> int:
    from flows import FLOWS, check_params, flow_named

    if args.flows_cmd == "list":
        for name in FLOWS:
            doc = (flow_named(name).description or "").strip().split("\n")[0]
            print(f"{name:24} {doc}")
        return 0
    try:
        params = parse_params(args.param)
    except ValueError as exc:
        print(f"tollgate: {exc}", file=sys.stderr)
        return 2
    if args.name not in FLOWS:
        print(f"tollgate: no flow {args.name!r}; flows: {', '.join(FLOWS)}", file=sys.stderr)
        return 2
    flow = flow_named(args.name)
    signature = inspect.signature(flow.fn).parameters
    accepted = [name for name in signature if name != "data_dir"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        print(f"tollgate: {args.name} has no parameter {', '.join(unknown)}"
              f" (its parameters: {', '.join(accepted) or 'none'}; the data folder is --data-dir)",
              file=sys.stderr)
        return 2
    missing = [name for name in accepted
               if signature[name].default is inspect.Parameter.empty and name not in params]
    if missing:
        print(f"tollgate: {args.name} needs {' '.join(f'--param {m}=...' for m in missing)}",
              file=sys.stderr)
        return 2
    from warehouse.lake import lake_paths

    settings = Settings.from_env(args.data_dir)
    catalog, _ = lake_paths(settings.data_dir)
    if not catalog.exists():
        # A mistyped folder would otherwise get a new, empty lake and a run that found nothing.
        print(f"tollgate: no lake at {settings.lake_dir} (is --data-dir right? the service"
              " creates the lake at its first start)", file=sys.stderr)
        return 2
    try:
        check_params(args.name, settings.data_dir, params)
    except ValueError as exc:
        print(f"tollgate: {args.name}: {exc}", file=sys.stderr)
        return 2
    from prefect.exceptions import ParameterTypeError

    quiet = logging.getLogger("prefect.flows")  # it logs the same mistake, at length
    quiet.disabled = True
    try:
        flow.validate_parameters(params)
    except ParameterTypeError as exc:
        problems = "; ".join(line.strip(" -") for line in str(exc).splitlines()[1:] if line.strip())
        print(f"tollgate: {args.name}: invalid parameters: {problems or exc}", file=sys.stderr)
        return 2
    finally:
        quiet.disabled = False
    params["data_dir"] = str(settings.data_dir)
    _console_without_tracebacks()
    state = flow(**params, return_state=True)
    if not state.is_completed():
        print(f"tollgate: flow {args.name} ended {state.name}: {state.message}", file=sys.stderr)
        return 1
    print(json.dumps(state.result(), indent=2, default=str))
    return 0


class _NoTraceback(logging.Formatter):
    """A console formatter that leaves out tracebacks: a failed run ends in one line of its
    own, and the traceback still reaches the Prefect API's logs."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def _console_without_tracebacks() -> None:
    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in
                                       list(logging.Logger.manager.loggerDict)]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if (isinstance(handler, PrefectConsoleHandler)
                    and not isinstance(handler.formatter, _NoTraceback)):
                handler.setFormatter(_NoTraceback(handler.formatter))
