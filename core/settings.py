"""The one configuration of tollgate: flags, then environment, then defaults.

Every process reads it: the service (`tollgate serve`), the writer process, the flows'
scheduler and the flows themselves, and the CLI. A process started by another receives
the data folder as a flag and reads the rest from the environment it inherits, so all of
them see the same settings.

| environment variable              | default      | what it sets                               |
|-----------------------------------|--------------|--------------------------------------------|
| TOLLGATE_DATA_DIR                 | ./var        | the data folder (`core.layout`)            |
| TOLLGATE_HOST / TOLLGATE_PORT     | 127.0.0.1 / 8040 | where `serve` listens and `call` sends |
| TOLLGATE_SIGNATURE_SKEW_SECONDS   | 300          | how far a signed timestamp may be off      |
| TOLLGATE_SCHEDULES                | on           | whether `serve` runs the flows' schedules  |
| TOLLGATE_SCHEDULE_SECONDS         | (none)       | intervals, e.g. `rate-events=30`           |
| TOLLGATE_FLOW_MEMORY_LIMIT        | 1GB          | DuckDB's memory limit in a flow (and the size of a sweep's rounds) |
| TOLLGATE_PREFECT_API_IDLE_SECONDS | 600          | when the Prefect API `flows run` keeps stops (`flows.prefect_api`); 0: none kept |
| TOLLGATE_WRITER_DEADLINE_SECONDS  | 10           | how long a request waits for the writer before its 503 (`api.runtime`) |
| TOLLGATE_LOG_FORMAT               | json under `serve`, else text | `json` (one JSON object a line) or `text` (`core.logs`) |
| TOLLGATE_LOG_LEVEL                | INFO         | the lowest level logged                    |
| TOLLGATE_METRICS                  | on           | Prometheus metrics: `on` (GET /metrics on the API's address), `off`, or `HOST:PORT` (a listener of their own) |
| TOLLGATE_WORKERS                  | the cores this process may use | HTTP worker processes of `serve` (`--workers`; docs/operations.md) |
| TOLLGATE_STOP_SECONDS             | 10           | how long `serve` takes at most to stop on SIGTERM or SIGINT (docs/operations.md) |
| TOLLGATE_MAX_BACKLOG_ROWS         | 100000       | while the operational file refuses writes, the acknowledged rows the journal may hold beyond it; past it, writes get 503 (`warehouse.journal`) |
| TOLLGATE_TEST_FULL_DISK_FILE      | (none)       | tests only: a file name in the data folder; while that file exists, the writer's applies to the operational file fail as on a full disk |
| TOLLGATE_WRITER_MEMORY            | 1GiB         | the writer process's memory ceiling: DuckDB's memory limit and the event index's cache are cut from it (`writer.host`) |
| TOLLGATE_OPERATIONAL_WINDOW_SECONDS | 3600       | how long exported events, rating rows and commits stay in the operational file (`warehouse.retention`) |
| TOLLGATE_OPERATIONAL_WINDOW_ROWS  | 32 M a GiB of TOLLGATE_WRITER_MEMORY | the most rows of a stream the lake holds that the operational file keeps, whatever their age (`warehouse.retention`) |
| TOLLGATE_EXPORT_BACKLOG_ROWS      | 4000000      | events the operational file may hold that the lake lacks; from there event ingestion gets 503 `STORAGE.BUSY` until the export is back under 90 % of it (`warehouse.writer.LoopStatus`); 0: no bound |
| TOLLGATE_LAKE_SNAPSHOT_HOURS      | 6            | how far back the lake's snapshots reach (time travel); older ones are expired every 10 minutes (`warehouse.export`) |

The HTTP process's limits (docs/api.md, "Limits"), each a positive number:

| environment variable                  | default  | what it limits                                      |
|---------------------------------------|----------|-----------------------------------------------------|
| TOLLGATE_MAX_HEADER_BYTES             | 32768    | a request's head (request line and headers): 431    |
| TOLLGATE_MAX_HEADERS                  | 100      | the number of header lines of a request: 431        |
| TOLLGATE_HEADER_TIMEOUT_SECONDS       | 10       | from the connection (or a request's first byte) to the end of its head: 408 |
| TOLLGATE_REQUEST_TIMEOUT_SECONDS      | 60       | from a request's first byte to the end of its body: 408 |
| TOLLGATE_KEEP_ALIVE_SECONDS           | 30       | how long a connection may idle between requests before it is closed |
| TOLLGATE_MAX_BODY_UNSIGNED_BYTES      | 65536    | the body read before the signature is checked; a larger one is authenticated from its head first |
| TOLLGATE_MAX_BODY_BYTES               | 16777216 | a body (after authentication): 413                  |
| TOLLGATE_MAX_CONNECTIONS              | 4096     | open connections; past it a new one gets 503 and is closed |
| TOLLGATE_MAX_NONCE_CHARS              | 128      | the SVC-AUTH nonce: 400 `AUTH.NONCE_TOO_LONG`        |
| TOLLGATE_MAX_IDEMPOTENCY_KEY_CHARS    | 255      | the Idempotency-Key header: 400 `IDEMPOTENCY.KEY_TOO_LONG` |

The priority of gate calls over event ingestion (docs/operations.md, "Priority and
backpressure"), each a positive number:

| environment variable                  | default  | what it sets                                        |
|---------------------------------------|----------|-----------------------------------------------------|
| TOLLGATE_WRITER_GROUP_EVENTS          | 500      | events per ingest group of the writer (a larger op is cut), half as many while gate calls arrive; a gate op waits for at most one such group |
| TOLLGATE_INGEST_QUEUE_BYTES           | 8388608  | body bytes of event requests an HTTP process holds until answered; past it: 503 `STORAGE.BUSY` |
| TOLLGATE_DECODE_PROCESSES             | 1        | processes per HTTP process that decode, validate and hash event batches; 0: on the HTTP loop |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from core.layout import DataFolder

__all__ = ["WINDOW_ROWS_PER_GIB", "ConfigError", "Settings", "parse_bytes", "parse_port", "usable_cores"]

# The operational file's rows bound by default, per GiB of the writer's memory ceiling.
WINDOW_ROWS_PER_GIB = 32_000_000
_OFF = ("off", "0", "false", "no")
_ON = ("on", "1", "true", "yes", "")


class ConfigError(ValueError):
    """A setting that cannot be used; the message names it and says what it must be."""


def parse_port(text: str | int, name: str = "the port") -> int:
    """A TCP port, 1-65535 (0 would bind a random port, larger ones wrap around).

    >>> parse_port("8040")
    8040
    >>> parse_port("0")
    Traceback (most recent call last):
    ...
    core.settings.ConfigError: the port must be a port number from 1 to 65535, not '0'
    """
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name} must be a port number from 1 to 65535, not {str(text)!r}")
    return port


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset or
    `taskset` narrows), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name) or str(default)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{name} must be a positive whole number, not {text!r}")
    return value


def _positive_seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A duration in seconds, more than 0 (a fraction is allowed).

    >>> _positive_seconds({"S": "2.5"}, "S", 10), _positive_seconds({}, "S", 10)
    (2.5, 10.0)
    >>> _positive_seconds({"S": "0"}, "S", 10)
    Traceback (most recent call last):
    ...
    core.settings.ConfigError: S must be a number of seconds above 0, not '0'
    """
    text = env.get(name, "").strip() or str(default)
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name} must be a number of seconds above 0, not {text!r}")
    return value


