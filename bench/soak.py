"""Soak: the service as a user runs it (`tollgate serve`, its defaults, schedules on), driven
at full batch speed for minutes, then stopped with SIGTERM and started again on the same data.

Every interval it prints the events/s of that interval (and the gate pairs/s with authorize
p50/p99 when `--gate-clients` is given), each process's RSS and the cores it used (the load
itself as `load`), the cores of the writer's threads (its loop, the lake exporter, RocksDB,
and the applier's threads, which end with each batch: `ended`), the writer's RSS sampled
every 0.5 s over the interval (min, median, max: each checkpoint of the operational file's
WAL moves it by 100 MiB and more), the sizes in the data folder, and the writer's memory by
part (its `tollgate_writer_memory_bytes` metric: DuckDB's buffers, glibc's heap, RocksDB's
parts), the export's lag and the snapshots the lake keeps, and the writer's upkeep in the
interval: the export's rounds and their mean time, the file's checkpoints and their time,
and the events that left the file.
At the end: the SIGTERM time and exit code, the raw limit again with the service stopped
(against the one before the load: the machine's speed for the raw path then), the restart
time (until GET /healthz says ready), the writer's RSS after the restart, a dedupe check (the
first event of the run, and with `--preload` the first event of the preloaded history, sent
again: both must answer 200 duplicate) and whether the lake holds every accepted event. The
raw limit measured in the same run is the in-process decode + validate + hash + DuckDB Arrow
insert of the same events (`bench.ingest.raw_limit`), which the interval rates are compared
with.

    python bench/soak.py [--minutes 10] [--clients 6] [--batch-size 1000] [--interval 30]
                         [--gate-clients 0] [--preload 0] [--keep DIR] [--warm]
                         [--occurred now|hour]

The machine's own speed moves from minute to minute on a shared host (the same decoding of
a batch cost up to a quarter more CPU in one minute than in the next, measured by the
decoding processes' CPU an event). So a probe process on each core (`SpeedProbe`) times, in
its own CPU time, a fixed piece of the request path's work (decode and validate 100 events)
every second, and each interval prints `speed`: the median of that interval's probes,
averaged over the cores, against the first interval's (0.90 means the same work took 11 %
more CPU). The summary gives the last interval's rate both as measured and at the first
interval's speed.

The targets (docs/measurements.md): the last interval's rate at least 90 % of the first's,
the writer's RSS at the end within 10 % of minute 2, SIGTERM to exit 0 within 10 s, ready
within 10 s of a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.auth import sign_headers  # noqa: E402
from bench.loopback import ROOT, Connection, free_port, percentile, run  # noqa: E402

REALM = "acme"
ACCOUNT = "acct_prepaid"
GATE_ACCOUNT = "acct_soak"
CLI = [sys.executable, "-m", "cli"]

# The demo catalog, plus an account the gate pairs can spend from for hours.
SOAK_ACCOUNT = f"""
[realms.acme.accounts.{GATE_ACCOUNT}]
funding = "prepaid"
credit_limit_xusd = "0"
principals = [{{principals}}]

