"""The group-commit writer: one process owns the operational file.

The service sends each write as an op (a msgspec Struct) over a socket to the writer
process and awaits the reply. The writer takes everything waiting, applies the ops of a lane
in arrival order, flushes the rows they staged, commits the group (to the journal, see
below), and only then replies to each with its own outcome. So a reply is sent only after its
commit (2xx means durable), and a thousand requests cost one commit, not a thousand.

Gate calls sit in front of a customer's work, event ingestion does not: the gate's ops are a
lane of their own, committed before the ingest lane's, whose groups are kept to a budget of
events so that a gate op never waits behind more than one of them (`run_writer`).

Why a process and not a thread: measured here, a DuckDB insert of 30 rows plus its commit
took 3.8 ms alone and 19.7 ms while another Python thread was busy, because each return from
DuckDB waits for the GIL that the HTTP loop holds. In its own process the writer never waits.

An op's handler must either stage all of its writes or raise before staging any, so one bad
op fails alone. A group commits by appending its rows to the journal of `warehouse.journal`
and syncing it; the rows reach the DuckDB file in larger transactions a little later. If the
flush or the commit fails, every op of the group fails with status 503 and `on_rollback`
rebuilds the in-memory state from the file.

Wire: frames of a 4-byte big-endian length and a msgpack body. Request `[id, op]`, reply
`[id, ok, value]` where value is the result, or on failure `{status, code, message, ...}`.
A request the writer cannot decode is answered with a 500 when its id can be read, and
skipped (logged) when not: a bad frame never ends the writer.

While the store is `refusing` (the operational file refuses writes and the journal holds as
many rows beyond it as it may), every op but the read-only ones is answered 503
`STORAGE.UNAVAILABLE` with `Retry-After` before it is decided; if the in-memory state could
not be rebuilt after a failed group (the file cannot take the journal's rows), every op is,
until a tick manages it. Neither ends the writer. The writer tells the service when either
starts or ends with a status frame, `[0, true, {"refusing": bool, "reason": str,
"ingest_busy": str, "ingest_pace_ms": int}]` (request ids start at 1); `/healthz` reports
the refusals. `ingest_busy` is the other refusal, of event ingestion alone, while the lake export's
backlog is at its bound (`LoopStatus`): the HTTP processes answer event posts 503
`STORAGE.BUSY` before reading them. Before that, `ingest_pace_ms` slows event ingestion as the
backlog grows: each event post waits that long before it is read (`LoopStatus.pace_ms`).

With several HTTP workers (`tollgate serve --workers N`), each worker has a connection of its
own, accepted on a listening Unix socket the service passes to the writer; ops of every
connection go into the same lanes and groups, and each reply goes back on its request's
connection.

The client gives every op a deadline: an op still unanswered after it fails with 503
`STORAGE.UNAVAILABLE`, and its late reply, if one comes, is dropped. When the writer's end
closes, every op in flight fails at once the same way and `lost` completes (the service's
runtime then starts a new writer, `api.runtime`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import select
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Protocol

import duckdb
import msgspec

from core.clock import SYSTEM_CLOCK, Clock
from warehouse.journal import DirectStore, JournaledStore, StorageUnavailable

__all__ = ["Handler", "LoopStatus", "OperationalFileLost", "RemoteFailure", "Transaction", "WriterClient", "run_writer",
           "unavailable"]

log = logging.getLogger("tollgate.writer")
_LEN = struct.Struct(">I")
# How long the writer waits for a connection to take its replies before it drops it.
PEER_SEND_SECONDS = 5.0
_encode = msgspec.msgpack.Encoder().encode


class OperationalFileLost(Exception):
    """The operational file's database was invalidated by a failed write and the disk has
    room again: the writer process ends so that a new one reopens the file and applies the
    journal (`JournaledStore.lost`)."""


class RemoteFailure(Exception):
    """An op failed in the writer; `payload` holds status, code, message and more."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(payload.get("message", "write failed"))
        self.payload = payload


