"""The one logging set-up of every tollgate process: JSON lines (or plain text) on stderr.

`setup_logging(process, fmt)` is called first by each process: `tollgate serve` (the HTTP
process), the writer, the flows' scheduler and the other commands. In `json` format every
record is one line:

    {"ts": "2026-11-27T06:00:00.123456Z", "level": "INFO", "logger": "tollgate.runtime",
     "process": "http", "pid": 4242, "message": "catalog ... loaded"}

with `trace_id` when the record has one (the `trace_id` of `extra`, else the request's, held
in `TRACE_ID` while the HTTP process serves it), `exc` (the formatted traceback) when it
carries exception info, and any other `extra` field given to the call (the access log's
method, path, status and the like). `text` is the same record for people:
`2026-11-27T06:00:00.123Z INFO http tollgate.runtime: message [trace_id=...]`.

TOLLGATE_LOG_FORMAT chooses (`core.settings`); `serve` and the processes it starts default
to `json`, the other commands to `text`. TOLLGATE_LOG_LEVEL sets the level (INFO).
"""

from __future__ import annotations

import contextvars
import logging
import os
import sys
import time
from typing import Any

import msgspec

__all__ = ["TRACE_ID", "JsonFormatter", "TextFormatter", "rfc3339", "setup_logging"]

# The trace id of the request being served (HTTP process), for every log call under it.
TRACE_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("tollgate_trace_id",
                                                                      default=None)
FORMATS = ("json", "text")

# The attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName"}
_encode = msgspec.json.Encoder(decimal_format="number").encode


def rfc3339(epoch: float) -> str:
    """A Unix time as RFC 3339 UTC with microseconds.

    >>> rfc3339(0.5)
    '1970-01-01T00:00:00.500000Z'
    """
    whole = int(epoch)
    micros = int(round((epoch - whole) * 1_000_000))
    if micros == 1_000_000:
        whole, micros = whole + 1, 0
    if whole != _second[0]:  # one strftime per second, not per line
        _second[0], _second[1] = whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{_second[1]}.{micros:06d}Z"


_second: list[Any] = [None, ""]


def _trace_id(record: logging.LogRecord) -> str | None:
    given = record.__dict__.get("trace_id")
    return given if given is not None else TRACE_ID.get()


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a traceback's line breaks are escaped)."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process
        self.pid = os.getpid()

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "process": self.process,
            "pid": self.pid,
            "message": record.getMessage(),
        }
        trace = _trace_id(record)
        if trace is not None:
            line["trace_id"] = trace
        extra = record.__dict__.keys() - _STANDARD
        for key in extra:
            if key not in line:
                line[key] = record.__dict__[key]
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = record.stack_info
        try:
            return _encode(line).decode()
        except (TypeError, msgspec.EncodeError):
            return _encode({k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
                            for k, v in line.items()}).decode()


class TextFormatter(logging.Formatter):
    """The same record for people: time, level, process, logger, message, trace id."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        text = (f"{rfc3339(record.created)[:23]}Z {record.levelname} {self.process}"
                f" {record.name}: {record.getMessage()}")
        extra = {k: v for k, v in record.__dict__.items() if k not in _STANDARD and k != "trace_id"}
        if extra:
            text += " " + " ".join(f"{k}={v}" for k, v in extra.items())
        trace = _trace_id(record)
        if trace is not None:
            text += f" [trace_id={trace}]"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(process: str, fmt: str | None = None, level: str | int | None = None) -> None:
    """Send every record of this process to stderr in `fmt` (json or text; TOLLGATE_LOG_FORMAT
    when None, else json), replacing the root logger's handlers (a second call re-configures)."""
    fmt = (fmt or os.environ.get("TOLLGATE_LOG_FORMAT") or "json").strip().lower()
    if fmt not in FORMATS:
        fmt = "json"
    level = level or os.environ.get("TOLLGATE_LOG_LEVEL", "").strip().upper() or logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(process) if fmt == "json" else TextFormatter(process))
    # No record needs its caller's file and line, thread or process names: skipping the
    # stack walk and the look-ups makes each record (an access line per request) cheaper.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # uvicorn's own loggers: through the root handler, not handlers of their own.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        named = logging.getLogger(name)
        named.handlers.clear()
        named.propagate = True
    for chatty in ("httpx", "httpcore"):  # a line per request to Prefect's API
        logging.getLogger(chatty).setLevel(logging.WARNING)