[[realms.acme.accounts.{GATE_ACCOUNT}.grants]]
id = "soak"
amount_xusd = "9000000000000000"
effective_at = "2026-01-01T00:00:00Z"
"""


def catalog_text(gate_clients: int) -> str:
    demo = (ROOT / "cli" / "demo" / "catalog.toml").read_text()
    principals = ", ".join(f'"soak-{i}"' for i in range(max(gate_clients, 1)))
    return demo + SOAK_ACCOUNT.replace("{principals}", principals)


# One batch body with a slot per event for a counter: never-repeated events cost the load
# generator a string format, not a JSON encode of a thousand objects.
#
# Two shapes of business time (`--occurred`):
#   now   each batch's events occurred at the second it was made, each at its own microsecond
#         (i % 1,000,000): work reported as it is done, the way a metered service sends it.
#   hour  the shape of the runs recorded before 2026-11-28: the seconds of one business hour
#         (2026-11-20 10:00 to 11:00) in turn, whole seconds, so an event's instant is its
#         counter modulo 3,600: each instant holds hundreds of events (ties for the rating
#         sweep's carry) and the index's keys are spread over the hour.
_STAMP = {"now": '%s.%06dZ', "hour": '2026-11-20T10:%02d:%02dZ'}
OCCURRED = tuple(_STAMP)


def batch_template(size: int, occurred: str = "now") -> str:
    event = ('{"semantic_kind":"activity","event_type":"llm.completion",'
             '"occurred_at":"' + _STAMP[occurred] + '","subject_ref":"soak-%d",'
             '"payload":{"schema":2,"model":"m-large","usage":{"input_tokens":%d,"output_tokens":%d}},'
             '"labels":{"env":"prod","region":"eu-west"}}')
    return '{"events":[' + ",".join([event] * size) + "]}"


def batch_values(start: int, size: int, occurred: str = "now") -> tuple[int | str, ...]:
    values: list[int | str] = []
    if occurred == "hour":
        for i in range(start, start + size):
            values += (i // 60 % 60, i % 60, i, 1000 + i % 977, 200 + i % 311)
    else:
        second = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        for i in range(start, start + size):
            values += (second, i % 1_000_000, i, 1000 + i % 977, 200 + i % 311)
    return tuple(values)


# ---- the processes -----------------------------------------------------------------------
def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _role(pid: int) -> str:
    try:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = b" ".join(argv).decode(errors="replace")
    for module, role in (("writer.host", "writer"), ("flows.scheduler", "scheduler"),
                         ("flows.prefect_api", "prefect-api"), ("api.worker", "http"),
                         ("multiprocessing", "decoders"), (" serve", "parent")):
        if module in text:
            return role
    return "flow"


def _descendants(root: int) -> list[int]:
    tree = _children()
    out: list[int] = []
    stack = [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(tree.get(pid, []))
    return out


def rss_by_role(root: int) -> dict[str, float]:
    """MiB of resident memory of `root` and its descendants, summed per role."""
    out: dict[str, float] = {}
    for pid in _descendants(root):
        try:
            for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    role = _role(pid)
                    out[role] = out.get(role, 0.0) + int(line.split()[1]) / 1024
        except OSError:
            continue
    return out


_ACCEPTED = re.compile(rb'"accepted_count":(\d+)')
_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from the text of a /proc `stat` file (a process's or a
    thread's)."""
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_by_pid(root: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system, all threads) of `root` and its descendants, with their
    roles; this process (the load) as pid 0."""
    out: dict[int, tuple[str, float]] = {0: ("load", sum(os.times()[:2]))}
    for pid in _descendants(root):
        try:
            stat = (Path("/proc") / str(pid) / "stat").read_text()
        except OSError:
            continue
        out[pid] = (_role(pid), _cpu_seconds(stat))
    return out


def writer_threads(pid: int | None) -> dict[int, tuple[str, float]]:
    """CPU seconds of each live thread of the writer, with its name (`core.priority.
    name_os_thread`: the exporter, the applier, the journal's threads; RocksDB names its
    own), the loop (the main thread) as "loop", and the whole process as tid 0."""
    out: dict[int, tuple[str, float]] = {}
    if pid is None:
        return out
    task = Path("/proc") / str(pid) / "task"
    try:
        out[0] = ("process", _cpu_seconds((Path("/proc") / str(pid) / "stat").read_text()))
        tids = [int(entry.name) for entry in task.iterdir()]
    except OSError:
        return {}
    for tid in tids:
        try:
            stat = (task / str(tid) / "stat").read_text()
        except OSError:
            continue
        name = "loop" if tid == pid else stat[stat.index("(") + 1:stat.rindex(")")]
        out[tid] = (name, _cpu_seconds(stat))
    return out


def cores_by_thread(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                    seconds: float) -> dict[str, float]:
    """Cores of the writer by thread name between two `writer_threads` samples. The applier
    runs a thread per batch, and /proc forgets a thread once it ends: what the process used
    beyond its live threads is shown as `ended` (mostly the applier's)."""
    if 0 not in before or 0 not in after:
        return {}
    out: dict[str, float] = {}
    live = 0.0
    for tid, (name, spent) in after.items():
        if tid == 0:
            continue
        used = spent - before.get(tid, (name, 0.0))[1]
        live += used
        key = "rocksdb" if name.startswith("rocksdb") else name
        out[key] = out.get(key, 0.0) + used / seconds
    out["ended"] = max(0.0, after[0][1] - before[0][1] - live) / seconds
    return out


def cores_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                  seconds: float) -> dict[str, float]:
    """Cores each role used between two `cpu_by_pid` samples (a process started in between
    counts from 0; one that ended in between is missing)."""
    out: dict[str, float] = {}
    for pid, (role, spent) in after.items():
        used = spent - before.get(pid, (role, 0.0))[1]
        out[role] = out.get(role, 0.0) + used / seconds
    return out


