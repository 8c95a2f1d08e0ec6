"""The wire between the service and its writer (warehouse/writer.py): every op has a deadline
and a late reply is dropped; a dead peer fails what is in flight at once; a request frame the
writer cannot decode is answered (or skipped) without ending the writer."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from typing import Any

import msgspec
import pytest

from warehouse.writer import RemoteFailure, WriterClient, run_writer

_LEN = struct.Struct(">I")


class Ping(msgspec.Struct, tag=True):
    n: int


def _frame(value: Any) -> bytes:
    body = msgspec.msgpack.encode(value)
    return _LEN.pack(len(body)) + body


def _read_frames(sock: socket.socket, count: int) -> list[Any]:
    sock.settimeout(10)
    found = []
    for _ in range(count):
        (size,) = _LEN.unpack(sock.recv(4, socket.MSG_WAITALL))
        found.append(msgspec.msgpack.decode(sock.recv(size, socket.MSG_WAITALL)))
    return found


def test_an_op_unanswered_past_the_deadline_gets_503_and_its_late_reply_is_dropped() -> None:
    async def scenario() -> None:
        ours, peer = socket.socketpair()  # the peer reads and never answers until told
        client = WriterClient(ours, {Ping: int}, deadline_seconds=0.3)
        await client.start()
        began = time.monotonic()
        with pytest.raises(RemoteFailure) as caught:
            await client.submit(Ping(1))
        waited = time.monotonic() - began
        assert 0.3 <= waited < 1.5
        assert caught.value.payload["status"] == 503
        assert caught.value.payload["code"] == "STORAGE.UNAVAILABLE"
        [request] = await asyncio.to_thread(_read_frames, peer, 1)
        assert request[0] == 1
        # The late reply arrives, then the next op's: the first is dropped, the second answers.
        answer = asyncio.ensure_future(client.submit(Ping(2)))
        [second] = await asyncio.to_thread(_read_frames, peer, 1)
        peer.sendall(_frame((1, True, 10)) + _frame((second[0], True, 20)))
        assert await asyncio.wait_for(answer, 5) == 20
        assert client.late_replies == 1 and not client.closed
        await client.close()
        peer.close()

    asyncio.run(scenario())


def test_a_peer_that_goes_away_fails_every_op_in_flight_at_once() -> None:
    async def scenario() -> None:
        ours, peer = socket.socketpair()
        client = WriterClient(ours, {Ping: int}, deadline_seconds=60)
        await client.start()
        waiting = [asyncio.ensure_future(client.submit(Ping(n))) for n in range(5)]
        await asyncio.to_thread(_read_frames, peer, 5)
        began = time.monotonic()
        peer.close()
        results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        assert time.monotonic() - began < 2
        assert all(isinstance(r, RemoteFailure) and r.payload["status"] == 503 for r in results)
        assert client.closed and client.lost is not None and client.lost.done()
        with pytest.raises(RemoteFailure):
            await client.submit(Ping(9))  # at once, while no writer runs
        await client.close()

    asyncio.run(scenario())


class _Store:
    """What `run_writer` needs of the journaled store, with nothing to store."""

    MAX_PENDING_ROWS = 1_000_000
    pending_rows = 0
    conn = None
    refusing = False  # the file always takes writes

    def retry_due(self) -> bool:
        return True

    def commit(self, rows: dict[str, list[Any]]) -> None:
        pass

    def materialize_soon(self) -> None:
        pass

    def materialize_due(self) -> None:
        pass


class _Double:
    def apply(self, tx: Any, op: Ping) -> Any:
        return lambda: op.n * 2


def test_a_frame_the_writer_cannot_decode_is_answered_when_it_can_and_the_writer_goes_on() -> None:
    ours, theirs = socket.socketpair()
    decoder = msgspec.msgpack.Decoder(tuple[int, Ping])
    ended: list[BaseException | None] = []

    def writer() -> None:
        try:
            run_writer(_Store(), theirs, decoder.decode, {Ping: _Double()},  # type: ignore[arg-type,dict-item]
                       on_rollback=lambda store: None, tick_seconds=30)
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    garbage = b"\xc1\xc1\xc1"  # not msgpack at all: no id to answer
    ours.sendall(_LEN.pack(len(garbage)) + garbage + _frame((7, {"type": "Nope"})) + _frame((8, Ping(21))))
    replies = {r[0]: r for r in _read_frames(ours, 2)}
    assert replies[7][1] is False and replies[7][2]["status"] == 500
    assert replies[8] == [8, True, 42]
    ours.sendall(_frame((9, Ping(5))))  # still running
    assert _read_frames(ours, 1) == [[9, True, 10]]
    assert thread.is_alive() and ended == []
    ours.close()  # the service's end closes: the loop returns
    thread.join(10)
    assert ended == [None]


class Bulk(msgspec.Struct, tag=True):
    events: int


class _Count:
    def apply(self, tx: Any, op: Bulk) -> Any:
        return lambda: op.events


def test_gate_ops_are_committed_before_waiting_ingest_ops_which_go_in_budgeted_groups() -> None:
    """Three 1000-event ops, then a gate op, arrive in one read: the gate op's group commits
    first, then the ingest ops in groups of at most the budget (1,500 events: one op each, as
    two would pass it), alternating with gate ops that arrive meanwhile."""
    ours, theirs = socket.socketpair()
    decoder = msgspec.msgpack.Decoder(tuple[int, Ping | Bulk])
    groups: list[tuple[str, int]] = []

    def writer() -> None:
        run_writer(_Store(), theirs, decoder.decode,  # type: ignore[arg-type]
                   {Ping: _Double(), Bulk: _Count()},  # type: ignore[dict-item]
                   on_rollback=lambda store: None, tick_seconds=30,
                   on_group=lambda lane, ops, seconds, commit_s, ok: groups.append((lane, ops)),
                   bulk=(Bulk,), bulk_budget=lambda op: op.events, bulk_group_budget=1500)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    ours.sendall(_frame((1, Bulk(1000))) + _frame((2, Bulk(1000))) + _frame((3, Bulk(1000)))
                 + _frame((4, Ping(1))) + _frame((5, Ping(2))) + _frame((6, Bulk(200))))
    replies = _read_frames(ours, 6)
    assert [r[0] for r in replies] == [4, 5, 1, 2, 3, 6]
    assert replies[0] == [4, True, 2] and replies[2] == [1, True, 1000]
    # Bulk 3 (1,000) and Bulk 6 (200) fit one group of 1,500.
    assert groups == [("gate", 2), ("ingest", 1), ("ingest", 1), ("ingest", 2)]
    ours.close()
    thread.join(10)


def test_ingest_groups_are_cut_shorter_while_gate_ops_arrive() -> None:
    """With no gate op lately, ingest groups take the whole budget; for `contended_seconds`
    after a gate op they take the contended budget; then the whole budget again."""
    ours, theirs = socket.socketpair()
    decoder = msgspec.msgpack.Decoder(tuple[int, Ping | Bulk])
    groups: list[tuple[str, int]] = []

    def writer() -> None:
        run_writer(_Store(), theirs, decoder.decode,  # type: ignore[arg-type]
                   {Ping: _Double(), Bulk: _Count()},  # type: ignore[dict-item]
                   on_rollback=lambda store: None, tick_seconds=30,
                   on_group=lambda lane, ops, seconds, commit_s, ok: groups.append((lane, ops)),
                   bulk=(Bulk,), bulk_budget=lambda op: op.events, bulk_group_budget=400,
                   contended_budget=200, contended_seconds=1.0)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    four = b"".join(_frame((i, Bulk(100))) for i in range(1, 5))
    ours.sendall(four)
    assert [r[0] for r in _read_frames(ours, 4)] == [1, 2, 3, 4]
    ours.sendall(_frame((5, Ping(1))) + b"".join(_frame((i, Bulk(100))) for i in range(6, 10)))
    assert [r[0] for r in _read_frames(ours, 5)] == [5, 6, 7, 8, 9]
    assert groups == [("ingest", 4), ("gate", 1), ("ingest", 2), ("ingest", 2)]
    time.sleep(1.2)  # no gate op for longer than contended_seconds
    ours.sendall(b"".join(_frame((i, Bulk(100))) for i in range(10, 14)))
    assert [r[0] for r in _read_frames(ours, 4)] == [10, 11, 12, 13]
    assert groups[4:] == [("ingest", 4)]
    ours.close()
    thread.join(10)


def test_a_gate_op_arriving_while_ingest_ops_wait_goes_next() -> None:
    """Ingest ops waiting do not hold a gate op that arrives after them for more than one
    ingest group: the lanes alternate."""
    ours, theirs = socket.socketpair()
    decoder = msgspec.msgpack.Decoder(tuple[int, Ping | Bulk])
    groups: list[tuple[str, int]] = []
    gate_sent = threading.Event()

    class _Slow:
        def apply(self, tx: Any, op: Bulk) -> Any:
            gate_sent.wait(5)  # the gate op arrives while this group is being decided
            return lambda: op.events

    def writer() -> None:
        run_writer(_Store(), theirs, decoder.decode,  # type: ignore[arg-type]
                   {Ping: _Double(), Bulk: _Slow()},  # type: ignore[dict-item]
                   on_rollback=lambda store: None, tick_seconds=30,
                   on_group=lambda lane, ops, seconds, commit_s, ok: groups.append((lane, ops)),
                   bulk=(Bulk,), bulk_budget=lambda op: op.events, bulk_group_budget=1000)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    ours.sendall(b"".join(_frame((i, Bulk(1000))) for i in range(1, 5)))
    time.sleep(0.2)
    ours.sendall(_frame((9, Ping(4))))
    gate_sent.set()
    replies = _read_frames(ours, 5)
    assert [r[0] for r in replies] == [1, 9, 2, 3, 4]
    assert groups[:2] == [("ingest", 1), ("gate", 1)]
    ours.close()
    thread.join(10)


def test_a_gate_group_takes_along_the_small_ingest_ops_at_the_head_of_their_queue() -> None:
    """Single events waiting behind no batch ride in the gate's group (within the rider budget):
    one journal sync for both; a batch never does."""
    ours, theirs = socket.socketpair()
    decoder = msgspec.msgpack.Decoder(tuple[int, Ping | Bulk])
    groups: list[tuple[str, int]] = []

    def writer() -> None:
        run_writer(_Store(), theirs, decoder.decode,  # type: ignore[arg-type]
                   {Ping: _Double(), Bulk: _Count()},  # type: ignore[dict-item]
                   on_rollback=lambda store: None, tick_seconds=30,
                   on_group=lambda lane, ops, seconds, commit_s, ok: groups.append((lane, ops)),
                   bulk=(Bulk,), bulk_budget=lambda op: op.events, bulk_group_budget=1000,
                   rider_budget=4)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    ours.sendall(_frame((1, Bulk(1))) + _frame((2, Bulk(1))) + _frame((3, Ping(1)))
                 + _frame((4, Bulk(1000))) + _frame((5, Bulk(1))))
    replies = _read_frames(ours, 5)
    assert sorted(r[0] for r in replies[:3]) == [1, 2, 3]
    assert [r[0] for r in replies[3:]] == [4, 5]
    assert groups == [("gate", 3), ("ingest", 1), ("ingest", 1)]
    ours.close()
    thread.join(10)


class Events(msgspec.Struct, tag=True):
    ids: list[int]


class _Echo:
    def apply(self, tx: Any, op: Events) -> Any:
        if -1 in op.ids:
            raise ValueError("refused")  # this part fails alone (500)
        return lambda: op.ids


def _split(op: Events, n: int) -> tuple[Events, Events]:
    return Events(op.ids[:n]), Events(op.ids[n:])


def _run_split_writer(theirs: socket.socket, groups: list[tuple[str, int]]) -> None:
    decoder = msgspec.msgpack.Decoder(tuple[int, Ping | Events])
    run_writer(_Store(), theirs, decoder.decode,  # type: ignore[arg-type]
               {Ping: _Double(), Events: _Echo()},  # type: ignore[dict-item]
               on_rollback=lambda store: None, tick_seconds=30,
               on_group=lambda lane, ops, seconds, commit_s, ok: groups.append((lane, ops)),
               bulk=(Events,), bulk_budget=lambda op: len(op.ids), bulk_group_budget=4,
               split=_split, join=lambda parts: [i for p in parts for i in p])


def test_an_ingest_op_past_the_budget_is_cut_into_groups_and_answered_once_whole() -> None:
    """A 10-unit op with a budget of 4 goes in three groups (4, 4, 2) and gets one reply with
    every outcome in order; a gate op arriving with it goes first; an op after it fills the
    last group's room."""
    ours, theirs = socket.socketpair()
    groups: list[tuple[str, int]] = []
    thread = threading.Thread(target=_run_split_writer, args=(theirs, groups), daemon=True)
    thread.start()
    ours.sendall(_frame((1, Events(list(range(10))))) + _frame((2, Ping(3))) + _frame((3, Events([10, 11]))))
    replies = _read_frames(ours, 3)
    assert replies == [[2, True, 6], [1, True, list(range(10))], [3, True, [10, 11]]]
    assert groups == [("gate", 1), ("ingest", 1), ("ingest", 1), ("ingest", 2)]
    # A part that fails answers its op with the failure, once, and its later parts are dropped.
    ours.sendall(_frame((4, Events([20, 21, 22, 23, -1, 24, 25, 26, 27, 28]))) + _frame((5, Events([30]))))
    replies = _read_frames(ours, 2)
    assert replies[0][0] == 4 and replies[0][1] is False and replies[0][2]["status"] == 500
    assert replies[1] == [5, True, [30]]
    ours.close()
    thread.join(10)


