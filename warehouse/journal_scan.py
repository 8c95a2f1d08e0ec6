"""Reading the journal at start: what recovery may apply, what it may cut, and what it must
refuse; and the operator's way past a refusal (`tollgate journal accept-loss`).

A segment is a series of records [length][crc32][msgpack (group number, {table: rows})],
then zeros (a prefilled segment) or its end. A group is acknowledged only once its record is
synced, and group numbers go up by one from group to group, across segments. So:

- a bad or partial record with nothing valid after it, in its segment and in every later
  one, is the write that was in flight when the process died: never acknowledged, it is cut;
- a bad stretch followed by a valid record (in the same segment or a later one), or group
  numbers that do not follow on from the last group the operational file holds, means an
  acknowledged group may be lost: recovery refuses to start, changes nothing, and says which
  segment, where, and which group numbers are missing.

After a refusal the operator decides. `accept_loss` keeps a copy of every segment it changes
(byte for byte) in `journal-quarantine/`, rewrites the segment with its readable records, puts
an empty group in place of each group number accepted as lost (so the numbers follow on
again), and appends what it accepted to `journal-quarantine/accepted-loss.log`. Nothing is
deleted. `set_aside` moves a whole segment into the quarantine folder.

A bad record is told from garbage by its checksum: after a bad stretch, the scan looks for
the next offset where a record's header, checksum and decoding all hold. A flip inside the
last acknowledged record, with nothing after it, looks like a torn tail and is cut (with a
warning): no reader of this format can tell the two apart.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import struct
import zlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import msgspec

from warehouse.durable import sync_dir

__all__ = ["JournalCorrupt", "JournalScan", "Problem", "Record", "SegmentScan", "Stretch",
           "accept_loss", "scan_journal", "scan_segment", "set_aside"]

HEAD = struct.Struct(">II")  # payload length, crc32 of the payload
encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder(tuple[int, dict[str, list[tuple[Any, ...]]]]).decode
_ARRAY_OF_TWO = 0x92  # every payload is msgpack (group number, tables): a fixarray of 2

QUARANTINE = "journal-quarantine"
ACCEPTED_LOG = "accepted-loss.log"


@dataclass(frozen=True, slots=True)
class Record:
    """A valid record at [offset, end); `tables` is None when the scan did not keep them
    (`read_tables` decodes them again from the segment's bytes)."""
    seq: int
    offset: int
    end: int
    tables: dict[str, list[tuple[Any, ...]]] | None = field(default=None, repr=False, compare=False)


def read_tables(data: bytes, record: Record) -> dict[str, list[tuple[Any, ...]]]:
    """A record's rows, from the bytes of its segment."""
    if record.tables is not None:
        return record.tables
    _, tables = decode(memoryview(data)[record.offset + HEAD.size:record.end])
    return tables


@dataclass(frozen=True, slots=True)
class Stretch:
    """Bytes at [offset, end) that hold no valid record (and are not the zeros of a prefill)."""
    offset: int
    end: int


@dataclass(slots=True)
class SegmentScan:
    path: Path
    pieces: list[Record | Stretch]  # in file order

    @property
    def records(self) -> list[Record]:
        return [p for p in self.pieces if isinstance(p, Record)]

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True, slots=True)
class Problem:
    """Something that stops recovery: unreadable bytes followed by a valid record, a jump in
    group numbers, or a group number out of order; `at` is the valid record that follows."""
    kind: str  # "unreadable", "gap" or "out-of-order"
    segment: str
    offset: int  # of the first bad byte, or of the record after the gap
    stretches: tuple[tuple[str, Stretch], ...]
    missing: tuple[int, int] | None  # the first and last group number not found
    after: int  # the last group number read before it
    at: tuple[str, Record]

    @property
    def reach(self) -> int:
        """The highest group number an operator accepts to lose with it."""
        return self.missing[1] if self.missing else self.after

    def describe(self) -> str:
        seg, rec = self.at
        lost = (f"group {_span(self.missing)} {'is' if self.missing[0] == self.missing[1] else 'are'}"
                " missing" if self.missing else "no group number is missing")
        if self.kind == "out-of-order":
            return (f"segment {seg} offset {rec.offset}: group {rec.seq} comes after group"
                    f" {self.after} (a number out of order)")
        if self.kind == "gap":
            return f"segment {seg} offset {rec.offset}: group {rec.seq} follows group {self.after}; {lost}"
        where = ", ".join(f"{s.end - s.offset} unreadable bytes at offset {s.offset}"
                          + ("" if name == self.segment else f" of {name}")
                          for name, s in self.stretches)
        later = "" if seg == self.segment else f" in segment {seg}"
        return f"segment {self.segment}: {where}, then readable group {rec.seq}{later}; {lost}"