def _log_format(env: Mapping[str, str]) -> str:
    """TOLLGATE_LOG_FORMAT: json, text, or empty (the process's default).

    >>> _log_format({"TOLLGATE_LOG_FORMAT": "Text"})
    'text'
    >>> _log_format({"TOLLGATE_LOG_FORMAT": "xml"})
    Traceback (most recent call last):
    ...
    core.settings.ConfigError: TOLLGATE_LOG_FORMAT must be json or text, not 'xml'
    """
    text = env.get("TOLLGATE_LOG_FORMAT", "").strip().lower()
    if text not in ("", "json", "text"):
        raise ConfigError(f"TOLLGATE_LOG_FORMAT must be json or text, not {text!r}")
    return text


def _metrics(env: Mapping[str, str]) -> str:
    """TOLLGATE_METRICS: on, off or HOST:PORT.

    >>> _metrics({}), _metrics({"TOLLGATE_METRICS": "no"}), _metrics({"TOLLGATE_METRICS": ":9108"})
    ('on', 'off', ':9108')
    >>> _metrics({"TOLLGATE_METRICS": "somewhere"})
    Traceback (most recent call last):
    ...
    core.settings.ConfigError: TOLLGATE_METRICS must be on, off or HOST:PORT, not 'somewhere'
    """
    text = env.get("TOLLGATE_METRICS", "on").strip().lower()
    if text in _ON:
        return "on"
    if text in _OFF:
        return "off"
    host, sep, port = text.rpartition(":")
    if sep:
        try:
            parse_port(port)
            return text
        except ConfigError:
            pass
    raise ConfigError(f"TOLLGATE_METRICS must be on, off or HOST:PORT, not {text!r}")


