"""Observability (docs/operations.md): GET /metrics after real traffic, the JSON log lines of
every process of `tollgate serve`, the access log, and trace ids on error lines."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Service, make_service

LOG_FIELDS = {"ts", "level", "logger", "process", "pid", "message"}


def scrape(service: Service) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = httpx.get(service.base_url + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    """`name` summed over its label sets (the writer's group metrics have one per lane)."""
    return sum(v for (n, _), v in samples.items() if n == name)


def requests_of(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], route: str,
                status: int, method: str = "POST") -> float:
    return value(samples, "tollgate_http_requests_total", method=method, route=route,
                 status=str(status))


def event() -> dict[str, Any]:
    return {"semantic_kind": "activity", "event_type": "llm.completion",
            "occurred_at": "2026-11-20T10:00:00Z", "subject_ref": f"job-{uuid.uuid4()}",
            "payload": {"usage": {"input_tokens": 1200, "output_tokens": 300}}}


def log_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def test_metrics_count_the_calls_made(service: Service) -> None:
    time.sleep(0.6)  # the writer's file shows the ops of earlier tests (it is written every 0.25 s)
    before = scrape(service)
    tokens = []
    for _ in range(3):
        r = service.post("/mgt/v1/gate/authorize",
                         {"feature_code": "gate.unit", "estimated_quantity_minor": "10"},
                         principal="team-c")
        assert r.status_code == 200, r.text
        tokens.append(r.json()["data"]["lease_token"])
    r = service.post("/mgt/v1/gate/commits", {"lease_token": tokens[0], "feature_code": "gate.unit",
                                              "quantity_minor": "10"}, principal="team-c")
    assert r.status_code == 200, r.text
    for _ in range(2):
        r = service.post("/mgt/v1/events", event(), account="acct_events")
        assert r.status_code == 201, r.text
    refused = httpx.post(service.base_url + "/mgt/v1/gate/authorize", content=b"{}")
    assert refused.status_code in (400, 401)
    assert httpx.get(service.base_url + "/healthz").status_code == 200

    # The writer writes its metrics on its tick (0.25 s): wait for all six ops to show.
    deadline = time.monotonic() + 10
    while True:
        after = scrape(service)
        ops = total(after, "tollgate_writer_group_ops_sum") - total(before, "tollgate_writer_group_ops_sum")
        if ops >= 6 or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    def moved(route: str, status: int, method: str = "POST") -> float:
        return requests_of(after, route, status, method) - requests_of(before, route, status, method)

    assert moved("/mgt/v1/gate/authorize", 200) == 3
    assert moved("/mgt/v1/gate/authorize", refused.status_code) == 1
    assert moved("/mgt/v1/gate/commits", 200) == 1
    assert moved("/mgt/v1/events", 201) == 2
    assert moved("/healthz", 200, "GET") == 1
    assert moved("/mgt/v1/gate/cancel", 200) == 0
    # The latency histogram counted the same requests, per route and status.
    labels = {"method": "POST", "route": "/mgt/v1/gate/authorize", "status": "200"}
    count = "tollgate_http_request_seconds_count"
    assert value(after, count, **labels) - value(before, count, **labels) == 3
    assert value(after, "tollgate_http_request_seconds_bucket", **labels, le="+Inf") == \
        value(after, count, **labels)
    # Six ops reached the writer (the refused call did not), in one to six groups.
    assert ops == 6
    # Per lane: the four gate calls in the gate's groups, the two events in the ingest lane's.
    for lane, count in (("gate", 4), ("ingest", 2)):
        assert value(after, "tollgate_writer_group_ops_sum", lane=lane) - \
            value(before, "tollgate_writer_group_ops_sum", lane=lane) == count
        assert value(after, "tollgate_writer_reply_seconds_count", lane=lane) - \
            value(before, "tollgate_writer_reply_seconds_count", lane=lane) == count
    groups = total(after, "tollgate_writer_group_ops_count") - total(before, "tollgate_writer_group_ops_count")
    assert 1 <= groups <= 6
    assert total(after, "tollgate_writer_group_seconds_count") - \
        total(before, "tollgate_writer_group_seconds_count") == groups
    assert any(name == "tollgate_writer_group_seconds_bucket" for name, _ in after)
    for name in ("tollgate_journal_backlog_groups", "tollgate_journal_backlog_bytes",
                 "tollgate_journal_apply_failures_total", "tollgate_export_lag_seconds",
                 "tollgate_writer_queue_depth", "tollgate_writer_ops_in_flight",
                 "tollgate_writer_last_tick_age_seconds"):
        assert any(n == name for n, _ in after), name
    assert value(after, "tollgate_journal_apply_failures_total") == 0
    assert value(after, "tollgate_writer_last_tick_age_seconds") < 5
    for process in ("http", "writer"):
        assert value(after, "tollgate_process_resident_memory_bytes", process=process) > 10 << 20
    # Where the writer's memory is: every part read, each a plausible size (the memtables hold
    # at least the two events; glibc's heap holds at least the Python objects of the loop).
    parts = {dict(labels)["part"]: v for (n, labels), v in after.items()
             if n == "tollgate_writer_memory_bytes"}
    assert {"duckdb_buffers", "index_block_cache", "index_memtables", "index_table_readers",
            "heap_in_use", "heap_kept_free"} <= set(parts), parts
    assert parts["index_memtables"] > 0 and parts["heap_in_use"] > 1 << 20
    assert sum(parts.values()) < value(after, "tollgate_process_resident_memory_bytes",
                                       process="writer") * 2