def _span(missing: tuple[int, int] | None) -> str:
    assert missing is not None
    first, last = missing
    return str(first) if first == last else f"{first}-{last}"


@dataclass(slots=True)
class JournalScan:
    """Every segment of a journal folder, read against `applied` (the last group the
    operational file holds)."""
    directory: Path
    applied: int
    segments: list[SegmentScan]
    problems: list[Problem]
    torn: list[tuple[str, Stretch]]  # unfinished records with nothing valid after them

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_apply(self) -> list[int]:
        return [r.seq for s in self.segments for r in s.records if r.seq > self.applied]

    def command(self) -> str:
        data_dir = shlex.quote(str(self.directory.parent))
        if any(p.kind == "out-of-order" for p in self.problems):
            names = sorted({p.at[0] for p in self.problems if p.kind == "out-of-order"})
            return f"tollgate journal accept-loss --segment {names[0]} --data-dir {data_dir}"
        through = max(p.reach for p in self.problems)
        return f"tollgate journal accept-loss --through {through} --data-dir {data_dir}"

    def refusal(self) -> str:
        """The one paragraph the writer prints when it will not start."""
        found = "; ".join(p.describe() for p in self.problems)
        data_dir = shlex.quote(str(self.directory.parent))
        return (f"the journal in {self.directory} may have lost acknowledged groups, so the writer"
                f" did not start: {found} (the operational file holds groups up to {self.applied})."
                " Nothing was applied, cut or deleted. See what recovery found with"
                f" `tollgate journal check --data-dir {data_dir}`; to accept the loss and start"
                f" without those groups, run `{self.command()}` (it keeps a copy of every segment"
                f" it changes in {QUARANTINE}/ and records what it accepted in"
                f" {QUARANTINE}/{ACCEPTED_LOG}).")

    def report(self) -> list[str]:
        """What recovery would do, a line each (`tollgate journal check`)."""
        lines = [f"operational file: groups up to {self.applied} applied"]
        for seg in self.segments:
            seqs = [r.seq for r in seg.records]
            held = f"groups {seqs[0]}-{seqs[-1]}" if seqs else "no groups"
            lines.append(f"segment {seg.name}: {held} in {len(seqs)} records")
        for name, stretch in self.torn:
            lines.append(f"segment {name}: an unfinished record at offset {stretch.offset}"
                         " with nothing valid after it (never acknowledged): recovery cuts it")
        for problem in self.problems:
            lines.append(f"problem: {problem.describe()}")
        todo = self.to_apply()
        if self.problems:
            lines.append(f"recovery refuses to start; to accept the loss: {self.command()}")
        elif todo:
            lines.append(f"recovery applies groups {todo[0]}-{todo[-1]} ({len(todo)} groups)")
        else:
            lines.append("recovery has nothing to apply")
        return lines


class JournalCorrupt(Exception):
    """Recovery found a group that may be lost; the message says what and what to run."""

    def __init__(self, scan: JournalScan) -> None:
        super().__init__(scan.refusal())
        self.scan = scan