class Transaction:
    """What the ops of one group share: the store, the group's clock reading, staged rows,
    and flush steps that run once after every op has applied."""

    __slots__ = ("store", "now", "rows", "_flushers", "scratch", "_committed")

    def __init__(self, store: JournaledStore | DirectStore | duckdb.DuckDBPyConnection,
                 now: datetime) -> None:
        self.store = DirectStore(store) if isinstance(store, duckdb.DuckDBPyConnection) else store
        self.now = now
        self.rows: dict[str, list[tuple[Any, ...]]] = {}
        self._flushers: dict[str, Callable[[Transaction], None]] = {}
        self.scratch: dict[str, Any] = {}
        self._committed: list[Callable[[], None]] = []

    def stage(self, table: str, row: tuple[Any, ...]) -> None:
        self.rows.setdefault(table, []).append(row)

    def on_flush(self, name: str, flusher: Callable[[Transaction], None]) -> None:
        self._flushers.setdefault(name, flusher)

    def read(self) -> duckdb.DuckDBPyConnection:
        """The operational file with every earlier group in it, for a read."""
        return self.store.reading()

    def flush(self) -> None:
        for flusher in self._flushers.values():
            flusher(self)

    def after_commit(self, step: Callable[[], None]) -> None:
        """Run `step` once the group is durable; never when it is rolled back."""
        self._committed.append(step)

    def commit(self) -> None:
        """Make the staged rows durable (the journal), or write them (a direct store), then
        run the steps that wait for that."""
        self.store.commit(self.rows)
        steps, self._committed = self._committed, []
        for step in steps:
            step()


class Handler(Protocol):
    def apply(self, tx: Transaction, op: Any) -> Callable[[], Any]:
        """Decide and stage writes; return a thunk that yields the outcome after the flush.
        Raise to fail this op alone (before staging anything)."""


def _failure(exc: BaseException) -> dict[str, Any]:
    wire = getattr(exc, "to_wire", None)
    if callable(wire):
        return wire()  # type: ignore[no-any-return]
    log.exception("op failed", exc_info=exc)
    return {"status": 500, "code": "INTERNAL.ERROR", "message": "internal error"}


def _frames(buf: bytearray) -> Iterable[bytes]:
    """Pop every complete frame from the front of `buf`."""
    start = 0
    while len(buf) - start >= 4:
        (size,) = _LEN.unpack_from(buf, start)
        if len(buf) - start - 4 < size:
            break
        yield bytes(buf[start + 4:start + 4 + size])
        start += 4 + size
    del buf[:start]


def _frame(payload: bytes) -> bytes:
    return _LEN.pack(len(payload)) + payload


def _reply_frame(reply: tuple[int, bool, Any]) -> bytes:
    """One reply's frame. An outcome the wire cannot carry (an integer beyond 64 bits, say)
    answers its own request with a 500; it must not end the writer, and every other
    request of the group keeps its answer."""
    try:
        return _frame(_encode(reply))
    except Exception as exc:
        return _frame(_encode((reply[0], False, _failure(exc))))


_RID = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])


def _refuse_frame(frame: bytes, exc: Exception, refused: list[tuple[int, bool, Any]]) -> None:
    """A request frame the writer cannot decode: answered with a 500 when its id can be read
    (the service's op then fails alone), logged either way; the writer goes on."""
    try:
        rid, _ = _RID.decode(frame)
    except Exception:
        log.error("dropped a request frame the writer cannot read (%d bytes): %s", len(frame), exc)
        return
    log.error("request %d could not be decoded: %s", rid, exc)
    refused.append((rid, False, {"status": 500, "code": "INTERNAL.ERROR",
                                 "message": "the writer could not read the request"}))


