"""The supervision of the writer by the service's parent process (api/supervisor.py), with
stand-ins for the writer process: a writer that ends is restarted; restarts are bounded; a writer that refuses its
journal stops the service rather than loop. (The real process is killed under load in
tests/test_durability.py.)"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import pytest

import api.supervisor as runtime_module
from api.supervisor import MAX_WRITER_RESTARTS, Supervisor, WriterRefused
from core.constants import WRITER_JOURNAL_REFUSED
from core.settings import Settings


class _Proc:
    def __init__(self, code: int) -> None:
        self.code = code

    def wait(self, timeout: float | None = None) -> int:
        return self.code

    def kill(self) -> None:
        pass


class _Writer:
    def __init__(self) -> None:
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.closed = False

    def die(self) -> None:
        self.closed = True
        self.lost.set_result(None)

    async def close(self) -> None:
        self.closed = True


class _Supervisor(Supervisor):
    stopped: list[str]

    def _fail(self, message: str) -> None:
        super()._fail(message)
        self.stopped.append(message)


def _runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exit_code: int = -9) -> tuple[Supervisor, list[str]]:
    monkeypatch.setattr(runtime_module, "restart_pause", lambda n: 0.0)
    runtime = _Supervisor(Settings(data_dir=tmp_path), socket.socket())
    runtime.writer = _Writer()
    runtime._writer_proc = _Proc(exit_code)  # type: ignore[assignment]
    runtime.writer_state = "running"
    runtime.stopped = []
    return runtime, runtime.stopped


def test_a_writer_that_ends_is_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        runtime, stopped = _runtime(tmp_path, monkeypatch)
        started: list[_Writer] = []

        async def start_writer() -> None:
            assert runtime.writer_state == "restarting"
            started.append(_Writer())
            runtime.writer = started[-1]  # type: ignore[assignment]
            runtime.writer_state = "running"

        runtime._start_writer = start_writer  # type: ignore[method-assign]
        task = asyncio.create_task(runtime._supervise())
        runtime.writer.die()  # type: ignore[attr-defined]
        for _ in range(100):
            await asyncio.sleep(0.01)
            if runtime.writer_restarts:
                break
        assert runtime.writer_restarts == 1 and runtime.writer_state == "running"
        assert len(started) == 1 and stopped == [] and runtime.fatal is None
        runtime._stopping = True
        task.cancel()

    asyncio.run(scenario())


def test_a_writer_that_keeps_ending_stops_the_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        runtime, stopped = _runtime(tmp_path, monkeypatch)

        async def start_writer() -> None:  # each new writer dies as soon as it is ready
            writer = _Writer()
            runtime.writer = writer  # type: ignore[assignment]
            asyncio.get_running_loop().call_soon(writer.die)

        runtime._start_writer = start_writer  # type: ignore[method-assign]
        runtime.writer.die()  # type: ignore[attr-defined]
        await asyncio.wait_for(runtime._supervise(), 10)
        assert runtime.writer_restarts == MAX_WRITER_RESTARTS
        assert len(stopped) == 1 and f"{MAX_WRITER_RESTARTS + 1} times within" in stopped[0]
        assert runtime.writer_state == "down"

    asyncio.run(scenario())


def test_a_writer_that_refuses_its_journal_stops_the_service_without_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        runtime, stopped = _runtime(tmp_path, monkeypatch, exit_code=WRITER_JOURNAL_REFUSED)

        async def start_writer() -> None:
            raise AssertionError("no restart after a journal refusal")

        runtime._start_writer = start_writer  # type: ignore[method-assign]
        runtime.writer.die()  # type: ignore[attr-defined]
        await asyncio.wait_for(runtime._supervise(), 10)
        assert len(stopped) == 1 and "journal" in stopped[0]

    asyncio.run(scenario())


def test_a_new_writer_that_refuses_its_journal_stops_the_service(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        runtime, stopped = _runtime(tmp_path, monkeypatch)
        attempts: list[int] = []

        async def start_writer() -> None:
            attempts.append(1)
            raise WriterRefused("refused")

        runtime._start_writer = start_writer  # type: ignore[method-assign]
        runtime.writer.die()  # type: ignore[attr-defined]
        await asyncio.wait_for(runtime._supervise(), 10)
        assert attempts == [1] and len(stopped) == 1 and "journal" in stopped[0]

    asyncio.run(scenario())


def test_a_new_writer_that_fails_to_start_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        runtime, stopped = _runtime(tmp_path, monkeypatch)
        attempts: list[int] = []

        async def start_writer() -> None:
            attempts.append(1)
            if len(attempts) < 3:
                raise RuntimeError("could not open the data folder")
            runtime.writer = _Writer()  # type: ignore[assignment]
            runtime.writer_state = "running"

        runtime._start_writer = start_writer  # type: ignore[method-assign]
        runtime.writer.die()  # type: ignore[attr-defined]
        task = asyncio.create_task(runtime._supervise())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if runtime.writer_restarts:
                break
        assert len(attempts) == 3 and runtime.writer_restarts == 1 and stopped == []
        runtime._stopping = True
        task.cancel()

    asyncio.run(scenario())


def test_restarts_pause_longer_each_time() -> None:
    pauses: list[Any] = [runtime_module.restart_pause(n) for n in range(1, MAX_WRITER_RESTARTS + 1)]
    assert pauses[0] == 0 and pauses == sorted(pauses) and pauses[-1] <= 30


def test_the_deadline_is_a_setting() -> None:
    assert Settings.from_env("var", env={}).writer_deadline_seconds == 10.0
    assert Settings.from_env("var", env={"TOLLGATE_WRITER_DEADLINE_SECONDS": "2.5"}).writer_deadline_seconds == 2.5