def test_each_worker_connection_gets_the_greeting_and_its_own_replies(tmp_path: Any) -> None:
    """With a listener (`tollgate serve --workers N`), every connection is greeted, ops of all
    connections are answered each on its own (the same request id on two connections), a
    connection that closes is dropped, and only the service's own end ends the loop."""
    control, theirs = socket.socketpair()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "w.sock"))
    listener.listen(8)
    decoder = msgspec.msgpack.Decoder(tuple[int, Ping])
    greeting = _frame({"ready": True})
    ended: list[BaseException | None] = []

    def writer() -> None:
        try:
            run_writer(_Store(), theirs, decoder.decode, {Ping: _Double()},  # type: ignore[arg-type,dict-item]
                       on_rollback=lambda store: None, tick_seconds=30, listener=listener, greeting=greeting)
            ended.append(None)
        except BaseException as exc:
            ended.append(exc)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    workers = []
    for _ in range(3):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(tmp_path / "w.sock"))
        assert _read_frames(sock, 1) == [{"ready": True}]
        workers.append(sock)
    for n, sock in enumerate(workers):
        sock.sendall(_frame((1, Ping(n))) + _frame((2, Ping(100 + n))))
    for n, sock in enumerate(workers):
        assert sorted(_read_frames(sock, 2)) == [[1, True, 2 * n], [2, True, 2 * (100 + n)]]
    workers[0].close()  # a worker ends: the others go on
    workers[1].sendall(_frame((3, Ping(7))))
    assert _read_frames(workers[1], 1) == [[3, True, 14]]
    assert thread.is_alive() and ended == []
    control.close()  # the service's own end: the loop returns
    thread.join(10)
    assert ended == [None]
    for sock in workers[1:]:
        sock.close()
    listener.close()