class LoopStatus:
    """What the writer loop refuses, for its metrics and its status frames.

    Besides the refusals of every write (`refusing`), event ingestion alone is refused while
    the lake export's backlog is at its bound (`backlog_bound` rows the operational file holds
    that the lake lacks, read from `backlog`): from the bound until the export has brought it
    down to `BACKLOG_RESUME` of it. The gate goes on. Nothing else bounds those rows: they
    stay in the file until the lake has them, whatever the window."""

    __slots__ = ("stale", "refused_ops", "sent", "backlog", "backlog_bound", "busy",
                 "busy_since", "busy_spells", "pace")

    # Ingestion is taken again once the backlog is down to this share of its bound: a gap
    # wide enough that the refusals come in spells of seconds, not request by request.
    BACKLOG_RESUME = 0.9
    # Pacing (`pace_ms`): from this share of the bound, every event post waits before it is
    # read, up to PACE_MAX_MS at the bound, in steps of PACE_STEP_MS (a status frame a step).
    PACE_FROM = 0.1
    PACE_MAX_MS = 1000
    PACE_STEP_MS = 10

    def __init__(self, backlog: Callable[[], int | None] | None = None, backlog_bound: int = 0) -> None:
        # Why the in-memory state awaits a rebuild from the file (every op refused); "" if not.
        self.stale = ""
        self.refused_ops = 0  # ops answered 503 before they were decided
        # The last status frame sent: refusing, why, why ingestion is refused, its pace.
        self.sent: tuple[bool, str, str, int] = (False, "", "", 0)
        self.backlog = backlog
        self.backlog_bound = backlog_bound
        self.busy = False  # ingestion refused for the export's backlog
        self.busy_since = 0.0  # time.monotonic() when the current spell began
        self.busy_spells = 0
        self.pace = 0  # the pace last computed, in ms

    def current(self, store: JournaledStore) -> tuple[bool, str, str, int]:
        behind = self.backlog() if self.backlog is not None and self.backlog_bound > 0 else None
        busy = self._ingest_busy(behind)
        self.pace = pace = self.pace_ms(behind)
        if self.stale:
            return True, ("storage: the writer waits for the operational file to take the"
                          " journal's rows"), busy, pace
        if store.refusing:
            return True, (f"storage: the operational file refuses writes; {store.unapplied_rows}"
                          " acknowledged rows wait for it"), busy, pace
        return False, "", busy, pace

    def pace_ms(self, behind: int | None) -> int:
        """How long each event post waits before it is read, for `behind` rows the lake lacks.

        The lake export runs below the requests' path (`core.priority`). On a machine whose
        cores are all taken by ingestion it gets too small a share, and the backlog grew
        until the bound refused ingestion in spells: a rate that fell by a sixth over ten
        minutes, in bursts. Pacing instead slows every event post a little from PACE_FROM
        of the bound on, in proportion to the backlog past it: the cores the posts leave go
        to the export, and the backlog settles where ingestion matches the export's rate
        (docs/measurements.md, "Pacing ingestion to the export"). The waits take no core and
        never hold a gate call (the HTTP process's event loop goes on)."""
        bound = self.backlog_bound
        if behind is None or bound <= 0:
            return 0
        start = bound * self.PACE_FROM
        if behind <= start:
            return 0
        share = min(1.0, (behind - start) / (bound - start))
        return int(share * self.PACE_MAX_MS) // self.PACE_STEP_MS * self.PACE_STEP_MS

    def _ingest_busy(self, behind: int | None) -> str:
        """Why event ingestion is refused ("" when it is not), with the hysteresis above."""
        bound = self.backlog_bound
        if behind is not None:
            if not self.busy and behind >= bound:
                self.busy, self.busy_since = True, time.monotonic()
                self.busy_spells += 1
                log.warning("refusing event ingestion: %d rows wait for the lake export (the"
                            " bound is %d); taken again below %d", behind, bound,
                            int(bound * self.BACKLOG_RESUME))
            elif self.busy and behind <= bound * self.BACKLOG_RESUME:
                self.busy = False
                log.warning("taking event ingestion again after %.1f s: %d rows wait for the"
                            " lake export", time.monotonic() - self.busy_since, behind)
        if not self.busy:
            return ""
        return f"the lake export is {bound} rows or more behind"


def _status_frame(status: LoopStatus, store: JournaledStore) -> bytes:
    """A status frame if the status changed since the last one, else nothing."""
    now = status.current(store)
    if now == status.sent:
        return b""
    was = status.sent
    status.sent = now
    if now[:2] != was[:2]:
        if now[0]:
            log.error("refusing writes: %s", now[1])
        else:
            log.warning("taking writes again")
    return _state_frame(now)


def _state_frame(state: tuple[bool, str, str, int]) -> bytes:
    """The status frame of `state` (`LoopStatus.current`)."""
    refusing, reason, busy, pace = state
    return _frame(_encode((0, True, {"refusing": refusing, "reason": reason, "ingest_busy": busy,
                                     "ingest_pace_ms": pace})))