def _record_at(data: bytes, at: int, keep: bool = True) -> Record | None:
    if at + HEAD.size > len(data):
        return None
    size, crc = HEAD.unpack_from(data, at)
    end = at + HEAD.size + size
    if size == 0 or end > len(data) or data[at + HEAD.size] != _ARRAY_OF_TWO:
        return None
    payload = memoryview(data)[at + HEAD.size:end]
    if zlib.crc32(payload) != crc:
        return None
    try:
        seq, tables = decode(payload)
    except msgspec.MsgspecError:
        return None
    if seq < 1:
        return None
    return Record(seq, at, end, tables if keep else None)


def _next_record(data: bytes, start: int) -> Record | None:
    """The first valid record that starts at `start` or later (a header eight bytes before
    each 0x92 byte is a candidate: zeros cost nothing to skip)."""
    find = data.find(bytes([_ARRAY_OF_TWO]), start + HEAD.size)
    while find >= 0:
        record = _record_at(data, find - HEAD.size)
        if record is not None:
            return record
        find = data.find(bytes([_ARRAY_OF_TWO]), find + 1)
    return None


def scan_segment(path: Path, keep_tables: bool = True) -> SegmentScan:
    """Read one segment: its records and the stretches between or after them that hold none.
    Without `keep_tables`, each record is decoded to check it and its rows are let go.

    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "000000000001.journal"
    >>> one, two = encode((1, {})), encode((2, {}))
    >>> body = HEAD.pack(len(one), zlib.crc32(one)) + one + HEAD.pack(len(two), zlib.crc32(two)) + two
    >>> _ = p.write_bytes(body + bytes(64))
    >>> [r.seq for r in scan_segment(p).records]
    [1, 2]
    >>> _ = p.write_bytes(body[:9] + b"X" + body[10:])
    >>> [type(piece).__name__ for piece in scan_segment(p).pieces]
    ['Stretch', 'Record']
    """
    data = path.read_bytes()
    pieces: list[Record | Stretch] = []
    at = 0
    while at < len(data):
        record = _record_at(data, at, keep_tables)
        if record is not None:
            pieces.append(record)
            at = record.end
            continue
        if data.count(0, at) == len(data) - at:
            break  # zeros: where the next group would have gone
        following = _next_record(data, at + 1)
        pieces.append(Stretch(at, following.offset if following else len(data)))
        if following is None:
            break
        at = following.offset
    return SegmentScan(path, pieces)


