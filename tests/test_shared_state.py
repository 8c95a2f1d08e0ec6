"""What the HTTP workers decide in one place (api/shared.py), over the real socket pair the
parent uses, and the settings of `serve --workers`."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest

from api.auth import NonceLog
from api.errors import ServiceUnavailable
from api.shared import RemoteState, StateBook, serve_state
from core.settings import ConfigError, Settings, usable_cores

PLAN = (("acme", "r1", "p", 2, 3),)  # 3 calls per 2-s window


def test_two_workers_share_one_book_and_a_worker_that_ends_releases_its_keys(tmp_path: Path) -> None:
    async def scenario() -> None:
        book = StateBook(300, NonceLog(tmp_path / "nonces", 300))
        ends = []
        for _ in range(2):
            ours, theirs = socket.socketpair()
            await serve_state(book, ours)
            worker = RemoteState(theirs)
            await worker.start()
            ends.append(worker)
        a, b = ends
        now = time.time()
        assert await a.first_use("k", "n1", now) is True
        assert await b.first_use("k", "n1", now) is False  # the other worker's nonce
        assert await b.seen("k", "n1") and not await b.seen("k", "n2")
        stamp = (int(now) // 2) * 2 + 0.1
        assert [await w.admit(PLAN, stamp) for w in (a, b, a)] == [None, None, None]
        assert await b.admit(PLAN, stamp) == (3, int(stamp // 2 + 1) * 2)  # one window for both
        assert await a.used(PLAN, stamp) == [3]
        scope = ("acme", "p", "authorize", "idem-1")
        assert await a.acquire(scope) is True
        assert await b.acquire(scope) is False
        await a.release(scope)
        assert await b.acquire(scope) is True
        b.close()  # worker b ends holding the key: the parent lets it go
        await asyncio.sleep(0.05)
        assert await a.acquire(scope) is True
        a.close()
        book.close()

    asyncio.run(scenario())
    # The nonce reached the log, so a restarted service refuses it too.
    assert [n for _, _, n in NonceLog(tmp_path / "nonces", 300).load(time.time())] == ["n1"]


def test_a_worker_whose_parent_is_gone_answers_503_service_busy(tmp_path: Path) -> None:
    """The parent ends first when the service is killed; a request in flight in a worker that
    still runs must get a 503 the client retries, never a 500."""
    async def scenario() -> None:
        ours, theirs = socket.socketpair()
        worker = RemoteState(theirs)
        await worker.start()
        waiting = asyncio.ensure_future(worker.first_use("k", "n1", time.time()))
        await asyncio.sleep(0.05)
        ours.close()  # the parent dies with the question unanswered
        for call in (waiting, worker.seen("k", "n1")):
            with pytest.raises(ServiceUnavailable) as caught:
                await call
            assert caught.value.code == "SERVICE.BUSY" and caught.value.headers == {"Retry-After": "1"}
        worker.close()

    asyncio.run(scenario())


def test_workers_setting() -> None:
    assert Settings.from_env("var", env={}).workers == usable_cores() == len(os.sched_getaffinity(0))
    assert Settings.from_env("var", env={"TOLLGATE_WORKERS": "3"}).workers == 3
    assert Settings.from_env("var", env={"TOLLGATE_WORKERS": "3"}, workers=1).workers == 1
    with pytest.raises(ConfigError):
        Settings.from_env("var", env={"TOLLGATE_WORKERS": "0"})
    assert Settings.from_env("var", env={}).stop_seconds == 10.0