def run_writer(
    store: JournaledStore,
    sock: socket.socket,
    decode_request: Callable[[bytes], tuple[int, Any]],
    handlers: dict[type, Handler],
    *,
    on_rollback: Callable[[JournaledStore], None],
    tick: Callable[[duckdb.DuckDBPyConnection], None] | None = None,
    tick_seconds: float = 0.5,
    after_group: Callable[[JournaledStore], None] | None = None,
    on_group: Callable[[str, int, float, float, bool], None] | None = None,
    clock: Clock = SYSTEM_CLOCK,
    bulk: tuple[type, ...] = (),
    bulk_budget: Callable[[Any], int] = lambda op: 1,
    bulk_group_budget: int = 1,
    contended_budget: int | None = None,
    contended_seconds: float = 1.0,
    rider_budget: int = 0,
    split: Callable[[Any, int], tuple[Any, Any]] | None = None,
    join: Callable[[list[Any]], Any] = lambda parts: parts,
    read_only: frozenset[type] = frozenset(),
    status: LoopStatus | None = None,
    listener: socket.socket | None = None,
    greeting: bytes = b"",
) -> None:
    """The writer process's loop; returns when the service closes its end of `sock`.

    `sock` is the service's own connection (its end of a socket pair). With `listener`, a
    listening Unix socket, the writer also accepts connections on it, one per HTTP worker
    of the service, sends each `greeting` (a frame) first, and answers every op on the
    connection it came from (each op is known by a number of the loop's own while it waits,
    so the lanes below mix the ops of every connection); status frames go to every
    connection. A worker's connection that closes (the worker ended) is dropped; only the
    end of `sock` ends the loop.

    Two lanes. The op types of `bulk` (event ingestion) form the ingest lane, every other op
    the gate lane. Every gate op waiting is committed first, in a group of its own; ingest
    ops wait in arrival order and go in groups of at most `bulk_group_budget` units (an op
    costs `bulk_budget(op)`: its events; one op past the budget still forms its group), and
    after every ingest group the socket is read again. When both lanes wait they alternate,
    so a gate op waits for at most one ingest group and the ingest lane is never starved.
    While gate ops are arriving (one came in the last `contended_seconds`), ingest groups
    are cut at `contended_budget` units instead (when given): a gate op then waits behind a
    shorter group, and ingestion alone keeps the larger groups, each one journal sync.
    Within a lane, ops are applied in arrival order. A gate group also takes the ingest ops at
    the head of their queue that fit `rider_budget` together (single events): they cost its
    group little, and save a commit (a journal sync) of their own.

    With `split`, an ingest op larger than what is left of a group's budget is cut
    (`split(op, n)` returns its first n units and the rest): its parts go in successive
    groups, and it is answered once, after its last part committed, with `join` of the
    parts' outcomes; if a part fails, the op is answered with that failure at once and its
    other parts are dropped (the parts before it stay stored: a retried event is then a
    duplicate, as after any reply lost). So one 1000-event batch does not make a gate op wait
    for the whole of it.

    `tick` runs every `tick_seconds` between groups (lease expiry and other timed work), on
    the connection, right after the waiting rows were handed to the applier (they may not be
    in the file yet: a tick that reads the file must call `store.reading()`); `after_group`
    runs after each group's replies are sent; `on_group` is told each group's lane (`gate`,
    `ingest`), its number of ops, its time from the first decision to the durable commit and
    the commit's own part (journal append and sync, in seconds), and whether it committed
    (the writer's metrics). Ops of a `read_only` type are answered while writes are refused;
    `status` is kept up to date (a new one when not given)."""
    next_tick = time.monotonic() + tick_seconds
    # Every connection that carries ops, by file number: its socket and unread bytes.
    peers: dict[int, tuple[socket.socket, bytearray]] = {sock.fileno(): (sock, bytearray())}
    if listener is not None:
        listener.setblocking(False)
    # The loop's number of each op waiting for its reply -> its connection and its id there.
    origin: dict[int, tuple[socket.socket, int]] = {}
    tokens = iter(range(1, 1 << 62))
    gate: list[tuple[int, Any]] = []
    ingest: deque[tuple[int, Any]] = deque()
    parts: dict[int, list[Any]] = {}  # outcomes of the committed parts of ops cut by `split`
    last_lane = "ingest"
    last_gate = -math.inf  # when a gate op last arrived (monotonic seconds)
    sock.setblocking(False)
    status = status if status is not None else LoopStatus()

    def rollback(s: JournaledStore) -> None:
        # A failed group may have changed the in-memory state: rebuild it from the file.
        # If the file cannot take the journal's rows, refuse every op until it can.
        try:
            on_rollback(s)
        except Exception as exc:
            if not status.stale:
                log.error("the writer's state could not be rebuilt from the operational file;"
                          " every op is refused until it can be", exc_info=exc)
            status.stale = f"{type(exc).__name__}: {exc}"
        else:
            if status.stale:
                log.warning("the writer's state is rebuilt from the operational file")
            status.stale = ""

    while True:
        wait = 0.0 if gate or ingest else max(0.0, next_tick - time.monotonic())
        watched: list[Any] = [s for s, _ in peers.values()]
        if listener is not None:
            watched.append(listener)
        readable, _, _ = select.select(watched, [], [], wait)
        refused: list[tuple[int, bool, Any]] = []
        for ready in readable:
            if ready is listener:
                # A new worker learns the status the others were told (refusing writes).
                _accept(listener, peers, greeting + _status_now(status))
                continue
            peer, buf = peers[ready.fileno()]
            if not _receive(peer, buf):
                if peer is sock:
                    return
                _drop(peers, peer)
                continue
            theirs: list[tuple[int, bool, Any]] = []
            for frame in _frames(buf):
                try:
                    rid, op = decode_request(frame)
                except Exception as exc:
                    _refuse_frame(frame, exc, theirs)
                    continue
                token = next(tokens)
                origin[token] = (peer, rid)
                if isinstance(op, bulk):
                    ingest.append((token, op))
                else:
                    gate.append((token, op))
                    last_gate = time.monotonic()
            for rid, ok, value in theirs:
                token = next(tokens)
                origin[token] = (peer, rid)
                refused.append((token, ok, value))
        if (gate or ingest) and (status.stale or store.refusing):
            gate = _refuse_writes(store, status, gate, read_only, refused)
            if ingest:
                ingest = deque(_refuse_writes(store, status, list(ingest), read_only, refused))
            for rid, _, _ in refused:
                parts.pop(rid, None)  # a cut op whose tail was refused: answered with that
        lane, requests = "", list[tuple[int, Any]]()
        head_rides = bool(ingest) and bulk_budget(ingest[0][1]) <= rider_budget
        if gate and (last_lane == "ingest" or not ingest or head_rides):
            lane, requests, gate = "gate", gate, []
            riders = 0
            while ingest and riders + bulk_budget(ingest[0][1]) <= rider_budget:
                request = ingest.popleft()
                riders += bulk_budget(request[1])
                requests.append(request)
        elif ingest:
            lane, used = "ingest", 0
            budget = bulk_group_budget
            if contended_budget is not None and time.monotonic() - last_gate < contended_seconds:
                budget = contended_budget
            while ingest and used < budget:
                rid, op = ingest[0]
                cost = bulk_budget(op)
                if used + cost <= budget or (not requests and split is None):
                    ingest.popleft()
                    used += cost
                    requests.append((rid, op))
                elif split is not None:
                    # The op's head goes in this group; its tail stays first in the queue, and
                    # the op is answered once its last part has committed.
                    head, tail = split(op, budget - used)
                    ingest[0] = (rid, tail)
                    used = budget
                    requests.append((rid, head))
                else:
                    break
        if requests or refused:
            replies: list[Any] = []
            if requests:
                last_lane = lane
                began = time.perf_counter()
                replies, committed, commit_s = _run_group(store, requests, handlers, rollback,
                                                          clock.now())
                if on_group is not None:
                    on_group(lane, len(requests), time.perf_counter() - began, commit_s, committed)
                if parts or (ingest and any(rid == ingest[0][0] for rid, _ in requests)):
                    replies = _gather_parts(replies, parts, ingest, join)
            _answer(peers, origin, replies + refused, _status_frame(status, store))
            if sock.fileno() < 0:
                return  # the service's own end went away
            if requests and after_group is not None:
                # Work that follows a durable group and must never change its replies
                # (such as rating newly accepted single events inline).
                try:
                    after_group(store)
                except Exception:
                    log.exception("after-group step failed")
            if store.pending_rows >= store.MAX_PENDING_ROWS:
                try:
                    # It may start a journal segment; if that fails, the rows wait for
                    # the tick (every reply of the group is sent already).
                    store.materialize_soon()
                except Exception:
                    log.exception("handing rows to the applier failed")
        if time.monotonic() >= next_tick:
            if store.lost and store.retry_due() and store.has_room():
                raise OperationalFileLost(store.lost)
            try:
                store.materialize_due()
                if status.stale and store.retry_due():
                    rollback(store)
                if tick is not None:
                    tick(store.conn)
            except Exception:
                log.exception("writer tick failed")
            frame = _status_frame(status, store)
            if frame:
                _answer(peers, origin, [], frame)
                if sock.fileno() < 0:
                    return
            next_tick = time.monotonic() + tick_seconds


