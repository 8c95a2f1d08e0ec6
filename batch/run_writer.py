"""Run writing for the sweep: a chunk of rated events (an Arrow table of
`RatingPlan.slots_sql` columns) made into one sweep run. numpy carries the remainders and
prices each line (`batch.carry`), pyarrow writes the lines to lake.rating_lines as Parquet
files, and `rating_runs.commit_written_runs` adds the files of the runs ready at a commit in
one lake transaction. A run whose sums might leave int64 is priced by the SQL window in
HUGEINT instead (`rating_plan.amounts_sql`, rows in lake.rating_rows).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset  # noqa: F401 (DuckDB imports it to scan an Arrow table: once, here)

from batch.carry import CarryOutOfRange, PriceTerms, carry_shares, contiguous, micros, uuid_words
from batch.rating_plan import LINE_CATALOG, RatingPlan, amounts_sql, sql_instant
from batch.rating_runs import (
    RunSummary,
    WrittenRun,
    commit_written_runs,
    missing_kinds,
    new_run_id,
    write_lines_files,
    write_lines_run,
    write_run,
)
from core.clock import SYSTEM_CLOCK, Clock
from warehouse.lake import table_folder, with_lake_retry

__all__ = ["PreparedRun", "RunWriter", "SlotLines", "event_rows_sql", "slot_lines"]


def event_rows_sql(run_id: str, rated_at: datetime, priced: str) -> str:
    """lake.rating_rows rows (STORED_COLUMNS order) of the priced event lines of `priced`: the
    line's kind by its line_id, so the described columns and the two ids are left NULL for
    the `ratings` view to fill (writing them out was half of a sweep's time)."""
    amounts = amounts_sql(priced, "event_id, line_key")
    return (
        f"SELECT NULL, '{run_id}', 'event', NULL, a.event_id, a.realm, a.billing_account_id,"
        " NULL, NULL, NULL, NULL, NULL, a.quantity_minor, a.price_id, a.unit_price_xusd,"
        f" a.unit_quantity_minor, a.amount_xusd, a.occurred_at, {sql_instant(rated_at)}, NULL,"
        f" c.line_id FROM ({amounts}) AS a JOIN {LINE_CATALOG} AS c ON c.line_key = a.line_key"
    )


# Up to this many (line, price row) pairs, line kinds are looked up in a table.
_DENSE_KINDS = 1 << 16


class RunWriter:
    """Writes the rated events of a chunk (an Arrow table of `RatingPlan.slots_sql` columns:
    each event and its lines in slots) as one sweep run: the carry and amounts in numpy
    (`batch.carry`), the rows to lake.rating_lines, one per line. A chunk whose sums
    might leave int64 is priced by the SQL window in HUGEINT instead, into lake.rating_rows,
    exactly as before there was a fast path."""

    def __init__(self, conn: duckdb.DuckDBPyConnection, plan: RatingPlan,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.conn = conn
        self.clock = clock
        self.slots = plan.slot_count()
        self.slot_columns = plan.slot_columns()
        self.slot_bytes = plan.slot_bytes()
        self.terms = PriceTerms.of(plan.price_terms())
        kinds, self.kind_ids = plan.priced_kinds()
        self.width = len(plan.prices) + 1
        # A table by (line, price row) when small; a catalog of many realms has few pairs
        # of its lines' and prices' cross product, looked up one distinct pair at a time.
        self.kind_table = (np.array([self.kind_ids.get(k, 0) for k in range(len(plan.lines) * self.width)],
                                    dtype=np.int64)
                           if len(plan.lines) * self.width <= _DENSE_KINDS else None)
        self.folder = table_folder(conn, "rating_lines")
        # Kinds the lake lacks go in with the first run's rows, in its transaction (on
        # their own they took a transaction more: ~0.1 s of every sweep that adds one).
        # A sweep of chunks looks them up while its threads carry the first chunks
        # (`look_up_kinds`): before the scan, the lookup's ~25 ms were on its critical path.
        self._kinds = kinds
        self.missing: list[tuple[object, ...]] | None = None  # None: not looked up yet

    def look_up_kinds(self) -> list[tuple[object, ...]]:
        """The line kinds the lake lacks (looked up the first time), until a commit records them."""
        if self.missing is None:
            # (after the scan: a busy catalog must not throw the scan's work away)
            self.missing = with_lake_retry(lambda: missing_kinds(self.conn, self._kinds))
        return self.missing

    def columns(self) -> str:
        """The columns of `slots_sql` the writer reads."""
        return f"event_id, realm, billing_account_id, occurred_at, {', '.join(self.slot_columns)}"

    def _line_ids(self, line_key: np.ndarray, price_key: np.ndarray) -> np.ndarray:
        pair = line_key * self.width + price_key + 1
        if self.kind_table is not None:
            ids: np.ndarray = self.kind_table[pair]
            return ids
        distinct, where = np.unique(pair, return_inverse=True)
        return np.array([self.kind_ids.get(int(k), 0) for k in distinct], dtype=np.int64)[where]

    def write(self, events: pa.Table, params: dict[str, object]) -> RunSummary:
        prepared = self.prepare(events, files=2)
        prepared.params = params
        [run] = self.commit([prepared])
        return run

    def prepare(self, events: pa.Table, files: int = 1) -> PreparedRun:
        """The run's rows: the carry and amounts of its lines, written to `files` Parquet
        files in the table's folder (no lake access: safe on threads of their own while
        another run commits; the lake has the files only once `commit` adds them)."""
        started_at = self.clock.now()
        prepared = PreparedRun(new_run_id("sweep", started_at), started_at, time.monotonic(),
                             events)
        try:
            lines = slot_lines(events, self.slots, self.terms)
        except CarryOutOfRange:
            return prepared  # priced in SQL at commit
        taken = pa.array(lines.parent)
        rows = pa.table({
            "event_id": contiguous(events.column("event_id")).take(taken),
            "realm": pc.dictionary_encode(contiguous(events.column("realm"))).take(taken),
            "billing_account_id": lines.accounts.take(taken),
            "occurred_at": contiguous(events.column("occurred_at")).take(taken),
            "line_id": pa.array(self._line_ids(lines.line_key, lines.price_key)),
            "quantity_minor": lines.quantity,
            "amount_xusd": lines.amount,
        })
        if self.folder is None:
            prepared.rows = rows
        else:
            prepared.written = WrittenRun(
                prepared.run_id, "sweep", started_at, {}, events.num_rows, rows.num_rows,
                write_lines_files(rows, prepared.run_id, self.folder, files) if rows.num_rows else [],
                prepared.began)
            # Its lines are in files: the commit needs none of its events. Kept until the
            # commit (a sweep of 5 M events commits once, at the end), they were ~40 MB a
            # chunk of memory faulted in afresh: 400 MB more at the peak, and ~0.2 CPU s.
            prepared.events = None
        return prepared

    def commit(self, runs: list[PreparedRun]) -> list[RunSummary]:
        """Write prepared runs (their `params` set) to the lake: those with their files
        written in one transaction, any other in one of its own."""
        done: list[RunSummary] = []
        written = []
        for run in runs:
            if run.written is not None:
                run.written.params = run.params
                written.append(run.written)
        if written:
            done += commit_written_runs(self.conn, written, kinds=self.look_up_kinds(),
                                        clock=self.clock)
            self.missing = []
        for prepared in runs:
            if prepared.written is None:
                done.append(self._commit_alone(prepared))
        return done

    def _commit_alone(self, prepared: PreparedRun) -> RunSummary:
        run_id, started_at, params = prepared.run_id, prepared.started_at, prepared.params
        assert prepared.events is not None  # (kept for every run without files)
        if prepared.rows is not None:
            summary = write_lines_run(self.conn, run_id=run_id, kind="sweep",
                                      started_at=started_at, params=params,
                                      lines=prepared.rows, events=prepared.events.num_rows,
                                      kinds=self.look_up_kinds())
            self.missing = []
        else:
            name = f"_sweep_events_{run_id.rsplit('-', 1)[-1]}"
            self.conn.register(name, prepared.events)
            try:
                def column(name_: str, kind: str) -> str:
                    return name_ if name_ in self.slot_columns else f"CAST(NULL AS {kind})"
                lines_sql = "(" + " UNION ALL ".join(
                    f"SELECT event_id, realm, billing_account_id, occurred_at, k{j} AS line_key,"
                    f" {column(f'q{j}', 'BIGINT')} AS quantity_minor,"
                    f" {column(f'p{j}', 'INTEGER')} AS price_key FROM {name} WHERE k{j} IS NOT NULL"
                    for j in range(self.slots)) + ")"
                summary = write_run(self.conn, run_id=run_id, kind="sweep", started_at=started_at,
                                    clock=self.clock,
                                    params=params, events=prepared.events.num_rows,
                                    rows_sql=event_rows_sql(run_id, started_at, lines_sql))
            finally:
                self.conn.unregister(name)
        return RunSummary(run_id, summary.kind, summary.events, summary.lines,
                          time.monotonic() - prepared.began)


@dataclass(frozen=True)
class SlotLines:
    """The lines of a table of rated events in slots, one entry per line, slot by slot."""

    parent: np.ndarray  # the event's row
    line_key: np.ndarray
    quantity: pa.Array  # int64, NULL for a line without one
    price_key: np.ndarray  # -1 without a price row
    amount: pa.Array  # amount_xusd (NULL without a quantity), carried
    accounts: pa.DictionaryArray  # the events' billing accounts, encoded (not per line)


def slot_lines(events: pa.Table, slots: int, terms: PriceTerms) -> SlotLines:
    """Every line of `events` (columns of `RatingPlan.slots_sql` with `slots` slots) and its
    amount, carried per (account, price row) in occurred_at order (`carry_shares`; raises
    `CarryOutOfRange` for sums that might leave int64)."""
    parents: list[np.ndarray] = []
    keys: list[np.ndarray] = []
    quantities: list[pa.Array] = [pa.array([], type=pa.int64())]
    prices: list[np.ndarray] = []
    names = set(events.column_names)
    for j in range(slots):
        key = contiguous(events.column(f"k{j}"))
        rows = np.flatnonzero(np.asarray(key.is_valid()))
        if not len(rows):
            continue
        taken = pa.array(rows)
        parents.append(rows)
        keys.append(np.asarray(key.take(taken)).astype(np.int64))
        # A slot no policy puts a quantity or price in has no column for it.
        quantities.append(contiguous(events.column(f"q{j}")).take(taken).cast(pa.int64())
                          if f"q{j}" in names else pa.nulls(len(rows), pa.int64()))
        prices.append(np.asarray(pc.fill_null(contiguous(events.column(f"p{j}")).take(taken), -1))
                      .astype(np.int64) if f"p{j}" in names else np.full(len(rows), -1, np.int64))
    empty = np.zeros(0, dtype=np.int64)
    parent = np.concatenate(parents) if parents else empty
    line_key = np.concatenate(keys) if keys else empty
    price_key = np.concatenate(prices) if prices else empty
    quantity = pa.concat_arrays(quantities)
    event_ids = events.column("event_id")

    def tie_break(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        high, low = uuid_words(event_ids, parent[rows])
        return high, low, line_key[rows]

    accounts = pc.dictionary_encode(contiguous(events.column("billing_account_id")))
    amount = carry_shares(np.asarray(accounts.indices).astype(np.int64)[parent],
                          micros(events.column("occurred_at"))[parent],
                          quantity, price_key, terms, tie_break)
    return SlotLines(parent, line_key, quantity, price_key, amount, accounts)


@dataclass
class PreparedRun:
    run_id: str
    started_at: datetime
    began: float
    events: pa.Table | None  # the chunk's rated events, as read (None once its lines are in files)
    # Its lines in files, waiting for the commit; or (no folder for files) the rows to
    # INSERT; neither: priced in SQL (HUGEINT) at the commit.
    written: WrittenRun | None = None
    rows: pa.Table | None = None
    params: dict[str, object] = field(default_factory=dict)

    def discard(self) -> None:
        """Remove the files of a run that will not be committed."""
        if self.written is not None:
            self.written.discard()