def test_access_and_error_lines_carry_the_trace_id(service: Service) -> None:
    trace = f"obs-{uuid.uuid4().hex}"
    refused = httpx.post(service.base_url + "/mgt/v1/gate/authorize", content=b"{}",
                         headers={"X-Request-Id": trace})
    assert refused.status_code >= 400 and refused.json()["trace_id"] == trace
    lost = httpx.get(service.base_url + "/no/such/route", headers={"X-Request-Id": trace + "x"})
    assert lost.status_code == 404
    assert service.log_path is not None
    deadline = time.monotonic() + 5
    while True:
        lines = log_lines(service.log_path)
        mine = [line for line in lines if line.get("trace_id") in (trace, trace + "x")]
        if len(mine) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    by_trace = {line["trace_id"]: line for line in mine}
    line = by_trace[trace]
    assert line["logger"] == "tollgate.access" and line["process"] == "http"
    assert (line["method"], line["path"], line["route"], line["status"]) == \
        ("POST", "/mgt/v1/gate/authorize", "/mgt/v1/gate/authorize", refused.status_code)
    assert line["bytes"] == len(refused.content) and line["duration_ms"] >= 0
    assert by_trace[trace + "x"]["route"] == "unmatched"


def test_an_unhandled_error_is_logged_with_its_trace_id() -> None:
    from api.envelope import error_reply
    from core.logs import JsonFormatter

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("http"))
    logger = logging.getLogger("tollgate.api")
    logger.addHandler(handler)
    try:
        reply = error_reply("trace-500", RuntimeError("boom"))
    finally:
        logger.removeHandler(handler)
    assert reply.status_code == 500
    (line,) = [json.loads(text) for text in out.getvalue().splitlines()]
    assert line["trace_id"] == "trace-500" and line["level"] == "ERROR"
    assert "RuntimeError: boom" in line["exc"] and line["ts"].endswith("Z")