def _status_now(status: LoopStatus) -> bytes:
    """The last status frame sent, for a connection that missed it; nothing when writes are
    taken (what a connection assumes)."""
    refusing, _, busy, pace = status.sent
    if not refusing and not busy and not pace:
        return b""
    return _state_frame(status.sent)


def _accept(listener: socket.socket, peers: dict[int, tuple[socket.socket, bytearray]],
            greeting: bytes) -> None:
    """Take every connection waiting on `listener`, greeting each."""
    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            log.exception("accepting a connection failed")
            return
        try:
            conn.setblocking(True)
            if greeting:
                conn.sendall(greeting)
            conn.setblocking(False)
        except OSError:
            conn.close()
            continue
        peers[conn.fileno()] = (conn, bytearray())


def _receive(peer: socket.socket, buf: bytearray) -> bool:
    """Append what `peer` has to `buf`; False once its other end has closed."""
    try:
        while True:
            chunk = peer.recv(4 << 20)
            if not chunk:
                return False
            buf += chunk
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False


def _drop(peers: dict[int, tuple[socket.socket, bytearray]], peer: socket.socket) -> None:
    peers.pop(peer.fileno(), None)
    peer.close()


def _answer(peers: dict[int, tuple[socket.socket, bytearray]],
            origin: dict[int, tuple[socket.socket, int]], replies: list[tuple[int, bool, Any]],
            broadcast: bytes = b"") -> None:
    """Send each reply on the connection its request came from, under that request's id,
    and `broadcast` (a status frame) on every connection."""
    outgoing: dict[socket.socket, list[bytes]] = {}
    for token, ok, value in replies:
        peer, rid = origin.pop(token)
        outgoing.setdefault(peer, []).append(_reply_frame((rid, ok, value)))
    if broadcast:
        for peer, _ in peers.values():
            outgoing.setdefault(peer, []).append(broadcast)
    for peer, frames in outgoing.items():
        if peer.fileno() < 0:
            continue  # its connection closed: the worker failed the op already
        try:
            # A worker that takes nothing for this long (stopped, or hung) is dropped rather
            # than hold every other worker's replies: it fails its own ops with 503 and
            # connects again.
            peer.settimeout(PEER_SEND_SECONDS)
            peer.sendall(b"".join(frames))
            peer.setblocking(False)
        except OSError:
            # The worker went away with its requests; the others keep their answers.
            log.error("a worker's connection did not take its replies (it ended or hangs); dropped")
            _drop(peers, peer)


