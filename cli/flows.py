"""`tollgate flows`: run a Prefect flow once, now, in this process.

    tollgate flows list
    tollgate flows run NAME [--param k=v ...] [--data-dir D]

NAME is one of rate-events, rerate, close-aggregate-days, publish-usage-reports,
compact-lake. A `--param` value is read as JSON when it parses as JSON, else taken as a
string, so `--param accounts='["acct_a"]'` passes a list and
`--param occurred_from=2026-11-01T00:00:00Z` a string. The run is a Prefect flow run: on the
API of PREFECT_API_URL when set, else on the data folder's local API, which the first run
starts and the runs after it reuse, or which a running `tollgate serve` provides
(`flows.prefect_api`). Exit code 0 when the run completed, 1 when it failed; its result is
printed as JSON.
"""

from __future__ import annotations

import inspect
import json
import logging
from typing import Annotated, Any

from cyclopts import App, Parameter

from cli.shared import OPTIONS, CommandError, DataDir
from core.settings import Settings
from flows import FLOWS, check_params, flow_named  # light: a flow (and Prefect) loads on demand

__all__ = ["app", "parse_params"]

app = App(name="flows", help="Run the Prefect flows (rating, reports, compaction) once, now.",
          group_parameters=OPTIONS)


@app.command(name="list", sort_key=1)
def list_flows(*, data_dir: Annotated[str | None, Parameter(
        name="--data-dir", metavar="DIR", help="data folder; not read by list")] = None) -> int:
    """List the flows, each with the first line of its description."""
    for name in FLOWS:
        doc = (flow_named(name).description or "").strip().split("\n")[0]
        print(f"{name:24} {doc}")
    return 0


def parse_params(pairs: list[str]) -> dict[str, Any]:
    """`K=V` pairs as parameters: V is JSON when it parses as JSON, else the string."""
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


@app.command(sort_key=2)
def run(name: Annotated[str, Parameter(metavar="NAME")], /, *,
        param: Annotated[list[str] | None, Parameter(metavar="K=V", negative_iterable=())] = None,
        data_dir: DataDir = None) -> int:
    """Run one flow now, as a Prefect flow run; prints its result as JSON.

    NAME is rate-events, rerate, close-aggregate-days, publish-usage-reports or
    compact-lake. A --param value is JSON when it parses as JSON, else a string:
    --param accounts='["acct_a"]' passes a list. The run is on the Prefect API
    of PREFECT_API_URL when set, else on the data folder's local one (started
    by the first run, or by tollgate serve; it stops after 10 idle minutes).
    Exit code 0 when the run completed, 1 when it failed, 2 when it could not
    start.

    Parameters
    ----------
    name
        the flow to run (see tollgate flows list)
    param
        a flow parameter, repeatable; V is JSON if it parses
    """
    try:
        params = parse_params(param or [])
    except ValueError as exc:
        raise CommandError(str(exc), 2) from None
    if name not in FLOWS:
        raise CommandError(f"no flow {name!r}; flows: {', '.join(FLOWS)}", 2)
    flow = flow_named(name)
    signature = inspect.signature(flow.fn).parameters
    accepted = [p for p in signature if p != "data_dir"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise CommandError(f"{name} has no parameter {', '.join(unknown)}"
                           f" (its parameters: {', '.join(accepted) or 'none'}; the data folder"
                           " is --data-dir)", 2)
    missing = [p for p in accepted
               if signature[p].default is inspect.Parameter.empty and p not in params]
    if missing:
        raise CommandError(f"{name} needs {' '.join(f'--param {m}=...' for m in missing)}", 2)
    from warehouse.lake import lake_paths

    settings = Settings.from_env(data_dir)
    catalog, _ = lake_paths(settings.data_dir)
    if not catalog.exists():
        # A mistyped folder would otherwise get a new, empty lake and a run that found nothing.
        raise CommandError(f"no lake at {settings.lake_dir} (is --data-dir right? the service"
                           " creates the lake at its first start)", 2)
    try:
        check_params(name, settings.data_dir, params)
    except ValueError as exc:
        raise CommandError(f"{name}: {exc}", 2) from None
    from prefect.exceptions import ParameterTypeError

    quiet = logging.getLogger("prefect.flows")  # it logs the same mistake, at length
    quiet.disabled = True
    try:
        flow.validate_parameters(params)
    except ParameterTypeError as exc:
        problems = "; ".join(line.strip(" -") for line in str(exc).splitlines()[1:] if line.strip())
        raise CommandError(f"{name}: invalid parameters: {problems or exc}", 2) from None
    finally:
        quiet.disabled = False
    params["data_dir"] = str(settings.data_dir)
    if settings.log_format:
        # Asked for (TOLLGATE_LOG_FORMAT): the lines of the service's processes (core.logs),
        # tracebacks included. Otherwise Prefect's console lines, without tracebacks.
        from core.logs import setup_logging

        setup_logging("flows-run", settings.log_format)
    else:
        _console_without_tracebacks()
    from core.priority import run_deferred
    from flows.prefect_api import ApiDidNotStart, flow_api

    # A hand run beside a live service goes below it, as the scheduled runs do: this
    # process, the Prefect API it may start (which inherits it) and the flow (core.priority).
    run_deferred()
    try:
        with flow_api(settings.data_dir):
            state = flow(**params, return_state=True)
    except ApiDidNotStart as exc:
        raise CommandError(str(exc), 1) from None
    if not state.is_completed():
        raise CommandError(f"flow {name} ended {state.name}: {state.message}", 1)
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