@pytest.mark.server
def test_a_serve_start_logs_json_lines_from_every_process(tmp_path: Path) -> None:
    svc = make_service(tmp_path)
    err = tmp_path / "serve.err"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TOLLGATE_LOG_FORMAT", None)
    with open(err, "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(svc.port),
                                 "--data-dir", str(tmp_path)],
                                stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    try:
        deadline = time.monotonic() + 60
        seen: set[str] = set()
        while time.monotonic() < deadline and not {"http", "writer", "scheduler", "access"} <= seen:
            assert proc.poll() is None, err.read_text()
            try:
                httpx.get(f"{svc.base_url}/healthz", timeout=1)
            except httpx.HTTPError:
                pass
            seen = {"access" if line["logger"] == "tollgate.access" else line["process"]
                    for line in log_lines(err)}
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = err.read_text()
    lines = text.splitlines()
    assert lines and all(line.startswith("{") for line in lines), text[:2000]
    parsed = [json.loads(line) for line in lines]
    assert {"http", "writer", "scheduler"} <= {p["process"] for p in parsed}
    for record in parsed:
        assert LOG_FIELDS <= set(record), record
        assert record["ts"].endswith("Z") and "T" in record["ts"]
    assert any(p["logger"] == "tollgate.access" and "trace_id" in p for p in parsed)


@pytest.mark.server
@pytest.mark.prefect
def test_the_scheduler_and_the_exporter_report_their_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import stop_local_prefect_apis

    for name in [k for k in os.environ if k.startswith("PREFECT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    monkeypatch.setenv("TOLLGATE_SCHEDULES", "on")
    monkeypatch.setenv("TOLLGATE_SCHEDULE_SECONDS", "rate-events=2")
    svc = make_service(tmp_path / "data")
    svc.start()
    try:
        assert svc.post("/mgt/v1/events", event(), account="acct_events").status_code == 201
        deadline = time.monotonic() + 120
        while True:
            samples = scrape(svc)
            done = value(samples, "tollgate_flow_runs_total", flow="rate-events", outcome="completed")
            exported = value(samples, "tollgate_export_rows_total", stream="events")
            if (done >= 1 and exported >= 1) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert exported == 1
        assert done >= 1, svc.log_path.read_text()[-3000:] if svc.log_path else ""
        assert value(samples, "tollgate_flow_last_success_timestamp_seconds", flow="rate-events") > 0
        assert value(samples, "tollgate_process_resident_memory_bytes", process="scheduler") > 0
        assert ("tollgate_sweep_lag_seconds", frozenset()) in samples
        assert value(samples, "tollgate_export_lag_seconds") < 30
        assert value(samples, "tollgate_export_events_last_timestamp_seconds") > 0
        # The exporter's first round (at the writer's start) expired the lake's old snapshots
        # and counted those kept: the lake's creation made some.
        assert value(samples, "tollgate_lake_snapshots") >= 1
        assert value(samples, "tollgate_lake_expire_failures_total") == 0
        # The round that shipped the event was counted and timed; the file's upkeep is shown
        # (nothing has left it: the window is an hour).
        assert value(samples, "tollgate_export_rounds_total") >= 1
        assert value(samples, "tollgate_export_round_seconds_total") > 0
        assert value(samples, "tollgate_retention_deleted_rows_total", table="events") == 0
        assert value(samples, "tollgate_operational_checkpoint_failures_total") == 0
        assert ("tollgate_operational_checkpoints_total", frozenset()) in samples
    finally:
        svc.stop()
        stop_local_prefect_apis(tmp_path)


def test_metrics_can_be_moved_or_turned_off(tmp_path: Path) -> None:
    from api.app import create_app
    from core.settings import Settings

    def paths(metrics: str) -> set[str]:
        return {route.path for route in create_app(Settings(tmp_path, metrics=metrics)).routes}

    assert "/metrics" in paths("on")
    assert "/metrics" not in paths("off")
    assert "/metrics" not in paths("127.0.0.1:9108")  # served on that address instead


def test_text_format_is_one_readable_line() -> None:
    from core.logs import TRACE_ID, TextFormatter

    record = logging.LogRecord("tollgate.access", logging.INFO, "", 0, "request", (), None)
    record.status = 200
    token = TRACE_ID.set("t-1")
    try:
        line = TextFormatter("http").format(record)
    finally:
        TRACE_ID.reset(token)
    assert line.endswith(" INFO http tollgate.access: request status=200 [trace_id=t-1]"), line