def _gather_parts(replies: list[tuple[int, bool, Any]], parts: dict[int, list[Any]],
                  ingest: deque[tuple[int, Any]],
                  join: Callable[[list[Any]], Any]) -> list[tuple[int, bool, Any]]:
    """The replies of a group once the parts of cut ops are gathered: a part whose op has a
    tail waiting (first in `ingest`) is held; the last part is answered with the joined
    outcomes; a failed part answers its op and drops its tail."""
    waiting = ingest[0][0] if ingest else None
    out: list[tuple[int, bool, Any]] = []
    for rid, ok, value in replies:
        if rid == waiting:
            if ok:
                parts.setdefault(rid, []).append(value)
                continue
            ingest.popleft()
            parts.pop(rid, None)
            out.append((rid, ok, value))
        elif rid in parts:
            held = parts.pop(rid)
            out.append((rid, True, join([*held, value])) if ok else (rid, ok, value))
        else:
            out.append((rid, ok, value))
    return out


def _refuse_writes(store: JournaledStore, status: LoopStatus, requests: list[tuple[int, Any]],
                   read_only: frozenset[type],
                   refused: list[tuple[int, bool, Any]]) -> list[tuple[int, Any]]:
    """Answer 503 to every op that may write (every op while the state is stale) before it
    is decided; the ops left to run."""
    if status.stale:
        failure = StorageUnavailable("the writer waits for the operational file to take the"
                                     " journal's rows before it decides anything: retry").to_wire()
        kept: list[tuple[int, Any]] = []
    else:
        failure = store.refusal().to_wire()
        kept = [(rid, op) for rid, op in requests if type(op) in read_only]
    if len(kept) < len(requests):
        allowed = {rid for rid, _ in kept}
        for rid, _ in requests:
            if rid not in allowed:
                refused.append((rid, False, failure))
        status.refused_ops += len(requests) - len(kept)
    return kept


