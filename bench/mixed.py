"""The gate next to event ingestion: one `tollgate serve`, started as users start it (its
defaults, the flow schedules on), and in one run these phases, each `--seconds` long:

    batch alone      6 connections posting 1000-event batches of events never sent before
    gate alone       4 connections running authorize+commit pairs (one principal each)
    batch + gate     both at once
    singles alone    6 connections posting single events
    singles + gate   both at once
    sweep + gate     the gate while `tollgate flows run rate-events` rates what the phases stored

Per phase it prints gate pairs/s, authorize p50/p99, events/s, the HTTP loop's wait (a
GET /healthz probe every 20 ms, which needs no writer), and where a gate call's time goes
from the service's own metrics: the writer's reply time per lane as the HTTP process sees it,
the writer's group time and groups a second per lane, and the journal commit (append and
fdatasync). Then the ratios of issue 17 item 1, `nproc`, the worker count, and the raw
limits measured in the same run: GET /healthz per second on the same server and client
(the HTTP limit), the in-process decode+validate+hash+insert rate of batches
(bench/ingest.py's raw limit), and the cores limit: the cores 70 % of each phase alone would
take at once, from the cores each process used in the phases alone, against `nproc`.

    python bench/mixed.py [--seconds 10] [--no-sweep]

`TOLLGATE_WORKERS`, when set, reaches the service through the environment, and `--workers`
is passed to `tollgate serve` when it has that option.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from api.auth import sign_headers  # noqa: E402
from bench.gate import bench_catalog  # noqa: E402
from bench.ingest import raw_limit  # noqa: E402
from bench.loopback import ROOT, Connection, Server, percentile, run, start_server  # noqa: E402
from bench.soak import cores_by_role, cpu_by_pid  # noqa: E402

GATE_CLIENTS = 4
INGEST_CLIENTS = 6
BATCH_SIZE = 1000
EVENT_ACCOUNT = "acct_0"
# One event's JSON; the run id and a counter make every event of every run new.
_EVENT = ('{"semantic_kind":"activity","event_type":"llm.completion",'
          '"occurred_at":"2026-11-20T10:%02d:%02dZ","subject_ref":"mix-%s-%d",'
          '"payload":{"schema":2,"model":"m-large","usage":{"input_tokens":%d,"output_tokens":%d}},'
          '"labels":{"env":"prod","region":"eu-west"}}')


class Events:
    """Never-repeated events, made as they are sent (a few microseconds each)."""

    def __init__(self, run_id: str | None = None, start: int = 0) -> None:
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.n = start

    def one(self) -> bytes:
        i = self.n = self.n + 1
        return (_EVENT % (i // 60 % 60, i % 60, self.run_id, i, 1000 + i % 977, 200 + i % 311)).encode()

    def batch(self, size: int) -> bytes:
        return b'{"events":[' + b",".join(self.one() for _ in range(size)) + b"]}"


@dataclass
class Tally:
    auth: list[float] = field(default_factory=list)
    pairs: int = 0
    events: int = 0
    refused: int = 0  # 503/429 answers to event posts (backpressure)
    probe: list[float] = field(default_factory=list)


def _signed(server: Server, path: str, body: bytes, **context: str) -> dict[str, str]:
    return sign_headers(key_id=server.key_id, secret=server.secret, method="POST", path=path, body=body,
                        realm="acme", **context)


async def _back_off(status: int) -> None:
    """A refused post waits before the next (a client would honour Retry-After; this one
    keeps the load on)."""
    await asyncio.sleep(0.2 if status == 503 else 0.05)


async def gate_loop(server: Server, principal: str, until: float, tally: Tally) -> None:
    conn = await Connection.open(server.port)
    auth_body = json.dumps({"feature_code": "api.search", "estimated_quantity_minor": "3"}).encode()
    while time.perf_counter() < until:
        t0 = time.perf_counter()
        status, reply = await conn.request("POST", "/mgt/v1/gate/authorize",
                                           _signed(server, "/mgt/v1/gate/authorize", auth_body,
                                                   principal_id=principal), auth_body)
        t1 = time.perf_counter()
        assert status == 200, reply[:300]
        token = json.loads(reply)["data"]["lease_token"]
        body = json.dumps({"lease_token": token, "feature_code": "api.search", "quantity_minor": "2"}).encode()
        status, reply = await conn.request("POST", "/mgt/v1/gate/commits",
                                           _signed(server, "/mgt/v1/gate/commits", body,
                                                   principal_id=principal), body)
        assert status == 200, reply[:300]
        tally.auth.append(t1 - t0)
        tally.pairs += 1
    conn.close()


async def ingest_loop(server: Server, events: Events, until: float, tally: Tally,
                      kind: str) -> None:
    """One connection posting `kind` ("batch": 1000-event batches, else single events) until
    `until`; refusals (429, 503) back off and count."""
    conn = await Connection.open(server.port)
    batch = kind == "batch"
    path = "/mgt/v1/events/batch" if batch else "/mgt/v1/events"
    while time.perf_counter() < until:
        body = events.batch(BATCH_SIZE) if batch else events.one()
        status, reply = await conn.request("POST", path, _signed(server, path, body,
                                                                 billing_account_id=EVENT_ACCOUNT), body)
        if status in (429, 503):
            tally.refused += 1
            await _back_off(status)
            continue
        assert status == (207 if batch else 201), reply[:300]
        tally.events += json.loads(reply)["data"]["accepted_count"] if batch else 1
    conn.close()


async def probe_loop(server: Server, until: float, tally: Tally) -> None:
    """The HTTP loop's wait: an unsigned GET /healthz (no writer) every 20 ms."""
    conn = await Connection.open(server.port)
    while time.perf_counter() < until:
        t0 = time.perf_counter()
        status, _ = await conn.request("GET", "/healthz", {}, b"")
        tally.probe.append(time.perf_counter() - t0)
        await asyncio.sleep(0.02)
    conn.close()