def sizes(data_dir: Path) -> dict[str, float]:
    """MiB per top-level entry of the data folder (operational file and WAL apart)."""
    out: dict[str, float] = {}
    for entry in data_dir.iterdir():
        if entry.is_file():
            total = entry.stat().st_size
        else:
            total = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
        out[entry.name] = total / 2**20
    return out


def writer_memory(data_dir: Path) -> dict[str, float]:
    """MiB by part of the writer's memory, from its metrics file (`tollgate_writer_memory_bytes`)."""
    try:
        text = (data_dir / "metrics" / "writer.prom").read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("tollgate_writer_memory_bytes{"):
            part = line.split('part="', 1)[1].split('"', 1)[0]
            out[part] = float(line.rsplit(" ", 1)[1]) / 2**20
    return out


_UPKEEP = ("tollgate_export_rounds_total", "tollgate_export_round_seconds_total",
           "tollgate_operational_checkpoints_total", "tollgate_operational_checkpoint_seconds_total",
           'tollgate_retention_deleted_rows_total{table="events"}')


def lake_state(data_dir: Path, last: dict[str, float]) -> str:
    """The export's lag (the age of the oldest row the lake does not hold yet) and the
    events the last round left behind, the lake's snapshots, and over the interval (`last`
    holds the counters of the one before, updated here) the export's rounds and their mean
    time, the file's checkpoints and their time, and the events that left the file, from
    the writer's metrics file."""
    try:
        text = (data_dir / "metrics" / "writer.prom").read_text()
    except OSError:
        return ""
    wanted = {"tollgate_export_lag_seconds": "export lag {:,.1f} s",
              'tollgate_export_rows_behind{stream="events"}': "events behind {:,.0f}",
              "tollgate_export_backlog_events": "backlog {:,.0f}",
              "tollgate_ingest_backlog_spells_total": "refusal spells {:,.0f}",
              "tollgate_ingest_pace_seconds": "pace {:,.3f} s",
              "tollgate_lake_snapshots": "lake snapshots {:,.0f}"}
    out = []
    now: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split(" ", 1)[0]
        if name in wanted:
            out.append(wanted[name].format(float(line.rsplit(" ", 1)[1])))
        elif name in _UPKEEP:
            now[name] = float(line.rsplit(" ", 1)[1])
    if len(now) == len(_UPKEEP):
        d = {k: now[k] - last.get(k, 0.0) for k in _UPKEEP}
        rounds, round_s, checkpoints, checkpoint_s, deleted = (d[k] for k in _UPKEEP)
        out.append(f"export rounds {rounds:,.0f} of {1000 * round_s / max(rounds, 1):,.0f} ms"
                   f" | checkpoints {checkpoints:,.0f} taking {checkpoint_s:,.1f} s"
                   f" | events left the file {deleted:,.0f}")
        last.update(now)
    return " | " + ", ".join(out) if out else ""


def _fmt(values: dict[str, float], floor: float = 1.0) -> str:
    return " ".join(f"{k}={v:,.0f}" for k, v in sorted(values.items()) if v >= floor)