def _run_group(store: JournaledStore, requests: list[tuple[int, Any]],
               handlers: dict[type, Handler],
               on_rollback: Callable[[JournaledStore], None],
               now: datetime) -> tuple[list[tuple[int, bool, Any]], bool, float]:
    replies: list[tuple[int, bool, Any]] = []
    pending: list[tuple[int, Callable[[], Any]]] = []
    tx = Transaction(store, now)
    try:
        for rid, op in requests:
            try:
                pending.append((rid, handlers[type(op)].apply(tx, op)))
            except Exception as exc:
                replies.append((rid, False, _failure(exc)))
        tx.flush()
        for rid, outcome in pending:
            try:
                replies.append((rid, True, outcome()))
            except Exception as exc:
                replies.append((rid, False, _failure(exc)))
        began = time.perf_counter()
        tx.commit()
        commit_s = time.perf_counter() - began
    except Exception as exc:
        log.exception("group commit failed; %d ops rolled back", len(pending))
        on_rollback(store)
        failure = {"status": 503, "code": "STORAGE.UNAVAILABLE",
                   "message": f"the write could not be committed; retry ({exc.__class__.__name__})"}
        return [(rid, False, failure) for rid, _ in requests], False, 0.0
    return replies, True, commit_s


def unavailable(message: str) -> dict[str, Any]:
    """The failure of an op the writer did not answer: 503 STORAGE.UNAVAILABLE."""
    return {"status": 503, "code": "STORAGE.UNAVAILABLE", "message": message}


