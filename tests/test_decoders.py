"""The decoding processes of the HTTP process (api/events/decoders.py): a batch prepared in a
process is answered exactly as one prepared on the loop, hostile items included, and a
decoding process that dies is replaced without losing the batch it held."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures.process import _ExecutorManagerThread
from datetime import datetime, timezone
from pathlib import Path

import msgspec

from api.events.decoders import INLINE_BYTES, Decoders, _start_process
from api.events.prepare import prepare_batch
from api.events.views import to_record
from pipelines.events import ValidEvent, decode_event, validate_event
from warehouse.outbox import EventRecord

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=timezone.utc)


def _body() -> bytes:
    items = [json.dumps({"semantic_kind": "activity", "event_type": "t", "occurred_at": "2026-11-20T10:00:00Z",
                         "subject_ref": f"s-{i}", "payload": {"n": i, "f": 2.0}, "labels": {"Env": "prod"}})
             for i in range(200)]
    items[3] = json.dumps({"semantic_kind": "nope", "event_type": "", "occurred_at": "yesterday"})
    items[5] = '"not an object"'
    items[7] = json.dumps({"semantic_kind": "activity", "event_type": "t", "occurred_at": "2026-11-20T10:00:00Z",
                           "payload": "[" * 1000 + "]" * 1000})
    items[9] = items[10]  # a repeat inside the batch: both valid here, the writer tells them apart
    body = ('{"events": [' + ", ".join(items) + "]}").encode()
    assert len(body) >= INLINE_BYTES
    return body


def test_a_batch_prepared_in_a_process_is_the_batch_prepared_on_the_loop() -> None:
    body = _body()

    async def scenario() -> None:
        decoders = Decoders(1)
        await decoders.start()
        try:
            remote = await decoders.prepare(body, "acme", "acct_events", NOW, 300, 1000)
        finally:
            await decoders.stop()
        local = prepare_batch(body, "acme", "acct_events", NOW, 300, 1000)
        assert remote == local
        assert remote.error is None
        invalid = {i for i, r in enumerate(remote.results) if r is not None}
        assert invalid == {3, 5}  # the deep payload is a valid payload
        assert remote.results[3]["error"]["code"] == "VALIDATION.INVALID_VALUE"  # type: ignore[index]
        assert remote.results[5]["error"]["code"] == "VALIDATION.INVALID_TYPE"  # type: ignore[index]
        # The records are the writer's wire form of what the loop used to send.
        records = msgspec.msgpack.decode(remote.records, type=list[EventRecord])
        raw = msgspec.json.decode(body, type=dict[str, list[msgspec.Raw]])["events"]
        for (index, event_id, request_hash), record in zip(remote.valid, records, strict=True):
            valid = validate_event(decode_event(raw[index]), realm="acme", billing_account_id="acct_events",
                                   now=NOW, max_future_skew_seconds=300, floats_normalized=True,
                                   prefix=f"events[{index}].")
            assert isinstance(valid, ValidEvent)
            assert record == to_record(valid)
            assert (event_id, request_hash) == (valid.event_id, valid.request_hash)

    asyncio.run(scenario())


def test_a_body_refused_whole_comes_back_as_its_error() -> None:
    async def scenario() -> None:
        decoders = Decoders(1)
        await decoders.start()
        try:
            too_many = json.dumps({"events": [{"semantic_kind": "activity", "event_type": "t"}] * 1001}).encode()
            assert len(too_many) >= INLINE_BYTES
            refused = await decoders.prepare(too_many, "acme", "a", NOW, 300, 1000)
            broken = await decoders.prepare(b'{"events": [' + b"1, " * 20000, "acme", "a", NOW, 300, 1000)
        finally:
            await decoders.stop()
        assert refused.error is not None and refused.error["code"] == "VALIDATION.BATCH_TOO_LARGE"
        assert broken.error is not None and broken.error["code"] == "VALIDATION.MALFORMED_JSON"

    asyncio.run(scenario())


def test_a_decoding_process_that_dies_is_replaced_and_the_batch_still_answered() -> None:
    body = _body()

    async def scenario() -> None:
        decoders = Decoders(1)
        await decoders.start()
        try:
            pool = decoders._pool
            assert pool is not None
            for pid in list(pool._processes):
                os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            answered = await decoders.prepare(body, "acme", "acct_events", NOW, 300, 1000)
            assert answered == prepare_batch(body, "acme", "acct_events", NOW, 300, 1000)
            assert decoders.restarts == 1 and decoders._pool is not pool
            again = await decoders.prepare(body, "acme", "acct_events", NOW, 300, 1000)
            assert again == answered
        finally:
            await decoders.stop()
        assert not _manager_threads()  # the broken pool's as well as the new one's

    asyncio.run(scenario())


def _manager_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if isinstance(t, _ExecutorManagerThread) and t.is_alive()]


def test_a_stop_returns_once_the_pools_threads_have_ended() -> None:
    """The interpreter's exit hook wakes a pool thread that is still alive without a lock; one
    closing its pipe at that moment printed an OSError traceback into a serve's JSON log."""
    body = _body()

    async def scenario() -> None:
        decoders = Decoders(2)
        await decoders.start()
        assert _manager_threads()
        await asyncio.gather(*(decoders.prepare(body, "acme", "a", NOW, 300, 1000) for _ in range(4)))
        await decoders.stop()
        assert not _manager_threads()
        await decoders.stop()  # a second stop is harmless

    asyncio.run(scenario())


def _start_once_orphaned(marker: str) -> None:
    """A decoding process's start, run once the process that started it is gone."""
    parent = multiprocessing.parent_process()
    assert parent is not None
    deadline = time.monotonic() + 20
    while os.getppid() == parent.pid and time.monotonic() < deadline:
        time.sleep(0.01)
    _start_process()
    with open(marker, "w") as out:
        out.write("still here")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.split() == ["State:", "Z", "(zombie)"] for line in status)
    except FileNotFoundError:
        return True


def test_a_decoding_process_whose_http_process_died_while_it_started_ends(tmp_path: Path) -> None:
    # The HTTP process dies (a service stopped right after its start) before the decoding
    # process it started has asked for the death signal: that process must end by itself,
    # not wait for batches for good.
    marker = tmp_path / "marker"
    starter = ("import multiprocessing, os, sys\n"
               "from tests.test_decoders import _start_once_orphaned\n"
               "child = multiprocessing.get_context('spawn').Process(\n"
               "    target=_start_once_orphaned, args=(sys.argv[1],))\n"
               "child.start()\n"
               "print(child.pid, flush=True)\n"
               "os._exit(0)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", starter, str(marker)], cwd=root, check=True,
                         capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(pid), "the orphaned decoding process is still running"
    assert not marker.exists()