def _whole_number(env: Mapping[str, str], name: str, default: int) -> int:
    """A setting of 0 or more.

    >>> _whole_number({"N": "0"}, "N", 600), _whole_number({}, "N", 600)
    (0, 600)
    >>> _whole_number({"N": "-1"}, "N", 600)
    Traceback (most recent call last):
    ...
    core.settings.ConfigError: N must be a whole number, 0 or more, not '-1'
    """
    text = env.get(name, "").strip() or str(default)
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{name} must be a whole number, 0 or more, not {text!r}")
    return value


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2, "mb": 1000 ** 2,
          "mib": 1024 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3}


def parse_bytes(text: str, name: str) -> int:
    """A size: a whole number of bytes, or with a unit (KB, MB, GB: powers of 1000; KiB, MiB,
    GiB: of 1024). At least 64 MiB.

    >>> parse_bytes("1GiB", "M"), parse_bytes("512 MB", "M"), parse_bytes("268435456", "M")
    (1073741824, 512000000, 268435456)
    >>> parse_bytes("1 potato", "M")
    Traceback (most recent call last):
    ...
    core.settings.ConfigError: M must be a size such as 1GiB or 512MB (at least 64MiB), not '1 potato'
    """
    cleaned = text.strip().lower().replace(" ", "")
    number = cleaned.rstrip("kmgib")
    unit = cleaned[len(number):]
    try:
        value = int(float(number) * _UNITS[unit])
    except (ValueError, KeyError):
        value = 0
    if value < 64 * 1024 ** 2:
        raise ConfigError(f"{name} must be a size such as 1GiB or 512MB (at least 64MiB), not {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class Settings:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8040
    signature_skew_seconds: int = 300
    reload_interval_seconds: float = 1.0
    max_body_bytes: int = 16 * 1024 * 1024
    # The HTTP process's limits before and after authentication (the table above).
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout_seconds: float = 10.0
    request_timeout_seconds: float = 60.0
    keep_alive_seconds: int = 30
    max_body_unsigned_bytes: int = 64 * 1024
    max_connections: int = 4096
    max_nonce_chars: int = 128
    max_idempotency_key_chars: int = 255
    max_batch_items: int = 1000
    # TOLLGATE_SCHEDULES as given, stripped and lower-cased (see `schedules_on`).
    schedules: str = "on"
    # TOLLGATE_SCHEDULE_SECONDS as given (`NAME=SECONDS,...`; read by `core.schedules`).
    schedule_seconds: str = ""
    flow_memory_limit: str = "1GB"
    # How long the local Prefect API kept by `tollgate flows run` outlives its last request
    # (`flows.prefect_api`); 0: none is kept.
    prefect_api_idle_seconds: int = 600
    # How long a request waits for the writer's answer before it is answered 503
    # STORAGE.UNAVAILABLE with Retry-After (`warehouse.writer.WriterClient`).
    writer_deadline_seconds: float = 10.0
    # Events per group of the writer's ingest lane (`warehouse.writer.run_writer`).
    writer_group_events: int = 500
    # The ingest queue's bound (`api.runtime.Runtime.ingest_admission`).
    ingest_queue_bytes: int = 8 * 1024 * 1024
    # Decoding processes for event batches (`api.events.decoders`); 0: on the HTTP loop.
    decode_processes: int = 1
    # TOLLGATE_LOG_FORMAT: "json", "text", or "" for the process's default (`core.logs`).
    log_format: str = ""
    # TOLLGATE_METRICS: "on", "off" or "HOST:PORT" (see `metrics_address`).
    metrics: str = "on"
    # HTTP worker processes of `tollgate serve` (`api.supervisor`).
    workers: int = 1
    # The whole graceful stop of `tollgate serve`, from the signal to its exit.
    stop_seconds: float = 10.0
    # While the operational file refuses writes, how many acknowledged rows the journal may
    # hold beyond it before writes are refused too (`warehouse.journal.JournaledStore`).
    max_backlog_rows: int = 100_000
    # A test hook: a file name in the data folder whose presence fails every apply to the
    # operational file as a full disk would. Empty (no hook) unless a test sets it.
    test_full_disk_file: str = ""
    # The writer process's memory ceiling in bytes (TOLLGATE_WRITER_MEMORY).
    writer_memory: int = 1024 ** 3
    # How long rows stay in the operational file once the lake and the index hold them.
    operational_window_seconds: float = 3600.0
    # The most rows of a stream the lake holds that stay in the operational file, however
    # young; 0: `window_rows` derives it from `writer_memory`.
    operational_window_rows: int = 0
    # Events not yet in the lake that the operational file may hold before event ingestion is
    # refused (`warehouse.writer.LoopStatus`); 0: no bound.
    export_backlog_rows: int = 4_000_000
    # How long the lake keeps its snapshots (TOLLGATE_LAKE_SNAPSHOT_HOURS, in seconds here).
    lake_snapshot_seconds: float = 6 * 3600.0

    @staticmethod
    def from_env(data_dir: str | os.PathLike[str] | None = None, host: str | None = None,
                 port: int | None = None, env: Mapping[str, str] | None = None,
                 workers: int | None = None) -> Settings:
        env = os.environ if env is None else env
        folder = Path(data_dir or env.get("TOLLGATE_DATA_DIR") or "var").resolve()
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"the data folder {folder} is not a folder")
        return Settings(
            data_dir=folder,
            host=host or env.get("TOLLGATE_HOST") or "127.0.0.1",
            port=parse_port(port) if port is not None else
            parse_port(env.get("TOLLGATE_PORT") or 8040, "TOLLGATE_PORT"),
            signature_skew_seconds=_positive_int(env, "TOLLGATE_SIGNATURE_SKEW_SECONDS", 300),
            schedules=env.get("TOLLGATE_SCHEDULES", "on").strip().lower(),
            schedule_seconds=env.get("TOLLGATE_SCHEDULE_SECONDS", ""),
            flow_memory_limit=env.get("TOLLGATE_FLOW_MEMORY_LIMIT") or "1GB",
            prefect_api_idle_seconds=_whole_number(env, "TOLLGATE_PREFECT_API_IDLE_SECONDS", 600),
            writer_deadline_seconds=_positive_seconds(env, "TOLLGATE_WRITER_DEADLINE_SECONDS", 10.0),
            writer_group_events=_positive_int(env, "TOLLGATE_WRITER_GROUP_EVENTS", 500),
            ingest_queue_bytes=_positive_int(env, "TOLLGATE_INGEST_QUEUE_BYTES", 8 * 1024 * 1024),
            decode_processes=_whole_number(env, "TOLLGATE_DECODE_PROCESSES", 1),
            log_format=_log_format(env),
            metrics=_metrics(env),
            workers=workers if workers is not None else
            _positive_int(env, "TOLLGATE_WORKERS", usable_cores()),
            stop_seconds=_positive_seconds(env, "TOLLGATE_STOP_SECONDS", 10.0),
            max_backlog_rows=_positive_int(env, "TOLLGATE_MAX_BACKLOG_ROWS", 100_000),
            test_full_disk_file=env.get("TOLLGATE_TEST_FULL_DISK_FILE", "").strip(),
            writer_memory=parse_bytes(env.get("TOLLGATE_WRITER_MEMORY", "").strip() or "1GiB",
                                      "TOLLGATE_WRITER_MEMORY"),
            operational_window_seconds=_positive_seconds(env, "TOLLGATE_OPERATIONAL_WINDOW_SECONDS", 3600.0),
            operational_window_rows=_whole_number(env, "TOLLGATE_OPERATIONAL_WINDOW_ROWS", 0),
            export_backlog_rows=_whole_number(env, "TOLLGATE_EXPORT_BACKLOG_ROWS", 4_000_000),
            lake_snapshot_seconds=3600.0 * _positive_seconds(env, "TOLLGATE_LAKE_SNAPSHOT_HOURS", 6.0),
            max_body_bytes=_positive_int(env, "TOLLGATE_MAX_BODY_BYTES", 16 * 1024 * 1024),
            max_header_bytes=_positive_int(env, "TOLLGATE_MAX_HEADER_BYTES", 32 * 1024),
            max_headers=_positive_int(env, "TOLLGATE_MAX_HEADERS", 100),
            header_timeout_seconds=_positive_seconds(env, "TOLLGATE_HEADER_TIMEOUT_SECONDS", 10),
            request_timeout_seconds=_positive_seconds(env, "TOLLGATE_REQUEST_TIMEOUT_SECONDS", 60),
            keep_alive_seconds=_positive_int(env, "TOLLGATE_KEEP_ALIVE_SECONDS", 30),
            max_body_unsigned_bytes=_positive_int(env, "TOLLGATE_MAX_BODY_UNSIGNED_BYTES", 64 * 1024),
            max_connections=_positive_int(env, "TOLLGATE_MAX_CONNECTIONS", 4096),
            max_nonce_chars=_positive_int(env, "TOLLGATE_MAX_NONCE_CHARS", 128),
            max_idempotency_key_chars=_positive_int(env, "TOLLGATE_MAX_IDEMPOTENCY_KEY_CHARS", 255),
        )

    @property
    def window_rows(self) -> int:
        """The most exported rows of a stream the operational file keeps, whatever their
        age: TOLLGATE_OPERATIONAL_WINDOW_ROWS, or `WINDOW_ROWS_PER_GIB` a GiB of the writer's
        memory ceiling. DuckDB holds each row group's metadata in the writer's heap, outside
        its memory limit, about 0.6 MiB a million rows; at full speed an hour's window is
        175 M events, and the writer's RSS passed its 1 GiB ceiling (docs/measurements.md,
        "An hour at full speed").

        >>> Settings(Path("."), writer_memory=1 << 30).window_rows
        32000000
        >>> Settings(Path("."), operational_window_rows=5).window_rows
        5
        """
        if self.operational_window_rows:
            return self.operational_window_rows
        return max(1_000_000, self.writer_memory * WINDOW_ROWS_PER_GIB // (1 << 30))

    @property
    def metrics_on(self) -> bool:
        return self.metrics != "off"

    @property
    def metrics_address(self) -> tuple[str, int] | None:
        """Where /metrics listens when not on the API's own address; None: on the API's.

        >>> Settings(Path("."), metrics="0.0.0.0:9108").metrics_address
        ('0.0.0.0', 9108)
        >>> Settings(Path(".")).metrics_address is None
        True
        """
        if self.metrics in ("on", "off"):
            return None
        host, _, port = self.metrics.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def folder(self) -> DataFolder:
        return DataFolder(self.data_dir)

    @property
    def schedules_on(self) -> bool:
        """Whether `serve` runs the schedules: off for off/0/false/no; on for anything else
        (a value that is neither is run, and `schedules_value_known` says so)."""
        return self.schedules not in _OFF

    @property
    def schedules_value_known(self) -> bool:
        return self.schedules in _OFF or self.schedules in _ON

    @property
    def operational_path(self) -> Path:
        return self.folder.operational

    @property
    def keys_path(self) -> Path:
        return self.folder.keys

    @property
    def catalog_dir(self) -> Path:
        return self.folder.catalog

    @property
    def lake_dir(self) -> Path:
        return self.folder.lake