# ---- the service ---------------------------------------------------------------------------
class Service:
    def __init__(self, data_dir: Path, port: int) -> None:
        self.data_dir = data_dir
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 600) -> float:
        """Start `tollgate serve`; the seconds until GET /healthz says ready."""
        log = open(self.data_dir.parent / "serve.log", "ab")  # noqa: SIM115 (the child holds it)
        t0 = time.monotonic()
        self.proc = subprocess.Popen([*CLI, "serve", "--port", str(self.port), "--data-dir",
                                      str(self.data_dir)], stdout=log, stderr=log, cwd=ROOT)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tollgate serve exited with {self.proc.returncode};"
                                   f" see {self.data_dir.parent / 'serve.log'}")
            if self.ready():
                return time.monotonic() - t0
            time.sleep(0.05)
        raise RuntimeError("the service did not become ready")

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                return b" 200 " in s.recv(200)
        except OSError:
            return False

    def stop(self, timeout: float = 30) -> tuple[float, int | None]:
        """SIGTERM; the seconds until the process exited and its code (None: killed)."""
        assert self.proc is not None
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        return time.monotonic() - t0, code


def wait_for_first_sweep(data_dir: Path, timeout: float = 300) -> float:
    """Seconds until the scheduler's metrics count a completed rate-events run."""
    t0 = time.monotonic()
    path = data_dir / "metrics" / "scheduler.prom"
    while time.monotonic() - t0 < timeout:
        try:
            text = path.read_text()
        except OSError:
            text = ""
        for line in text.splitlines():
            if (line.startswith("tollgate_flow_runs_total{") and 'flow="rate-events"' in line
                    and 'outcome="completed"' in line and float(line.rsplit(" ", 1)[1]) >= 1):
                return time.monotonic() - t0
        time.sleep(1)
    raise RuntimeError("no rate-events run completed within the timeout")


def make_folder(root: Path, gate_clients: int) -> tuple[Path, dict[str, str]]:
    data_dir = root / "data"
    catalog = root / "catalog.toml"
    catalog.write_text(catalog_text(gate_clients))
    subprocess.run([*CLI, "catalog", "apply", str(catalog), "--data-dir", str(data_dir)],
                   check=True, capture_output=True, cwd=ROOT)
    key = json.loads(subprocess.run([*CLI, "keys", "create", "--realm", REALM, "--data-dir",
                                     str(data_dir)], check=True, capture_output=True, text=True,
                                    cwd=ROOT).stdout)
    return data_dir, key