def segment_paths(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.journal"))


def scan_journal(directory: Path, applied: int, paths: list[Path] | None = None, *,
                 keep_tables: bool = True) -> JournalScan:
    """Read every segment in order and check the group numbers against `applied` (without
    `keep_tables`, holding no record's rows: a large journal costs no memory here)."""
    segments = [scan_segment(p, keep_tables)
                for p in (segment_paths(directory) if paths is None else paths)]
    problems: list[Problem] = []
    last = applied
    pending: list[tuple[str, Stretch]] = []
    for seg in segments:
        for piece in seg.pieces:
            if isinstance(piece, Stretch):
                pending.append((seg.name, piece))
                continue
            before, missing, kind = last, None, "unreadable"
            if piece.seq <= applied and last == applied:
                pass  # in the file already (its segment was not deleted yet)
            elif piece.seq == last + 1:
                last = piece.seq
            elif piece.seq > last + 1:
                missing, last, kind = (last + 1, piece.seq - 1), piece.seq, "gap"
            else:
                kind = "out-of-order"
            if pending and kind == "gap":
                kind = "unreadable"
            if pending or kind != "unreadable":
                where = pending[0] if pending else (seg.name, Stretch(piece.offset, piece.offset))
                problems.append(Problem(kind, where[0], where[1].offset, tuple(pending), missing,
                                        before, (seg.name, piece)))
            pending = []
    return JournalScan(directory, applied, segments, problems, pending)


def applied_seq(operational: Path) -> int:
    """The last group the operational file holds (0 without a file), read-only."""
    if not operational.exists():
        return 0
    import duckdb

    conn = duckdb.connect(str(operational), read_only=True)
    try:
        row = conn.execute("SELECT coalesce(max(applied_seq), 0) FROM journal_state").fetchone()
    finally:
        conn.close()
    return int(row[0]) if row else 0


# ---- the operator's side ------------------------------------------------------------------

def _quarantine(directory: Path) -> Path:
    folder = directory.parent / QUARANTINE
    folder.mkdir(exist_ok=True)
    return folder


def _aside_name(folder: Path, name: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = folder / f"{stamp}-{name}"
    n = 1
    while target.exists():
        n += 1
        target = folder / f"{stamp}-{n}-{name}"
    return target


def _log(folder: Path, entry: dict[str, Any]) -> None:
    entry = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **entry}
    with open(folder / ACCEPTED_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _filler(seq: int) -> bytes:
    payload = encode((seq, {}))
    return HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def accept_loss(scan: JournalScan, through: int) -> list[Problem]:
    """Accept the problems of `scan` that lose no group beyond `through` (not those out of
    order: `set_aside` is for them); the problems accepted. Each segment changed is first
    copied, byte for byte, into the quarantine folder, then replaced (atomically) by its
    readable records, with an empty group for each accepted missing number."""
    accepted = [p for p in scan.problems if p.kind != "out-of-order" and p.reach <= through]
    if not accepted:
        return []
    drop: dict[str, set[Stretch]] = {}
    fill: dict[str, dict[int, tuple[int, int]]] = {}  # segment -> record offset -> missing
    for p in accepted:
        for name, stretch in p.stretches:
            drop.setdefault(name, set()).add(stretch)
        if p.missing:
            fill.setdefault(p.at[0], {})[p.at[1].offset] = p.missing
    folder = _quarantine(scan.directory)
    for seg in scan.segments:
        dropped, filled = drop.get(seg.name, set()), fill.get(seg.name, {})
        if not dropped and not filled:
            continue
        data = seg.path.read_bytes()
        out = bytearray()
        for piece in seg.pieces:
            if isinstance(piece, Stretch):
                if piece not in dropped:
                    out += data[piece.offset:piece.end]
                continue
            if piece.offset in filled:
                first, last = filled[piece.offset]
                for seq in range(first, last + 1):
                    out += _filler(seq)
            out += data[piece.offset:piece.end]
        aside = _aside_name(folder, seg.name)
        shutil.copyfile(seg.path, aside)
        with open(aside, "rb+") as f:
            os.fsync(f.fileno())
        sync_dir(folder)
        tmp = seg.path.with_name(seg.name + ".repair.tmp")
        with open(tmp, "wb") as f:
            f.write(out)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, seg.path)
        sync_dir(seg.path.parent)
        mine = [p for p in accepted if p.at[0] == seg.name or any(n == seg.name for n, _ in p.stretches)]
        _log(folder, {
            "action": "rewrote segment without its unreadable bytes",
            "segment": seg.name, "original_kept_as": f"{QUARANTINE}/{aside.name}",
            "through": through, "applied_before": scan.applied,
            "unreadable": [[s.offset, s.end - s.offset] for s in sorted(dropped, key=lambda s: s.offset)],
            "lost_groups": [list(m) for m in filled.values()],
            "problems": [p.describe() for p in mine],
        })
    return accepted


def set_aside(scan: JournalScan, name: str) -> Path:
    """Move segment `name` whole into the quarantine folder (its groups not yet in the file
    are lost, and recorded as such); where it went."""
    found = [s for s in scan.segments if s.name == name]
    if not found:
        raise FileNotFoundError(f"no journal segment {name!r} in {scan.directory}")
    seg = found[0]
    folder = _quarantine(scan.directory)
    aside = _aside_name(folder, seg.name)
    os.rename(seg.path, aside)
    sync_dir(folder)
    sync_dir(seg.path.parent)
    seqs = [r.seq for r in seg.records if r.seq > scan.applied]
    _log(folder, {"action": "moved segment aside", "segment": seg.name,
                  "original_kept_as": f"{QUARANTINE}/{aside.name}", "applied_before": scan.applied,
                  "lost_groups": seqs, "problems": [p.describe() for p in scan.problems
                                                    if p.at[0] == name or p.segment == name]})
    return aside