async def scrape(server: Server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    conn = await Connection.open(server.port)
    status, body = await conn.request("GET", "/metrics", {}, b"")
    conn.close()
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    if status != 200:
        return found
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count", "_bucket")):
                # A bucket's bound goes into its name, so the workers' samples add up per bound.
                name = sample.name + (f"@{sample.labels['le']}" if "le" in sample.labels else "")
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                found[(name, labels)] = found.get((name, labels), 0.0) + sample.value
    return found


def _total(samples: dict, name: str, labels: dict[str, str]) -> float:
    """The sum of `name` over every label set that has `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, key), v in samples.items() if n == name and wanted <= set(key))


def _p99_ms(before: dict, after: dict, name: str, **labels: str) -> str:
    """The histogram's 99th percentile over the phase, as the bucket bound that holds it
    ("<=10": 99 % took at most 10 ms; ">2500": beyond the last bound)."""
    bounds = sorted({n.partition("@")[2] for n, _ in after if n.startswith(f"{name}_bucket@")},
                    key=float)
    counts = [_total(after, f"{name}_bucket@{b}", labels) - _total(before, f"{name}_bucket@{b}", labels)
              for b in bounds]
    if not counts or counts[-1] <= 0:
        return "-"
    for bound, count in zip(bounds, counts, strict=True):
        if count >= 0.99 * counts[-1]:
            return "<=inf" if bound == "+Inf" else f"<={float(bound) * 1000:g}"
    return "-"


def _mean_ms(before: dict, after: dict, name: str, **labels: str) -> str:
    count = _total(after, f"{name}_count", labels) - _total(before, f"{name}_count", labels)
    total = _total(after, f"{name}_sum", labels) - _total(before, f"{name}_sum", labels)
    return f"{total / count * 1000:.2f}" if count > 0 else "-"


def _per_s(before: dict, after: dict, name: str, seconds: float, **labels: str) -> str:
    count = _total(after, name, labels) - _total(before, name, labels)
    return f"{count / seconds:,.0f}" if count > 0 else "-"


@dataclass
class Phase:
    name: str
    seconds: float
    tally: Tally
    metrics: tuple[dict, dict]
    cores: dict[str, float] = field(default_factory=dict)

    @property
    def pairs_per_s(self) -> float:
        return self.tally.pairs / self.seconds

    @property
    def events_per_s(self) -> float:
        return self.tally.events / self.seconds

    def p(self, q: float) -> float:
        return percentile(sorted(self.tally.auth), q) * 1000


def _ingest_process(server: Server, kind: str, run_id: str, start: int, pipe: Any) -> None:
    """The event load, in a process of its own: making 1000-event bodies and reading their
    replies takes milliseconds of a loop, which would otherwise delay the gate client's
    clock readings and show in the authorize latencies."""
    events = Events(run_id, start)
    tally = Tally()
    pipe.send("ready")
    until = pipe.recv()
    async def load() -> None:
        await asyncio.gather(*(ingest_loop(server, events, until, tally, kind)
                               for _ in range(INGEST_CLIENTS)))

    run(load())
    pipe.send((tally.events, tally.refused, sum(os.times()[:2])))


async def run_phase(server: Server, name: str, seconds: float, events: Events, *, gate: bool,
                    ingest: str | None, sweep: bool = False) -> Phase:
    tally = Tally()
    before = await scrape(server)
    sweeper = loader = None
    if sweep:
        # Its own Prefect server, which ends with the run (none is kept for the next).
        sweeper = subprocess.Popen([sys.executable, "-m", "cli", "flows", "run", "rate-events",
                                    "--data-dir", str(server.data_dir)], cwd=ROOT,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env={**os.environ, "TOLLGATE_PREFECT_API_IDLE_SECONDS": "0"})
    if ingest is not None:
        ours, theirs = multiprocessing.Pipe()
        events.n += 10_000_000  # each phase's events are new
        loader = multiprocessing.get_context("spawn").Process(
            target=_ingest_process, args=(replace(server, proc=cast(Any, None)), ingest, events.run_id, events.n, theirs))
        loader.start()
        await asyncio.get_running_loop().run_in_executor(None, ours.recv)  # it has started
    cpu_before = cpu_by_pid(server.proc.pid)
    t0 = time.perf_counter()
    until = t0 + seconds
    if loader is not None:
        ours.send(until)
    tasks = [probe_loop(server, until, tally)]
    if gate:
        tasks += [gate_loop(server, f"solo-{i}", until, tally) for i in range(GATE_CLIENTS)]
    await asyncio.gather(*tasks)
    loader_cpu = 0.0
    if loader is not None:
        tally.events, tally.refused, loader_cpu = await asyncio.get_running_loop().run_in_executor(
            None, ours.recv)
        loader.join()
    elapsed = time.perf_counter() - t0
    cores = cores_by_role(cpu_before, cpu_by_pid(server.proc.pid), elapsed)
    cores.pop("flow", None)  # the sweep's own processes end before this sample
    cores["gate-load"] = cores.pop("load")  # this process: the gate's clients and the probe
    if loader_cpu:
        cores["event-load"] = loader_cpu / elapsed
    if sweeper is not None:
        sweeper.wait()
    after = await scrape(server)
    return Phase(name, elapsed, tally, (before, after), cores)


async def hello_rate(server: Server, seconds: float) -> float:
    done = [0]
    until = time.perf_counter() + seconds

    async def worker() -> None:
        conn = await Connection.open(server.port)
        while time.perf_counter() < until:
            status, _ = await conn.request("GET", "/healthz", {}, b"")
            assert status == 200
            done[0] += 1
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(GATE_CLIENTS)))
    return done[0] / (time.perf_counter() - t0)


def _serve_has_workers() -> bool:
    out = subprocess.run([sys.executable, "-m", "cli", "serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True).stdout
    return "--workers" in out


def report(phase: Phase) -> str:
    t = phase.tally
    before, after = phase.metrics
    gate = (f"{phase.pairs_per_s:6,.0f} pairs/s  authorize p50 {phase.p(.5):6.1f} ms p99 {phase.p(.99):7.1f} ms"
            if t.pairs else f"{'-':>6} pairs/s  {'':>37}")
    ingest = f"{phase.events_per_s:8,.0f} events/s" if t.events else f"{'-':>8} events/s"
    refused = f" ({t.refused} refused)" if t.refused else ""
    probe = sorted(t.probe)
    where = (f"    loop wait p50 {percentile(probe, .5) * 1000:.1f} p99 {percentile(probe, .99) * 1000:.1f} ms;"
             f" writer reply gate {_mean_ms(before, after, 'tollgate_writer_reply_seconds', lane='gate')}"
             f" ingest {_mean_ms(before, after, 'tollgate_writer_reply_seconds', lane='ingest')} ms;"
             f" group gate {_mean_ms(before, after, 'tollgate_writer_group_seconds', lane='gate')}"
             f" ingest {_mean_ms(before, after, 'tollgate_writer_group_seconds', lane='ingest')}"
             f" (all {_mean_ms(before, after, 'tollgate_writer_group_seconds')}) ms;"
             f" commit {_mean_ms(before, after, 'tollgate_writer_commit_seconds')} ms (means);"
             f" groups/s gate {_per_s(before, after, 'tollgate_writer_group_seconds_count', phase.seconds, lane='gate')}"
             f" ingest {_per_s(before, after, 'tollgate_writer_group_seconds_count', phase.seconds, lane='ingest')}")
    if t.pairs:
        # Where the authorize tail is: the server's own time for the route (arrival to last
        # byte), the writer's reply to the gate lane, and the groups of each lane.
        where += (f"\n    p99 (histogram bucket) authorize in the server"
                  f" {_p99_ms(before, after, 'tollgate_http_request_seconds', route='/mgt/v1/gate/authorize')} ms;"
                  f" writer reply gate {_p99_ms(before, after, 'tollgate_writer_reply_seconds', lane='gate')} ms;"
                  f" group gate {_p99_ms(before, after, 'tollgate_writer_group_seconds', lane='gate')}"
                  f" ingest {_p99_ms(before, after, 'tollgate_writer_group_seconds', lane='ingest')} ms;"
                  f" commit {_p99_ms(before, after, 'tollgate_writer_commit_seconds')} ms")
    cores = " ".join(f"{role}={used:.2f}" for role, used in sorted(phase.cores.items()) if used >= 0.005)
    where += f"\n    cores {cores} (sum {sum(phase.cores.values()):.2f})"
    return f"{phase.name:15}: {gate}  {ingest}{refused}\n{where}"


def ratios(alone_gate: Phase, alone_ingest: Phase, both: Phase) -> str:
    p99 = both.p(.99)
    p50 = both.p(.5) / alone_gate.p(.5)
    pairs = both.pairs_per_s / alone_gate.pairs_per_s
    ingest = both.events_per_s / alone_ingest.events_per_s if alone_ingest.events_per_s else float("nan")

    def mark(ok: bool) -> str:
        return "ok" if ok else "FAIL"

    return (f"{both.name:15}: authorize p99 {p99:.1f} ms (< 20: {mark(p99 < 20)}), "
            f"p50 {p50:.2f}x alone (<= 2: {mark(p50 <= 2)}), pairs/s {pairs:.0%} of alone "
            f"(>= 70%: {mark(pairs >= .7)}), events/s {ingest:.0%} of alone (>= 70%: {mark(ingest >= .7)})")


def cores_limit(alone_gate: Phase, alone_ingest: Phase, both: Phase) -> str:
    """The raw limit of item 1's throughput half on this machine: the cores that 70 % of each
    phase alone would take at once, against the cores there are (the service's own, and with
    this bench's clients, which run on the same machine)."""
    def service(phase: Phase) -> float:
        return sum(v for k, v in phase.cores.items() if not k.endswith("-load"))

    def total(phase: Phase) -> float:
        return sum(phase.cores.values())

    need = 0.7 * service(alone_gate) + 0.7 * service(alone_ingest)
    need_all = 0.7 * total(alone_gate) + 0.7 * total(alone_ingest)
    return (f"{both.name:15}: 70% of both alone needs {need:.2f} cores of the service's"
            f" ({service(alone_gate):.2f} gate alone, {service(alone_ingest):.2f} {alone_ingest.name}),"
            f" {need_all:.2f} with the clients; this machine has {os.cpu_count()};"
            f" the phase used {service(both):.2f} ({total(both):.2f} with the clients)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--no-sweep", action="store_true", help="skip the sweep + gate phase")
    args = parser.parse_args()
    workers = os.environ.get("TOLLGATE_WORKERS", "")
    serve_args: tuple[str, ...] = ()
    if workers and _serve_has_workers():
        serve_args = ("--workers", workers)
    print(f"nproc={os.cpu_count()}  python={sys.version.split()[0]}  "
          f"workers={workers or 'default'}{' (--workers)' if serve_args else ''}  schedules=on  "
          f"{args.seconds:g} s a phase")
    catalog = bench_catalog(GATE_CLIENTS)
    server = start_server(catalog, schedules=True, args=serve_args)
    shutil.rmtree(catalog.parent, ignore_errors=True)
    events = Events()
    phases: dict[str, Phase] = {}
    try:
        run(run_phase(server, "warm-up", 2, events, gate=True, ingest="single"))
        plan = [("batch alone", False, "batch"), ("gate alone", True, None), ("batch + gate", True, "batch"),
                ("singles alone", False, "single"), ("singles + gate", True, "single")]
        for name, gate, ingest in plan:
            phases[name] = run(run_phase(server, name, args.seconds, events, gate=gate, ingest=ingest))
            print(report(phases[name]), flush=True)
        if not args.no_sweep:
            phases["sweep + gate"] = run(run_phase(server, "sweep + gate", args.seconds, events, gate=True,
                                                   ingest=None, sweep=True))
            print(report(phases["sweep + gate"]), flush=True)
        hello = run(hello_rate(server, 3))
    finally:
        server.stop()
    raw = raw_limit([events.batch(BATCH_SIZE) for _ in range(20)])
    print("item 1 (isolation), each against its phase alone:")
    print(ratios(phases["gate alone"], phases["batch alone"], phases["batch + gate"]))
    print(ratios(phases["gate alone"], phases["singles alone"], phases["singles + gate"]))
    print("cores limit of item 1's throughput half (cores each phase used alone, x 0.7, summed):")
    print(cores_limit(phases["gate alone"], phases["batch alone"], phases["batch + gate"]))
    print(cores_limit(phases["gate alone"], phases["singles alone"], phases["singles + gate"]))
    if "sweep + gate" in phases:
        sweep = phases["sweep + gate"]
        print(f"{'sweep + gate':15}: authorize p99 {sweep.p(.99):.1f} ms, "
              f"p50 {sweep.p(.5) / phases['gate alone'].p(.5):.2f}x alone, "
              f"pairs/s {sweep.pairs_per_s / phases['gate alone'].pairs_per_s:.0%} of alone")
    print(f"HTTP limit     : {hello:8,.0f} requests/s GET /healthz, same server, {GATE_CLIENTS} connections")
    print(f"raw limit      : {raw:8,.0f} events/s in-process decode+validate+hash+insert, no HTTP")


if __name__ == "__main__":
    main()