# ---- load ----------------------------------------------------------------------------------
class Load:
    def __init__(self, port: int, key: dict[str, str], batch_size: int, occurred: str) -> None:
        self.port = port
        self.key = key
        self.batch_size = batch_size
        self.occurred = occurred
        self.template = batch_template(batch_size, occurred)
        self.first_event = b""
        self.next = 0
        self.events = 0
        self.refused = 0
        self.refusals = 0  # batches answered other than 207 (refused whole)
        self.pairs = 0
        self.auth_lat: list[float] = []
        self.stop = False

    def signed(self, path: str, body: bytes, **who: str) -> dict[str, str]:
        return sign_headers(key_id=self.key["key_id"], secret=self.key["secret"], method="POST",
                            path=path, body=body, realm=REALM, **who)

    async def batches(self) -> None:
        conn = await Connection.open(self.port)
        path = "/mgt/v1/events/batch"
        while not self.stop:
            start, self.next = self.next, self.next + self.batch_size
            body = (self.template % batch_values(start, self.batch_size, self.occurred)).encode()
            if start == 0:
                self.first_event = json.dumps(json.loads(body)["events"][0]).encode()
            try:
                status, reply = await conn.request("POST", path, self.signed(
                    path, body, billing_account_id=ACCOUNT), body)
            except ConnectionError:
                status, reply = 0, b""
            if status != 207:
                # A refusal (503 STORAGE.BUSY: the ingest queue, or the lake export's backlog,
                # at its bound) is answered before the body is read, and the service closes
                # the connection the body was still arriving on: wait as Retry-After says
                # (1-2 s), on a new connection. The batch's numbers are not used again.
                self.refusals += 1
                conn.close()
                await asyncio.sleep(1.5)
                conn = await Connection.open(self.port)
            # A 207 counts what it accepted: when the storage refuses, every item says so.
            found = (_ACCEPTED.search(reply, max(0, len(reply) - 512))
                     or _ACCEPTED.search(reply)) if status == 207 else None
            accepted = int(found.group(1)) if found else 0
            self.events += accepted
            if accepted < self.batch_size:
                self.refused += self.batch_size - accepted
                if status == 207:
                    await asyncio.sleep(0.2)
        conn.close()

    async def gate(self, principal: str) -> None:
        conn = await Connection.open(self.port)
        auth = b'{"feature_code":"llm.chat","estimated_quantity_minor":"3"}'
        while not self.stop:
            t0 = time.perf_counter()
            status, reply = await conn.request("POST", "/mgt/v1/gate/authorize", self.signed(
                "/mgt/v1/gate/authorize", auth, principal_id=principal), auth)
            t1 = time.perf_counter()
            if status != 200:
                await asyncio.sleep(0.2)
                continue
            token = json.loads(reply)["data"]["lease_token"]
            body = json.dumps({"lease_token": token, "feature_code": "llm.chat",
                               "quantity_minor": "2"}).encode()
            status, _ = await conn.request("POST", "/mgt/v1/gate/commits", self.signed(
                "/mgt/v1/gate/commits", body, principal_id=principal), body)
            if status == 200:
                self.pairs += 1
                self.auth_lat.append(t1 - t0)
        conn.close()


# ---- the machine's speed -------------------------------------------------------------------
PROBE_EVENTS = 100
PROBE_SECONDS = 1.0


def _probe_work(body: bytes, decode: Any) -> float:
    """CPU seconds (this thread's) to decode and validate `body`'s events (which derives each
    event's id, a hash)."""
    from pipelines.events import ValidEvent, decode_event, validate_event

    now = datetime.now(timezone.utc)
    t0 = time.thread_time()
    for raw in decode(body)["events"]:
        ev = validate_event(decode_event(raw), realm=REALM, billing_account_id=ACCOUNT, now=now,
                            max_future_skew_seconds=300, floats_normalized=True)
        assert isinstance(ev, ValidEvent)
    return time.thread_time() - t0


def _speed_probe(body: bytes, cpu: int | None, conn: Any) -> None:
    """Until told to stop: every PROBE_SECONDS, the CPU time of one piece of work, on `cpu`."""
    import gc

    import msgspec

    gc.disable()  # a collection's pause is not the machine's speed
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    decode = msgspec.json.Decoder(dict[str, list[msgspec.Raw]]).decode
    for _ in range(5):
        _probe_work(body, decode)  # warm
    while not conn.poll(PROBE_SECONDS):
        _probe_work(body, decode)  # the caches this process lost while it slept
        conn.send(_probe_work(body, decode))


