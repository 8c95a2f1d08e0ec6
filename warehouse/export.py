"""Export from the operational file to the lake: exactly once, in commit order, in micro-batches.

Three streams leave the operational file, each ordered by its `seq` (the writer assigns seq
in commit order, so a snapshot of a table always holds a prefix of its seqs):

    events          -> lake.events (every column and the export id) and lake.event_labels
    commit_lines    -> lake.rating_rows (source gate_commit, run 'gate'; read as lake.ratings)
    inline_ratings  -> lake.rating_rows (source event, run 'inline' unless the row names one)

A round reads, per stream, the rows after the stream's watermark (`export_watermarks` in the
operational file), writes all of them to the lake in ONE lake transaction together with one
`lake.export_log` row per stream (its export id is the watermark's plus one), and only then
advances the watermarks in the operational file. A crash between the two commits leaves the
lake one export ahead of the file; before it writes anything, the exporter reconciles (at
start and after any failure): the watermark is set to the lake's last export of the stream
(an export_log row with the next export id means that export already landed, so the
watermark moves to its `to_seq` and nothing is written again), once the lake's last row is
checked to be this file's row. The lake transaction itself refuses an export id it already
holds, so even a retried commit whose first attempt did land cannot write a row twice.

The exporter runs in a thread of the writer process on a cursor of its own (a separate
connection to the same database), so lake commits never hold up the group-commit loop.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from core.clock import SYSTEM_CLOCK, Clock
from core.priority import run_in_background
from warehouse.compaction import expire_snapshots
from warehouse.lake import attach_lake, export_turn, transaction, with_lake_retry
from warehouse.usage_days import rollup_rows_sql

__all__ = ["BATCH_ROWS", "STREAMS", "ExportMismatch", "LakeExporter", "Watermark",
           "run_exporter_thread"]

log = logging.getLogger("tollgate.export")

STREAMS: tuple[str, ...] = ("events", "commit_lines", "inline_ratings")
BATCH_ROWS = 50_000
# How often the exporter expires the lake's snapshots older than its window (`_expire_due`).
EXPIRE_EVERY_SECONDS = 600.0

# The run ids under which exported ratings appear, and the kind of each in lake.rating_runs.
_RUN_KINDS = {"gate": "gate", "inline": "inline"}

# Per stream: the identity of the file's row at a seq, and whether the lake holds it.
_IDENTITY: dict[str, tuple[str, str]] = {
    "events": ("SELECT event_id::VARCHAR FROM events WHERE seq = ?",
               "SELECT count(*) FROM lake.events WHERE event_id = ?::UUID AND seq = ?"),
    "commit_lines": ("SELECT line_id FROM commit_lines WHERE seq = ?",
                     "SELECT count(*) FROM lake.rating_rows WHERE rating_id = ? AND source = 'gate_commit'"),
    "inline_ratings": ("SELECT rating_id FROM inline_ratings WHERE seq = ?",
                       "SELECT count(*) FROM lake.rating_rows WHERE rating_id = ? AND source = 'event'"),
}

_RATING_COLUMNS = (
    "rating_id, run_id, source, source_id, event_id, realm, billing_account_id, status, "
    "policy_id, policy_version, feature_code, meter_code, quantity_minor, price_id, "
    "unit_price_xusd, unit_quantity_minor, amount_xusd, occurred_at, rated_at, line_index"
)


# When each stream's row was accepted (the export lag's measure).
_TIME_COLUMN = {"events": "created_at", "commit_lines": "committed_at", "inline_ratings": "rated_at"}


class ExportMismatch(Exception):
    """The lake holds an export that does not follow the file's watermark: exporting on would
    either skip or repeat rows, so the stream stops until an operator looks."""


@dataclass(frozen=True, slots=True)
class Watermark:
    stream: str
    last_seq: int
    export_id: int


@dataclass(frozen=True, slots=True)
class _Batch:
    stream: str
    rows: pa.Table
    export_id: int
    from_seq: int
    to_seq: int
    full: bool  # the read hit the batch limit: more rows are probably waiting


class LakeExporter:
    """Moves committed operational rows to the lake. One instance per exporting thread; the
    lake connection it opens is used only by the thread that calls `export_once`."""

    def __init__(self, data_dir: Path, *, batch_rows: int = BATCH_ROWS,
                 clock: Clock = SYSTEM_CLOCK, snapshot_window: timedelta | None = None,
                 expire_every: float = EXPIRE_EVERY_SECONDS) -> None:
        self.clock = clock
        self.data_dir = data_dir
        self.batch_rows = batch_rows
        # The lake's snapshots older than this are expired every `expire_every` seconds (the
        # first time in the first round): None leaves them to the `compact-lake` flow.
        self.snapshot_window = snapshot_window
        self.expire_every = expire_every
        self._expire_at = 0.0  # time.monotonic() of the next expiry
        self.snapshots_expired = 0
        self.snapshots_kept = 0  # after the last expiry
        self.expire_failures = 0
        self.behind = False  # the last round left rows behind (a full batch)
        self._lake: duckdb.DuckDBPyConnection | None = None
        self._reconciled: set[str] = set()
        self._runs_recorded: set[str] = set()
        self._labels_select: str | None = None
        # For the writer's metrics (read from the writer's thread; plain values, no lock).
        self.rows_exported = {s: 0 for s in STREAMS}
        self.rows_behind = {s: 0 for s in STREAMS}  # left for later rounds by the last one
        self.failures = 0
        self.rounds = 0  # rounds that shipped rows, and their time
        self.round_seconds = 0.0
        self.caught_up_at = time.time()  # every row accepted before it is in the lake
        # The last seq of each stream the lake holds (its watermark; None until a round has
        # read it, or the writer set it from the file at its start): with the writer's last
        # seq it gives the backlog ingestion is refused past (`writer.host`,
        # TOLLGATE_EXPORT_BACKLOG_ROWS).
        self.exported_seq: dict[str, int | None] = {s: None for s in STREAMS}
        self.events_exported_at = 0.0  # when the last round that shipped events committed
        # Held while this exporter uses the operational file; the file's checkpoint takes it
        # too (`warehouse.retention`), so it never meets one of this thread's transactions.
        self.op_lock = threading.Lock()

    # ---- one round -------------------------------------------------------------------
    def export_once(self, op_conn: duckdb.DuckDBPyConnection) -> dict[str, int]:
        """Export what was committed since the last round; rows exported per stream."""
        try:
            return self._round(op_conn)
        except BaseException:
            self.failures += 1
            # Whatever failed, the lake may now hold an export the file does not know of:
            # reconcile every stream before the next write, on a fresh lake connection.
            self._reconciled.clear()
            self.close()
            raise

    def close(self) -> None:
        if self._lake is not None:
            try:
                self._lake.close()
            except duckdb.Error:
                pass
            self._lake = None

    def _round(self, op_conn: duckdb.DuckDBPyConnection) -> dict[str, int]:
        with export_turn(self.data_dir) as turn:
            if not turn:
                # The lake's compaction holds the lake (`warehouse.lake.compaction_turn`):
                # nothing is exported until it ends; the rows wait in the operational file.
                self.behind = False
                return {s: 0 for s in STREAMS}
            counts = self._round_in_turn(op_conn)
            self._expire_due()
            return counts

    def _expire_due(self) -> None:
        """Expire the lake's snapshots older than the window, when it is time (in the
        exporter's turn, so the compaction never meets it). Each export round adds a
        snapshot, about one a second under traffic, and every lake transaction reads the
        whole snapshot table first (`warehouse.compaction.expire_snapshots`): kept for the
        compaction's week they would have cost each round ~90 ms. A failure is logged and
        tried again at the next time; it never fails the round."""
        if self.snapshot_window is None or time.monotonic() < self._expire_at:
            return
        self._expire_at = time.monotonic() + self.expire_every
        began = time.perf_counter()
        lake = self._lake_connection()
        try:
            expired, deleted = expire_snapshots(lake, keep=self.snapshot_window, clock=self.clock)
            rows = lake.execute("SELECT count(*) FROM ducklake_snapshots('lake')").fetchall()
        except duckdb.Error:
            self.expire_failures += 1
            log.warning("expiring the lake's old snapshots failed; tried again in %.0f s",
                        self.expire_every, exc_info=True)
            return
        self.snapshots_expired += expired
        self.snapshots_kept = int(rows[0][0]) if rows else 0
        log.info("expired %d lake snapshots older than %s (%d kept), deleted %d files, in %.2f s",
                 expired, self.snapshot_window, self.snapshots_kept, deleted,
                 time.perf_counter() - began)

    def _round_in_turn(self, op_conn: duckdb.DuckDBPyConnection) -> dict[str, int]:
        began = time.time()
        lake = self._lake_connection()
        with self.op_lock:
            marks = self._read_watermarks(op_conn)
            for stream in STREAMS:
                if stream not in self._reconciled:
                    marks[stream] = self._reconcile(op_conn, lake, marks[stream])
                    self._reconciled.add(stream)
                self.exported_seq[stream] = marks[stream].last_seq
            batches = [b for b in (self._read_batch(op_conn, marks[s]) for s in STREAMS) if b is not None]
        self.behind = any(b.full for b in batches)
        counts = {s: 0 for s in STREAMS}
        if not batches:
            self.caught_up_at = began
            self.rows_behind = dict(counts)
            return counts
        labels_select = self._labels_query(op_conn)
        now = self.clock.now()
        with_lake_retry(lambda: self._write_lake(lake, batches, labels_select, now))
        with self.op_lock:
            self._advance_watermarks(op_conn, batches, now)
        self.rounds += 1
        self.round_seconds += time.time() - began
        behind = dict(counts)
        for batch in batches:
            counts[batch.stream] = batch.rows.num_rows
            self.rows_exported[batch.stream] += batch.rows.num_rows
            if batch.stream == "events":
                self.events_exported_at = time.time()
            if batch.full:  # only then is a count worth its query
                with self.op_lock:
                    # fetchall: a result left open holds its transaction, and the file's
                    # checkpoint waits for every transaction (`warehouse.retention`).
                    rows = op_conn.execute(f"SELECT count(*) FROM {batch.stream} WHERE seq > ?",
                                           [batch.to_seq]).fetchall()
                behind[batch.stream] = int(rows[0][0]) if rows else 0
        self.rows_behind = behind
        # Every row accepted before `shipped_to` is in the lake: the round's start if it
        # shipped all it read, else the newest row a full batch carried. A sustained load
        # keeps every batch full, and the lag is then the age of the oldest row left behind,
        # not the time since the exporter last found nothing to do (which grew without end).
        shipped_to = began
        for batch in batches:
            if batch.full:
                last = batch.rows.column(_TIME_COLUMN[batch.stream])[-1].as_py()
                if last is not None:
                    shipped_to = min(shipped_to, last.timestamp())
        self.caught_up_at = max(self.caught_up_at, shipped_to)
        return counts

    # ---- the operational side -------------------------------------------------------
    @staticmethod
    def _read_watermarks(op_conn: duckdb.DuckDBPyConnection) -> dict[str, Watermark]:
        marks = {s: Watermark(s, 0, 0) for s in STREAMS}
        for stream, last_seq, export_id in op_conn.execute(
                "SELECT stream, last_seq, export_id FROM export_watermarks").fetchall():
            if stream in marks:
                marks[stream] = Watermark(stream, int(last_seq), int(export_id))
        return marks

    def _read_batch(self, op_conn: duckdb.DuckDBPyConnection, mark: Watermark) -> _Batch | None:
        limit = self.batch_rows
        # A range of seqs, not `seq > mark ORDER BY seq LIMIT n`: a top-n reads every row
        # past the mark, so a round cost grew with the backlog (50,000 rows 8 M rows behind:
        # 1.6 s, against 25 ms for the range at any backlog; docs/measurements.md, "The
        # export's read"), and an exporter that fell behind under load fell further behind.
        # Seqs ascend with insertion, so DuckDB's zone maps skip every other row group.
        if mark.stream == "commit_lines":
            # line_index is the line's place in its commit. A commit's lines are committed
            # together, so a batch holds whole commits unless the limit cuts the last one,
            # which is then left for the next round (below).
            sql = ("SELECT *, (row_number() OVER (PARTITION BY commit_id ORDER BY seq) - 1)::INTEGER "
                   "AS line_index FROM (SELECT * FROM commit_lines WHERE seq > ? AND seq <= ?) "
                   "ORDER BY seq")
        else:
            sql = f"SELECT * FROM {mark.stream} WHERE seq > ? AND seq <= ? ORDER BY seq"
        start = mark.last_seq
        rows = op_conn.execute(sql, [start, start + limit]).to_arrow_table()
        if rows.num_rows == 0:
            # Seqs have no gaps today; should a stream ever have one wider than a batch, the
            # next stored seq is where its range starts.
            found = op_conn.execute(f"SELECT min(seq) FROM {mark.stream} WHERE seq > ?",
                                    [start]).fetchall()
            if not found or found[0][0] is None:
                return None
            start = int(found[0][0]) - 1
            rows = op_conn.execute(sql, [start, start + limit]).to_arrow_table()
        if rows.num_rows == 0:
            return None
        # Full: the range's last seq is in the batch, so more may follow at once.
        full = rows.num_rows >= limit or int(rows.column("seq")[-1].as_py()) >= start + limit
        if full and mark.stream == "commit_lines":
            commits = rows.column("commit_id")
            last = commits[-1]
            keep = pc.invert(pc.equal(commits, last))
            if pc.any(keep).as_py():
                rows = rows.filter(keep)
        seqs = rows.column("seq")
        return _Batch(mark.stream, rows, mark.export_id + 1, int(seqs[0].as_py()),
                      int(seqs[-1].as_py()), full)

    @staticmethod
    def _store_watermark(op_conn: duckdb.DuckDBPyConnection, mark: Watermark, now: datetime) -> None:
        op_conn.execute(
            "INSERT INTO export_watermarks (stream, last_seq, export_id, exported_at) "
            "VALUES (?, ?, ?, ?) ON CONFLICT (stream) DO UPDATE SET last_seq = excluded.last_seq, "
            "export_id = excluded.export_id, exported_at = excluded.exported_at",
            [mark.stream, mark.last_seq, mark.export_id, now])

    def _advance_watermarks(self, op_conn: duckdb.DuckDBPyConnection, batches: list[_Batch],
                            now: datetime) -> None:
        """The step after the lake commit: one operational transaction for every stream."""
        with transaction(op_conn):
            for batch in batches:
                self._store_watermark(op_conn, Watermark(batch.stream, batch.to_seq, batch.export_id), now)
        for batch in batches:
            self.exported_seq[batch.stream] = batch.to_seq

    def _labels_query(self, op_conn: duckdb.DuckDBPyConnection) -> str:
        """The SELECT of the operational `event_labels` view, to run over one batch of events.

        Run in the file, the view types the labels of every event ever stored on each call;
        run over a batch registered as `events`, it costs only that batch, and the typing rules
        still come from the one definition in the file."""
        if self._labels_select is None:
            row = op_conn.execute(
                "SELECT sql FROM duckdb_views() WHERE database_name = current_database() "
                "AND schema_name = 'main' AND view_name = 'event_labels'").fetchone()
            if row is None:
                raise RuntimeError("the operational file has no event_labels view")
            body = re.sub(r"^\s*CREATE\s+(?:OR\s+REPLACE\s+)?VIEW\s+\S+\s+AS\s+", "", str(row[0]),
                          count=1, flags=re.IGNORECASE)
            self._labels_select = body.strip().rstrip(";")
        return self._labels_select

    # ---- the lake side --------------------------------------------------------------
    def _lake_connection(self) -> duckdb.DuckDBPyConnection:
        if self._lake is None:
            conn = duckdb.connect()
            # One thread exports ~50,000 events with their labels a second here, more than
            # the service accepts; more threads would only take cores from the writer.
            conn.execute("SET threads = 1")
            attach_lake(conn, self.data_dir)
            self._lake = conn
        return self._lake

    def _reconcile(self, op_conn: duckdb.DuckDBPyConnection, lake: duckdb.DuckDBPyConnection,
                   mark: Watermark) -> Watermark:
        """Set the watermark to the lake's last export of the stream: the lake is the record
        of what was exported, the watermark only its copy in the file.

        Usually they agree. After a crash between the two commits the lake is one export
        ahead: the watermark moves over it and nothing is written again. A lake restored from
        an older copy (or removed) is behind: the rows after its last export go again."""
        last = with_lake_retry(lambda: lake.execute(
            "SELECT export_id, to_seq FROM lake.export_log WHERE stream = ? "
            "ORDER BY export_id DESC LIMIT 1", [mark.stream]).fetchone())
        found = Watermark(mark.stream, 0, 0) if last is None else Watermark(mark.stream, int(last[1]), int(last[0]))
        if found == mark:
            return mark
        if last is not None:
            self._check_same_source(op_conn, lake, found, mark)
        if found.export_id > mark.export_id:
            log.warning("export %s#%d reached the lake before a crash; moving the watermark to seq %d "
                        "without writing again", mark.stream, found.export_id, found.last_seq)
        else:
            log.warning("the lake's last export of %s is #%d (seq %d) but the file recorded #%d "
                        "(seq %d); exporting again from seq %d", mark.stream, found.export_id,
                        found.last_seq, mark.export_id, mark.last_seq, found.last_seq + 1)
        self._store_watermark(op_conn, found, self.clock.now())
        return found

    @staticmethod
    def _check_same_source(op_conn: duckdb.DuckDBPyConnection, lake: duckdb.DuckDBPyConnection,
                           found: Watermark, mark: Watermark) -> None:
        """The last exported row must be this file's row at that seq: a lake filled from
        another operational file (or a file started afresh) would otherwise skip rows. A row
        the file no longer holds left it after its export (`warehouse.retention`): the file's
        own watermark, at or past it, vouches for it."""
        op_sql, lake_sql = _IDENTITY[found.stream]
        row = op_conn.execute(op_sql, [found.last_seq]).fetchone()
        if row is None and 0 < found.last_seq <= mark.last_seq:
            return
        held = None
        if row is not None:
            params = [row[0], found.last_seq] if found.stream == "events" else [row[0]]
            held = with_lake_retry(lambda: lake.execute(lake_sql, params).fetchone())
        if not held or not held[0]:
            raise ExportMismatch(
                f"the lake's export {found.stream}#{found.export_id} ends at seq {found.last_seq}, "
                "which is not this operational file's row; the lake was filled from another file")

    def _write_lake(self, lake: duckdb.DuckDBPyConnection, batches: list[_Batch],
                    labels_select: str, now: datetime) -> None:
        """One lake transaction: every batch of the round and its export_log row."""
        registered: list[str] = []
        try:
            with transaction(lake):
                for batch in batches:
                    held = lake.execute("SELECT count(*) FROM lake.export_log WHERE stream = ? AND export_id = ?",
                                        [batch.stream, batch.export_id]).fetchone()
                    if held and held[0]:
                        raise ExportMismatch(f"lake already holds export {batch.stream}#{batch.export_id}")
                    # The events batch goes by `events`: the label view's SELECT reads that name.
                    name = "events" if batch.stream == "events" else f"export_{batch.stream}"
                    lake.register(name, batch.rows)
                    registered.append(name)
                    if batch.stream == "events":
                        self._write_events(lake, name, batch, labels_select)
                    elif batch.stream == "commit_lines":
                        self._write_commit_lines(lake, name)
                    else:
                        self._write_inline_ratings(lake, name, batch)
                    lake.execute("INSERT INTO lake.export_log VALUES (?, ?, ?, ?, ?, ?)",
                                 [batch.stream, batch.export_id, batch.from_seq, batch.to_seq,
                                  batch.rows.num_rows, now])
                runs = self._new_runs(lake, batches, now)
        finally:
            for name in registered:
                lake.unregister(name)
        self._runs_recorded.update(runs)

    @staticmethod
    def _write_events(lake: duckdb.DuckDBPyConnection, name: str, batch: _Batch,
                      labels_select: str) -> None:
        lake.execute(
            "INSERT INTO lake.events (event_id, realm, billing_account_id, request_hash, "
            "semantic_kind, event_type, occurred_at, subject_ref, payload, labels, created_at, "
            "ingest_path, seq, export_id) "
            "SELECT event_id::UUID, realm, billing_account_id, request_hash, semantic_kind, "
            "event_type, occurred_at, subject_ref, payload::JSON, labels::JSON, created_at, "
            f"ingest_path, seq, ? FROM {name} ORDER BY seq", [batch.export_id])
        lake.execute(
            "INSERT INTO lake.event_labels (event_id, realm, billing_account_id, key, slot, "
            "value_text, value_uuid, value_bool, value_number, export_id) "
            "SELECT event_id::UUID, realm, billing_account_id, key, slot, value_text, "
            f"value_uuid::UUID, value_bool, value_number, ? FROM ({labels_select})",
            [batch.export_id])

    @staticmethod
    def _write_commit_lines(lake: duckdb.DuckDBPyConnection, name: str) -> None:
        lake.execute(
            f"INSERT INTO lake.rating_rows ({_RATING_COLUMNS}) "
            "SELECT line_id, 'gate', 'gate_commit', commit_id, NULL, realm, billing_account_id, "
            "'rated', NULL, NULL, feature_code, meter_code, quantity_minor, price_id, "
            "unit_price_xusd, unit_quantity_minor, amount_xusd, committed_at, committed_at, "
            f"line_index FROM {name} ORDER BY seq")
        lake.execute(rollup_rows_sql("lake", (
            "(SELECT 'gate' AS run_id, realm, billing_account_id, committed_at AS occurred_at, price_id,"
            " quantity_minor, amount_xusd, CAST(NULL AS BIGINT) AS line_id, 'rated' AS status, feature_code,"
            f" meter_code, line_index FROM {name})")))

    @staticmethod
    def _write_inline_ratings(lake: duckdb.DuckDBPyConnection, name: str, batch: _Batch) -> None:
        columns = set(batch.rows.column_names)
        run_id = "coalesce(run_id, 'inline')" if "run_id" in columns else "'inline'"
        source_id = ("coalesce(source_id, event_id::VARCHAR)" if "source_id" in columns
                     else "event_id::VARCHAR")
        lake.execute(
            f"INSERT INTO lake.rating_rows ({_RATING_COLUMNS}) "
            f"SELECT rating_id, {run_id}, 'event', {source_id}, event_id::UUID, realm, "
            "billing_account_id, status, policy_id, policy_version, feature_code, meter_code, "
            "quantity_minor, price_id, unit_price_xusd, unit_quantity_minor, amount_xusd, "
            f"occurred_at, rated_at, line_index FROM {name} ORDER BY seq")

    def _new_runs(self, lake: duckdb.DuckDBPyConnection, batches: list[_Batch],
                  now: datetime) -> set[str]:
        """Give the standing runs 'gate' and 'inline' their lake.rating_runs row, once."""
        used: set[str] = set()
        for batch in batches:
            if batch.stream == "commit_lines":
                used.add("gate")
            elif batch.stream == "inline_ratings":
                names = batch.rows.column_names
                used |= ({"inline"} if "run_id" not in names else
                         {r or "inline" for r in batch.rows.column("run_id").unique().to_pylist()})
        used &= _RUN_KINDS.keys()
        wanted = used - self._runs_recorded
        for run_id in sorted(wanted):
            lake.execute(
                "INSERT INTO lake.rating_runs SELECT ?, ?, 'open', ?, NULL, '{}', NULL, NULL "
                "WHERE NOT EXISTS (SELECT 1 FROM lake.rating_runs WHERE run_id = ?)",
                [run_id, _RUN_KINDS[run_id], now, run_id])
        return wanted


def run_exporter_thread(op_conn: duckdb.DuckDBPyConnection, data_dir: Path,
                        stop: threading.Event, interval: float = 1.0,
                        batch_rows: int = BATCH_ROWS,
                        exporter: LakeExporter | None = None) -> threading.Thread:
    """Start exporting in a thread of its own until `stop` is set (then last rounds until
    the lake holds everything the file does, or a round fails).

    Call it from the thread that owns `op_conn`, before that thread starts using it: the
    cursor made here is a separate connection to the same database, used only by the new
    thread. Failures are logged and retried with a growing pause (at most 30 s). `exporter`,
    when given, is the one used (its counters feed the writer's metrics)."""
    cursor = op_conn.cursor()
    if exporter is None:
        exporter = LakeExporter(data_dir, batch_rows=batch_rows)
    shipper = exporter

    def loop() -> None:
        run_in_background()
        pause = interval
        try:
            while True:
                stopping = stop.is_set()
                more_waiting = False  # stays False when the round fails
                try:
                    counts = shipper.export_once(cursor)
                    if any(counts.values()):
                        log.debug("exported %s", counts)
                    more_waiting = shipper.behind
                    pause = 0.0 if shipper.behind else interval
                except Exception:
                    if stop.is_set():
                        # The writer closes the file when the service's stop bound for the
                        # export has passed, also under a round: what is left goes after the
                        # next start, exactly once (export ids), so this is no failure.
                        log.info("lake export stopped with the writer; the rest is exported"
                                 " after the next start")
                        return
                    log.exception("lake export failed; retrying")
                    pause = min(max(pause, interval) * 2, 30.0)
                # A round ships at most `batch_rows` rows a stream: when stopping with more
                # waiting (a backlog after a lake stall or a restart), keep going until the
                # lake has them all. A failing round ends it; the next start exports the rest.
                if stopping and not more_waiting:
                    return
                stop.wait(pause)
        finally:
            shipper.close()
            try:
                cursor.close()
            except duckdb.Error:
                pass

    thread = threading.Thread(target=loop, name="lake-exporter", daemon=True)
    thread.start()
    return thread