class WriterClient(asyncio.Protocol):
    """The service's end: send ops, await replies. Runs on the service's event loop; replies
    are parsed straight from each chunk the socket delivers (a protocol, not a stream reader
    awaited twice per frame).

    Every op waits at most `deadline_seconds` (and up to a sweep interval more): one timer
    sweeps the oldest waiting ops, so an op costs a clock reading, not a timer of its own."""

    def __init__(self, sock: socket.socket, result_types: dict[type, Any], *,
                 deadline_seconds: float = 10.0, bulk: tuple[type, ...] = (),
                 on_reply: Callable[[str, float], None] | None = None) -> None:
        self._sock = sock
        # Op types of the `ingest` lane (the rest are `gate`), and what is told each reply's
        # lane and time from submit (the HTTP process's metrics).
        self._bulk = bulk
        self._on_reply = on_reply
        self._result_types = result_types
        self._next_id = 1
        # In id order, so the oldest waiting op is always the first.
        self._waiting: dict[int, tuple[asyncio.Future[Any], Any, float, str]] = {}
        self._reply_decoder = msgspec.msgpack.Decoder(tuple[int, bool, msgspec.Raw])
        self._failure_decoder = msgspec.msgpack.Decoder(dict[str, Any])
        self._outgoing: list[bytes] = []
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadline = deadline_seconds
        self._sweep_every = max(0.01, min(0.25, deadline_seconds / 4))
        self._sweeper: asyncio.TimerHandle | None = None
        self.late_replies = 0
        # Why the writer refuses writes, from its latest status frame; "" while it takes them.
        self.refusing = ""
        # Why it refuses event ingestion alone (the lake export's backlog); "" while it takes it.
        self.ingest_busy = ""
        # How long an event post waits before it is read, in seconds (`LoopStatus.pace_ms`).
        self.ingest_pace = 0.0
        self.closed = False
        # Completes when the writer's end has closed (or this end was closed).
        self.lost: asyncio.Future[None] | None = None

    @property
    def queued(self) -> int:
        """Ops submitted in this process and not yet handed to the socket."""
        return len(self._outgoing)

    @property
    def in_flight(self) -> int:
        """Ops written to the writer and not yet answered."""
        return len(self._waiting) - len(self._outgoing)

    @property
    def send_buffer_bytes(self) -> int:
        """Bytes written but not yet taken by the socket (the writer is not reading)."""
        transport = self._transport
        return 0 if transport is None or self.closed else transport.get_write_buffer_size()

    async def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self.lost = loop.create_future()
        await loop.create_unix_connection(lambda: self, sock=self._sock)
        self._sweeper = loop.call_later(self._sweep_every, self._sweep)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    async def submit(self, op: Any) -> Any:
        if self.closed:
            raise RemoteFailure(unavailable("the writer is not running (it is being restarted); retry"))
        loop = self._loop or asyncio.get_running_loop()
        rid = self._next_id
        self._next_id += 1
        fut: asyncio.Future[Any] = loop.create_future()
        self._waiting[rid] = (fut, self._result_types[type(op)], loop.time(),
                              "ingest" if isinstance(op, self._bulk) else "gate")
        # Ops of one turn of the event loop leave in one write: one system call instead of
        # one per request, and the writer reads them as one group.
        if not self._outgoing:
            loop.call_soon(self._send_outgoing)
        self._outgoing.append(_frame(_encode((rid, op))))
        return await fut

    def _send_outgoing(self) -> None:
        frames, self._outgoing = self._outgoing, []
        if not self.closed and self._transport is not None:
            self._transport.write(b"".join(frames))

    def _sweep(self) -> None:
        """Fail every op that has waited past the deadline; its reply, if it comes, is dropped."""
        assert self._loop is not None
        waiting = self._waiting
        if waiting:
            limit = self._loop.time() - self._deadline
            expired = 0
            while waiting:
                rid = next(iter(waiting))
                fut, _, sent, _ = waiting[rid]
                if sent > limit:
                    break
                del waiting[rid]
                expired += 1
                if not fut.done():
                    fut.set_exception(RemoteFailure(unavailable(
                        f"the writer did not answer within {self._deadline:g} s; the request may"
                        " or may not have been stored: retry")))
            if expired:
                log.error("%d ops got no answer from the writer within %g s", expired, self._deadline)
        if not self.closed:
            self._sweeper = self._loop.call_later(self._sweep_every, self._sweep)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        waiting = self._waiting
        on_reply = self._on_reply
        now = self._loop.time() if on_reply is not None and self._loop is not None else 0.0
        for body in _frames(buf):
            rid, ok, raw = self._reply_decoder.decode(body)
            if rid == 0:  # a status frame (see the module's doc)
                state = self._failure_decoder.decode(raw)
                self.refusing = str(state.get("reason") or "storage refuses writes") \
                    if state.get("refusing") else ""
                self.ingest_busy = str(state.get("ingest_busy") or "")
                self.ingest_pace = max(0, int(state.get("ingest_pace_ms") or 0)) / 1000
                continue
            entry = waiting.pop(rid, None)
            if entry is None:  # its op passed the deadline and was answered already
                self.late_replies += 1
                continue
            fut, result_type, sent, lane = entry
            if on_reply is not None:
                on_reply(lane, now - sent)
            if fut.done():
                continue
            if ok:
                fut.set_result(msgspec.msgpack.decode(raw, type=result_type))
            else:
                fut.set_exception(RemoteFailure(self._failure_decoder.decode(raw)))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:
            log.error("the writer process went away")
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for fut, _, _, _ in self._waiting.values():
            if not fut.done():
                fut.set_exception(RemoteFailure(unavailable(
                    "the writer process went away; the request may or may not have been stored: retry")))
        self._waiting.clear()
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    def eof_received(self) -> bool | None:
        return False  # close the transport: connection_lost fails what is waiting

    async def close(self) -> None:
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._transport is not None:
            self._transport.close()