class SpeedProbe:
    """How fast the machine runs a fixed piece of work, one process pinned to each core (on a
    shared host one core can run at two thirds of the other's speed for seconds at a time,
    when its sibling on the host is busy). `take()` returns the median CPU seconds of the
    probes since the last call, averaged over the cores."""

    def __init__(self, body: bytes) -> None:
        import multiprocessing

        cpus: list[int | None] = (sorted(os.sched_getaffinity(0))
                                  if hasattr(os, "sched_getaffinity") else [None])
        self._pipes = []
        self._procs = []
        for cpu in cpus:
            ours, theirs = multiprocessing.Pipe()
            proc = multiprocessing.get_context("spawn").Process(
                target=_speed_probe, args=(body, cpu, theirs), daemon=True)
            proc.start()
            self._pipes.append(ours)
            self._procs.append(proc)

    def take(self) -> float:
        medians = []
        for pipe in self._pipes:
            times = []
            while pipe.poll():
                times.append(pipe.recv())
            if times:
                medians.append(sorted(times)[len(times) // 2])
        return sum(medians) / len(medians) if medians else float("nan")

    def close(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.send("stop")
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=5)


def writer_pid(root: int) -> int | None:
    return next((pid for pid in _descendants(root) if _role(pid) == "writer"), None)


async def sample_writer_rss(root: int, into: list[float], every: float = 0.5) -> None:
    """The writer's RSS in MiB every `every` seconds: within a second it moves by 100 MiB and
    more (each checkpoint of the operational file's WAL), so one sample an interval is a draw
    from that band; the interval's median and peak are not."""
    pid = writer_pid(root)
    while True:
        try:
            for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    into.append(int(line.split()[1]) / 1024)
                    break
        except (OSError, TypeError):
            pid = writer_pid(root)
        await asyncio.sleep(every)


async def drive(service: Service, load: Load, args: argparse.Namespace,
                rows: list[dict[str, Any]], probe: SpeedProbe | None = None) -> None:
    tasks = [asyncio.create_task(load.batches()) for _ in range(args.clients)]
    tasks += [asyncio.create_task(load.gate(f"soak-{i}")) for i in range(args.gate_clients)]
    t0 = last_t = time.monotonic()
    last_events = last_pairs = last_refusals = 0
    upkeep: dict[str, float] = {}  # the writer's upkeep counters at the last interval
    assert service.proc is not None
    last_cpu = cpu_by_pid(service.proc.pid)
    last_threads = writer_threads(writer_pid(service.proc.pid))
    samples: list[float] = []
    sampler = asyncio.create_task(sample_writer_rss(service.proc.pid, samples))
    end = t0 + args.minutes * 60
    while time.monotonic() < end:
        await asyncio.sleep(min(args.interval, max(0.0, end - time.monotonic())))
        now = time.monotonic()
        span = now - last_t
        lat = sorted(load.auth_lat)
        load.auth_lat = []
        cpu = cpu_by_pid(service.proc.pid)
        cores = cores_by_role(last_cpu, cpu, span)
        threads = writer_threads(writer_pid(service.proc.pid))
        by_thread = cores_by_thread(last_threads, threads, span)
        rss, folder = rss_by_role(service.proc.pid), sizes(service.data_dir)
        band = sorted(samples) or [float("nan")]
        samples.clear()
        writer_band = (band[0], band[len(band) // 2], band[-1])
        work = probe.take() if probe is not None else float("nan")
        speed = rows[0]["probe"] / work if rows else 1.0
        row = {"t": now - t0, "events_s": (load.events - last_events) / span, "probe": work,
               "speed": speed,
               "pairs_s": (load.pairs - last_pairs) / span, "stored": load.events,
               "auth_p50": percentile(lat, 0.5) * 1e3, "auth_p99": percentile(lat, 0.99) * 1e3,
               "rss": rss, "sizes": folder, "cores": cores, "writer_band": writer_band}
        rows.append(row)
        gate = (f" pairs/s={row['pairs_s']:,.0f} auth p50/p99={row['auth_p50']:.1f}/"
                f"{row['auth_p99']:.1f} ms" if args.gate_clients else "")
        refusals = load.refusals - last_refusals
        print(f"t={row['t']:5.0f}s events/s={row['events_s']:,.0f} speed={speed:.2f}"
              f" stored={load.events:,}{gate}"
              f"{f' refused batches={refusals:,}' if refusals else ''}"
              f" | RSS MiB {_fmt(rss)} | writer RSS min/median/max"
              f" {'/'.join(f'{v:,.0f}' for v in writer_band)} | data MiB {_fmt(folder)}"
              f" | cores {' '.join(f'{k}={v:.2f}' for k, v in sorted(cores.items()) if v >= 0.01)}"
              f" (sum {sum(cores.values()):.2f})"
              f" | writer threads {' '.join(f'{k}={v:.2f}' for k, v in sorted(by_thread.items(), key=lambda kv: -kv[1]) if v >= 0.01)}"
              f" | writer MiB {_fmt(writer_memory(service.data_dir))}"
              f"{lake_state(service.data_dir, upkeep)}", flush=True)
        last_t, last_events, last_pairs, last_cpu = now, load.events, load.pairs, cpu
        last_threads = threads
        last_refusals = load.refusals
    load.stop = True
    sampler.cancel()
    await asyncio.gather(*tasks, sampler, return_exceptions=True)


async def single(port: int, load: Load, body: bytes) -> tuple[int, dict[str, Any]]:
    conn = await Connection.open(port)
    try:
        status, reply = await conn.request("POST", "/mgt/v1/events", load.signed(
            "/mgt/v1/events", body, billing_account_id=ACCOUNT), body)
    finally:
        conn.close()
    return status, json.loads(reply)


def lake_count(data_dir: Path) -> int | None:
    out = subprocess.run([*CLI, "sql", "--format", "json", "--data-dir", str(data_dir),
                          "SELECT count(*) AS n FROM events"], capture_output=True, text=True,
                         cwd=ROOT)
    if out.returncode != 0:
        return None
    return int(json.loads(out.stdout)[0]["n"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=6, help="connections posting batches")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--gate-clients", type=int, default=0,
                        help="connections running authorize+commit pairs beside the batches")
    parser.add_argument("--interval", type=float, default=30, help="seconds between reports")
    parser.add_argument("--preload", type=int, default=0,
                        help="events written straight into the stores before the run")
    parser.add_argument("--keep", type=Path, default=None, help="keep the data folder here")
    parser.add_argument("--warm", action="store_true",
                        help="start the load once the schedules' first rate-events run has"
                             " completed, so that every minute measured has their work in it"
                             " (without it the first minute has none: the flows' Prefect API"
                             " starts during it)")
    parser.add_argument("--occurred", choices=OCCURRED, default="now",
                        help="the events' business time: now (the wall clock, microseconds) or"
                             " hour (one business hour's whole seconds in turn, the shape of"
                             " the runs recorded before 2026-11-28)")
    args = parser.parse_args(argv)

    root = args.keep or Path(tempfile.mkdtemp(prefix="tollgate-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    data_dir, key = make_folder(root, args.gate_clients)
    service = Service(data_dir, free_port())
    print(f"nproc={os.cpu_count()} python={sys.version.split()[0]} minutes={args.minutes:g}"
          f" clients={args.clients} batch={args.batch_size} gate_clients={args.gate_clients}"
          f" preload={args.preload:,} warm={args.warm} occurred={args.occurred}"
          f" workers={os.environ.get('TOLLGATE_WORKERS', 'default')}",
          flush=True)

    from bench.ingest import raw_limit

    template = batch_template(args.batch_size, args.occurred)
    raw_bodies = [(template % batch_values(10**12 + i * args.batch_size, args.batch_size,
                                           args.occurred)).encode()
                  for i in range(30)]
    raw = raw_limit(raw_bodies)
    print(f"raw limit (in-process decode+validate+hash+Arrow insert, same events): {raw:,.0f} events/s",
          flush=True)

    preloaded: dict[str, Any] | None = None
    if args.preload:
        service.start()
        service.stop()
        from bench.preload import preload  # written straight into the stores

        t0 = time.monotonic()
        preloaded = preload(data_dir, args.preload)
        print(f"preloaded {args.preload:,} events in {time.monotonic() - t0:,.0f} s", flush=True)

    first_start = service.start()
    assert service.proc is not None
    print(f"ready after {first_start:.1f} s; RSS MiB {_fmt(rss_by_role(service.proc.pid))}",
          flush=True)
    if args.warm:
        waited = wait_for_first_sweep(data_dir)
        print(f"warm: the schedules' first rate-events run completed {waited:.0f} s after ready;"
              f" RSS MiB {_fmt(rss_by_role(service.proc.pid))}", flush=True)
    load = Load(service.port, key, args.batch_size, args.occurred)
    rows: list[dict[str, Any]] = []
    probe = SpeedProbe((batch_template(PROBE_EVENTS, args.occurred)
                        % batch_values(2 * 10**12, PROBE_EVENTS, args.occurred)).encode())
    try:
        try:
            run(drive(service, load, args, rows, probe))
        finally:
            probe.close()
        stop_s, code = service.stop()
        print(f"SIGTERM: exited in {stop_s:.1f} s with {'SIGKILL (did not exit)' if code is None else code}",
              flush=True)
        # The same measure again, the service stopped: how the machine runs the raw path's
        # memory-heavy work (DuckDB's insert) now, against before the load.
        raw_after = raw_limit(raw_bodies)
        print(f"raw limit after the load (service stopped): {raw_after:,.0f} events/s"
              f" ({raw_after / raw:.0%} of before)", flush=True)
        restart = service.start()
        rss_at = {}
        for after in (0.0, 20.0):
            time.sleep(after)
            rss_at[after] = rss_by_role(service.proc.pid)
        print(f"restart: ready after {restart:.1f} s; RSS MiB at ready {_fmt(rss_at[0.0])};"
              f" 20 s later {_fmt(rss_at[20.0])}", flush=True)
        status, reply = run(single(service.port, load, load.first_event))
        print(f"dedupe: first event of the run sent again -> {status}"
              f" {'duplicate' if status == 200 else reply.get('code')}", flush=True)
        if preloaded is not None:
            body = json.dumps(preloaded["first_event"]).encode()
            status, reply = run(single(service.port, load, body))
            print(f"dedupe: first event of the preloaded history sent again -> {status}"
                  f" {'duplicate' if status == 200 else reply.get('code')}", flush=True)
        expected = load.events + (args.preload or 0)
        deadline = time.monotonic() + 300
        count = lake_count(data_dir)
        while count != expected and time.monotonic() < deadline:
            time.sleep(5)
            count = lake_count(data_dir)
        print(f"lake: {count:,} events of {expected:,} accepted"
              f" ({'none lost' if count == expected else 'MISSING'}); refused {load.refused:,}",
              flush=True)
    finally:
        if service.proc is not None and service.proc.poll() is None:
            service.stop()
    if rows:
        first, last = rows[0], rows[-1]
        at_speed = last["events_s"] / max(first["events_s"], 1) / last["speed"]
        minute2 = next((r for r in rows if r["t"] >= 120), rows[0])
        w2, wl = minute2["rss"].get("writer", 0.0), last["rss"].get("writer", 0.0)
        (_, m2, p2), (_, ml, pl) = minute2["writer_band"], last["writer_band"]
        top = max(r["writer_band"][2] for r in rows)
        print(f"summary: first interval {first['events_s']:,.0f} events/s ({first['events_s'] / raw:.0%}"
              f" of raw), last {last['events_s']:,.0f} ({last['events_s'] / max(first['events_s'], 1):.0%}"
              f" of the first; target >= 90%; {at_speed:.0%} at the first interval's machine speed),"
              f" {last['events_s'] / max(minute2['events_s'], 1):.0%}"
              f" of the interval at {minute2['t']:.0f} s (the first with the schedules' sweeps"
              f" running); writer RSS {w2:,.0f} MiB at {minute2['t']:.0f} s,"
              f" {wl:,.0f} MiB at the end ({wl / max(w2, 1) - 1:+.0%}; target within 10%);"
              f" over the interval (samples every 0.5 s) median {m2:,.0f} -> {ml:,.0f} MiB"
              f" ({ml / max(m2, 1) - 1:+.0%}), peak {p2:,.0f} -> {pl:,.0f} MiB"
              f" ({pl / max(p2, 1) - 1:+.0%}), highest peak {top:,.0f} MiB;"
              f" stop {stop_s:.1f} s (target <= 10 s, exit 0); restart {restart:.1f} s (target <= 10 s)")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
