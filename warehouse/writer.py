"""The group-commit writer: one thread owns the operational connection.

Handlers put a `WriteOp` on the writer's queue and await its future. The writer takes
everything that is waiting, applies the ops in queue order inside one transaction, flushes
the rows they staged, commits, and only then resolves each future with its own outcome. So a
reply is sent only after its commit (2xx means durable), and a thousand requests cost one
commit, not a thousand.

An op's `apply` must either stage all of its writes or raise before staging any, so one bad
op fails alone. If the flush or the commit fails, every op of the group fails with
`StorageUnavailable` and the `on_rollback` hook rebuilds whatever in-memory state the ops
touched from the file.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from datetime import datetime, timezone
from typing import Any, Protocol

import duckdb

__all__ = ["GroupCommitWriter", "StorageUnavailable", "Transaction", "WriteOp"]

log = logging.getLogger("tollgate.writer")


class StorageUnavailable(Exception):
    """The group's transaction could not be committed; nothing of it is durable."""


class Transaction:
    """What the ops of one group share: the connection, and staged rows flushed in one go.

    `stage(table, row)` queues a row for a bulk insert; `on_flush` registers work that needs
    the database after every op has applied (such as the event dedupe insert) and runs in
    registration order; `after_commit` runs once the commit is durable.
    """

    __slots__ = ("conn", "now", "_rows", "_flushers", "_after_commit", "scratch")

    def __init__(self, conn: duckdb.DuckDBPyConnection, now: datetime) -> None:
        self.conn = conn
        self.now = now
        self._rows: dict[str, list[tuple[Any, ...]]] = {}
        self._flushers: dict[str, Callable[[Transaction], None]] = {}
        self._after_commit: list[Callable[[], None]] = []
        self.scratch: dict[str, Any] = {}

    def stage(self, table: str, row: tuple[Any, ...]) -> None:
        self._rows.setdefault(table, []).append(row)

    def on_flush(self, name: str, flusher: Callable[[Transaction], None]) -> None:
        self._flushers.setdefault(name, flusher)

    def after_commit(self, callback: Callable[[], None]) -> None:
        self._after_commit.append(callback)

    def flush(self) -> None:
        for flusher in self._flushers.values():
            flusher(self)
        for table, rows in self._rows.items():
            marks = ", ".join("?" * len(rows[0]))
            self.conn.executemany(f"INSERT INTO {table} VALUES ({marks})", rows)


class WriteOp(Protocol):
    def apply(self, tx: Transaction) -> None:
        """Decide and stage writes; raise to fail this op alone (before staging anything)."""

    def outcome(self, tx: Transaction) -> Any:
        """The op's result, read after the flush and before the commit."""


_STOP = object()


class GroupCommitWriter:
    def __init__(
        self,
        conn: duckdb.DuckDBPyConnection,
        *,
        on_rollback: Callable[[duckdb.DuckDBPyConnection], None] | None = None,
        max_group: int = 4096,
        clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
    ) -> None:
        self._conn = conn
        self._clock = clock
        self._on_rollback = on_rollback
        self._max_group = max_group
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tollgate-writer", daemon=True)
        self.groups = 0
        self.ops = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(_STOP)
        self._thread.join()

    def call(self, fn: Callable[[duckdb.DuckDBPyConnection], Any]) -> Future[Any]:
        """Run `fn(conn)` on the writer thread between groups (reads, maintenance)."""
        fut: Future[Any] = Future()
        self._queue.put((fn, fut, None))
        return fut

    async def submit(self, op: WriteOp) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.put((op, fut, loop))
        return await fut

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is _STOP:
                return
            group = [first]
            stop = False
            while len(group) < self._max_group:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                group.append(item)
            self._run_group(group)
            if stop:
                return

    def _run_group(self, group: list[tuple[Any, Any, Any]]) -> None:
        results: list[tuple[Any, Any, Any, bool]] = []
        calls = [g for g in group if g[2] is None]
        ops = [g for g in group if g[2] is not None]
        for fn, fut, _ in calls:
            try:
                fut.set_result(fn(self._conn))
            except Exception as exc:  # handed to the caller, who decides
                fut.set_exception(exc)
        if not ops:
            return
        tx = Transaction(self._conn, self._clock())
        applied: list[tuple[WriteOp, Any, Any]] = []
        self._conn.execute("BEGIN")
        try:
            for op, fut, loop in ops:
                try:
                    op.apply(tx)
                except Exception as exc:
                    results.append((fut, loop, exc, False))
                    continue
                applied.append((op, fut, loop))
            tx.flush()
            for op, fut, loop in applied:
                try:
                    results.append((fut, loop, op.outcome(tx), True))
                except Exception as exc:
                    results.append((fut, loop, exc, False))
            self._conn.execute("COMMIT")
        except Exception as exc:
            log.exception("group commit failed; %d ops rolled back", len(applied))
            try:
                self._conn.execute("ROLLBACK")
            except duckdb.Error:
                pass
            if self._on_rollback is not None:
                self._on_rollback(self._conn)
            failure = StorageUnavailable(str(exc))
            results = [(fut, loop, failure, False) for _, fut, loop in ops]
        else:
            for callback in tx._after_commit:
                try:
                    callback()
                except Exception:
                    log.exception("after-commit callback failed")
        self.groups += 1
        self.ops += len(ops)
        by_loop: dict[Any, list[tuple[Any, Any, bool]]] = {}
        for fut, loop, value, ok in results:
            by_loop.setdefault(loop, []).append((fut, value, ok))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_resolve_all, items)


def _resolve_all(items: list[tuple[asyncio.Future[Any], Any, bool]]) -> None:
    for fut, value, ok in items:
        if fut.done():
            continue
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)
