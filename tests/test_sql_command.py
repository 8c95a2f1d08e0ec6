"""`tollgate sql` over a lake with data, and the analysts' guide's queries against that lake."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pytest

from api.events.views import to_record
from batch.aggregate_days import close_aggregate_days
from batch.rating_plan import RatingPlan
from batch.rating_runs import RatingLock, current_ratings_sql
from batch.rerate import rerate
from batch.usage_reports import build_usage_report
from pipelines.catalog import Catalog, load_catalog
from pipelines.events import EventIn, ValidEvent, validate_event
from tests.catalog_builder import CatalogBuilder
from tests.conftest import tollgate
from warehouse.catalog_history import record_catalog
from warehouse.export import LakeExporter
from warehouse.lake import connect_lake
from warehouse.operational import open_operational
from warehouse.outbox import EventOutbox
from warehouse.writer import Transaction
from writer.events.inline_rating import InlineRater, write_inline_ratings

pytestmark = pytest.mark.lake

ROOT = Path(__file__).resolve().parent.parent
RECEIVED = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)  # created_at of every event

JAN, NOV = "2026-01-01T00:00:00Z", "2026-11-01T00:00:00Z"
SEATS = {"dsl_version": "v1", "engine": "aggregate", "match": {"event_type": "seats.snapshot"},
         "emit": {"intents": [{"feature_code": "team.seats", "meters": [
             {"meter_code": "seats", "quantity_minor": {"agg": {"op": "max", "of": {"payload": "seats"}}}}]}]}}
LLM = {"dsl_version": "v1", "engine": "single", "match": {"event_type": "llm.completion"},
       "emit": {"intents": [{"feature_code": "llm.chat", "meters": [
           {"meter_code": "llm.input_tokens", "quantity_minor": {"payload_int": "usage.input_tokens", "default": 0}},
           {"meter_code": "llm.output_tokens", "quantity_minor": {"payload_int": "usage.output_tokens", "default": 0}}]}]}}


def catalog_text(*, november: bool) -> str:
    """Realm acme: LLM tokens (policy llm-completions), API calls and seats (an aggregate
    policy: the day's most seats); with `november`, version 2026-11 of llm-completions and a
    price of 200 per 1000 input tokens, both in force from 2026-11-01."""
    catalog = (CatalogBuilder("acme")
               .account("acct_a", "postpaid", principals=["team-a"])
               .account("acct_b", "postpaid", principals=["team-b"])
               .family("llm").family("api")
               .meter("llm.input_tokens", "token").meter("llm.output_tokens", "token")
               .meter("api.calls", "request").meter("seats", "seat")
               .feature("llm.chat", "llm.input_tokens", family="llm",
                        meters=["llm.input_tokens", "llm.output_tokens"])
               .feature("api.search", "api.calls", family="api")
               .feature("team.seats", "seats")
               .price("llm.input_tokens", 150, JAN, unit_quantity_minor=1000)
               .price("llm.output_tokens", 600, JAN, unit_quantity_minor=1000, rounding="ceil")
               .price("api.calls", 2000, JAN)
               .price("seats", 1000, JAN)
               .policy("seats", ("v1", JAN, SEATS))
               .policy("llm-completions", ("2026-01", JAN, LLM)))
    if november:
        catalog.version("llm-completions", "2026-11", NOV, LLM)
        catalog.price("llm.input_tokens", 200, NOV, unit_quantity_minor=1000)
    return catalog.toml()


# (name, account, event type, occurred_at, input tokens, output tokens, labels, how it came in,
# created_at). Every event but e5 came in before the first sweep.
LATER, LAST = RECEIVED + timedelta(hours=2), RECEIVED + timedelta(hours=3)
EVENTS = [
    ("e1", "acct_a", "llm.completion", "2026-11-22T09:00:00Z", 1200, 300, {"env": "prod", "n": 2}, "single", RECEIVED),
    ("e2", "acct_a", "llm.completion", "2026-11-21T23:30:00Z", 2000, 0, {}, "single", RECEIVED),  # 12.5 h late
    ("e3", "acct_b", "llm.completion", "2026-11-22T10:00:00Z", 1000, 500, {"ok": True}, "single", RECEIVED),
    ("e4", "acct_b", "job.done", "2026-11-22T08:00:00Z", 0, 0, {}, "single", RECEIVED),  # no policy matches
    # Seat counts of acct_a's 2026-11-20, an aggregate day; s3 arrives after the day was closed.
    ("s1", "acct_a", "seats.snapshot", "2026-11-20T08:00:00Z", 3, 0, {}, "batch", RECEIVED),
    ("s2", "acct_a", "seats.snapshot", "2026-11-20T15:00:00Z", 5, 0, {}, "batch", RECEIVED),
    ("s3", "acct_a", "seats.snapshot", "2026-11-20T20:00:00Z", 7, 0, {}, "batch", LATER),
    # Rated inline only: no sweep has run since it came in.
    ("e5", "acct_b", "llm.completion", "2026-11-22T14:30:00Z", 4000, 100, {}, "single", LAST),
]
# Gate commit lines: (commit, account, meter, quantity, amount, committed_at)
COMMITS = [
    ("c1", "acct_a", "api.calls", 3, 6000, "2026-11-22T11:00:00Z"),
    ("c2", "acct_b", "llm.input_tokens", 5000, 750, "2026-11-22T11:30:00Z"),
    ("c2", "acct_b", "llm.output_tokens", 1000, 600, "2026-11-22T11:30:00Z"),
]


def _event(name: str, account: str, event_type: str, occurred: str, first: int, second: int,
           labels: dict[str, Any], now: datetime) -> ValidEvent:
    payload: dict[str, Any] = ({"seats": first} if event_type == "seats.snapshot" else
                               {"usage": {"input_tokens": first, "output_tokens": second}})
    body = {"semantic_kind": "activity", "event_type": event_type, "occurred_at": occurred,
            "subject_ref": name, "labels": labels, "payload": payload}
    item = msgspec.json.decode(json.dumps(body).encode(), type=EventIn)
    event = validate_event(item, realm="acme", billing_account_id=account, now=now,
                           max_future_skew_seconds=300)
    assert isinstance(event, ValidEvent), event
    return event


class _Applied:
    """The applied catalog, as the inline rater reads it."""

    def __init__(self, catalog: Catalog) -> None:
        self.current = catalog


def build_lake(data_dir: Path) -> dict[str, str]:
    """A lake as the service and the rating runs leave it; the event ids by name.

    The service takes e1-e4 (single, rated inline), s1 and s2 (a batch) and two gate
    commits; close-aggregate-days sweeps them and rates acct_a's seats of 2026-11-20; a new
    catalog (version 2026-11, input tokens at 200) comes in and e3 is re-rated; s3 arrives
    late for the closed day, which the next close rates again; e5 is rated inline only."""
    first, second = load_catalog(catalog_text(november=False)), load_catalog(catalog_text(november=True))
    record_catalog(data_dir, first, applied_at=datetime(2026, 10, 1, tzinfo=timezone.utc))
    conn = open_operational(data_dir / "operational.duckdb")
    outbox, exporter = EventOutbox(conn), LakeExporter(data_dir)
    ids: dict[str, str] = {}

    def accept(names: list[str], rater: InlineRater) -> dict[str, int]:
        """The events of `names`, as the service accepts and exports them."""
        specs = [spec for spec in EVENTS if spec[0] in names]
        conn.execute("BEGIN")
        tx = Transaction(conn, specs[0][8])
        singles = []
        for name, *facts, path, created in specs:
            event = _event(name, *facts, created)
            ids[name] = event.event_id
            outbox.stage(tx, "acme", to_record(event), path)
            if path == "single":
                singles.append(("acme", to_record(event)))
        tx.flush()
        tx.commit()
        conn.execute("COMMIT")
        if rows := rater.rate(conn, singles):
            write_inline_ratings(conn, rows)
        return exporter.export_once(conn)

    assert accept(["e1", "e2", "e3", "e4", "s1", "s2"], InlineRater(_Applied(first))) == {
        "events": 6, "commit_lines": 0, "inline_ratings": 7}
    for seq, (commit, account, meter, qty, amount, at) in enumerate(COMMITS, start=1):
        conn.execute("INSERT INTO commit_lines VALUES (?, ?, ?, 'lease', 'acme', ?, 'team', ?, ?, ?, ?, "
                     "1, 1, 'floor', 0, 0, ?, 'fp', ?)",
                     [seq, f"{commit}:{seq}", commit, account, "api.search" if "api" in meter else "llm.chat",
                      meter, qty, f"{meter}@2026-01-01T00:00:00Z", amount, at])
    assert exporter.export_once(conn) == {"events": 0, "commit_lines": 3, "inline_ratings": 0}

    lake, lock = connect_lake(data_dir), RatingLock(data_dir / "lake" / "rating.lock")
    lateness = {"acme": first.realms["acme"].settings.lateness_allowance_seconds}
    runs = close_aggregate_days(lake, RatingPlan.from_catalog(first), lock, lateness=lateness, now=RECEIVED)
    assert [(r.kind, r.events) for r in runs] == [("sweep", 6), ("aggregate", 1)]
    record_catalog(data_dir, second, applied_at=RECEIVED + timedelta(hours=1))
    plan = RatingPlan.from_catalog(second)
    [run] = rerate(lake, plan, lock, occurred_from=datetime(2026, 11, 22, tzinfo=timezone.utc),
                   occurred_to=datetime(2026, 11, 23, tzinfo=timezone.utc), accounts=["acct_b"],
                   policy_ids=["llm-completions"])
    assert run.events == 1  # e3
    rater = InlineRater(_Applied(second))
    assert accept(["s3"], rater) == {"events": 1, "commit_lines": 0, "inline_ratings": 0}
    runs = close_aggregate_days(lake, plan, lock, lateness=lateness, now=LATER)
    assert [(r.kind, r.events) for r in runs] == [("sweep", 1), ("aggregate", 1)]
    assert accept(["e5"], rater) == {"events": 1, "commit_lines": 0, "inline_ratings": 2}
    lake.close()
    exporter.close()
    conn.close()
    return ids


# Amounts worked out by hand (see the tests below): the current batch rows (e1, e2, e3
# rerated, the seats day), and every current row (with e5's inline rows and the gate lines).
BATCH = (150 + 600) + (300 + 0) + (200 + 600) + 7000
CURRENT = BATCH + (800 + 600) + (6000 + 750 + 600)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    data_dir = tmp_path_factory.mktemp("lake")
    return data_dir, build_lake(data_dir)


@pytest.fixture(scope="module")
def lake_dir(built: tuple[Path, dict[str, str]]) -> Path:
    return built[0]


@pytest.fixture(scope="module")
def event_ids(built: tuple[Path, dict[str, str]]) -> dict[str, str]:
    return built[1]


def sql(data_dir: Path, query: str, fmt: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return tollgate("sql", query, "--format", fmt, data_dir=data_dir, check=check)


def test_json_is_an_array_of_objects_with_integers_and_iso_times(lake_dir: Path) -> None:
    out = sql(lake_dir, "SELECT source_id, amount_xusd, rated_at, line_index, quantity_minor * 10 AS big "
                        "FROM ratings WHERE source = 'gate_commit' ORDER BY rating_id", "json").stdout
    rows = json.loads(out)
    assert rows[0] == {"source_id": "c1", "amount_xusd": 6000, "rated_at": "2026-11-22T11:00:00+00:00",
                       "line_index": 0, "big": 30}
    assert [r["amount_xusd"] for r in rows] == [6000, 750, 600]
    assert all(isinstance(r["amount_xusd"], int) for r in rows)

    events = json.loads(sql(lake_dir, "SELECT subject_ref, payload, labels, event_id FROM events "
                                      "WHERE subject_ref = 'e1'", "json").stdout)
    assert events[0]["payload"] == {"usage": {"input_tokens": 1200, "output_tokens": 300}}
    assert events[0]["labels"] == {"env": "prod", "n": 2}
    assert re.fullmatch(r"[0-9a-f-]{36}", events[0]["event_id"])
    assert json.loads(sql(lake_dir, "SELECT 1 AS x WHERE false", "json").stdout) == []
    # Every row: inline (e1-e4, then e5), batch runs (see CURRENT) and gate commits.
    assert json.loads(sql(lake_dir, "SELECT sum(amount_xusd) AS total FROM ratings", "json").stdout) == [
        {"total": (150 + 600 + 300 + 0 + 150 + 600) + (800 + 600) + BATCH + (6000 + 750 + 600)}]


def raw_sql(data_dir: Path, *args: str, stdin: str = "", code: int = 0) -> tuple[str, str]:
    """(stdout, stderr) exactly as written (no newline translation), with no `duckdb` shell
    on PATH so that the built-in loop answers when no query is given; `code` the exit code
    expected."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    result = subprocess.run([sys.executable, "-m", "cli", "sql", *args, "--data-dir", str(data_dir)],
                            input=stdin.encode(), capture_output=True, env=env, check=False)
    assert result.returncode == code, result.stderr
    return result.stdout.decode(), result.stderr.decode()


def test_csv_is_rfc_4180_with_a_header(lake_dir: Path) -> None:
    out = raw_sql(lake_dir, "SELECT meter_code, sum(amount_xusd) AS amount_xusd, 'a,\"b\"' AS quoted, "
                            "NULL AS nothing FROM ratings WHERE source = 'gate_commit' GROUP BY ALL ORDER BY 1",
                  "--format", "csv")[0]
    assert out.startswith('meter_code,amount_xusd,quoted,nothing\r\n')
    assert '"a,""b"""' in out
    rows = list(csv.reader(io.StringIO(out, newline="")))
    assert rows == [["meter_code", "amount_xusd", "quoted", "nothing"],
                    ["api.calls", "6000", 'a,"b"', ""],
                    ["llm.input_tokens", "750", 'a,"b"', ""],
                    ["llm.output_tokens", "600", 'a,"b"', ""]]


def test_a_query_may_begin_with_a_comment(lake_dir: Path) -> None:
    """The guide's queries open with `-- what it answers`: pasted whole, one is a query, not a
    mistyped option."""
    out = raw_sql(lake_dir, "-- the answer\nSELECT 42 AS answer", "--format", "csv")[0]
    assert out == "answer\r\n42\r\n"


def test_table_aligns_columns(lake_dir: Path) -> None:
    out = sql(lake_dir, "SELECT meter_code, amount_xusd FROM ratings WHERE source = 'gate_commit' "
                        "ORDER BY rating_id", "table").stdout
    lines = out.splitlines()
    assert lines[0].split() == ["meter_code", "|", "amount_xusd"]
    assert set(lines[1]) <= {"-", "+"}
    assert [line.index("|") for line in lines[:1] + lines[2:5]] == [lines[0].index("|")] * 4
    assert lines[2].endswith("6000") and lines[3].endswith(" 750")  # numbers right-aligned
    assert lines[-1] == "(3 rows)"


@pytest.mark.parametrize("statement", [
    "INSERT INTO events (realm) VALUES ('x')",
    "DELETE FROM rating_rows",
    "CREATE TABLE stolen AS SELECT 1 AS x",
])
def test_a_write_statement_fails_with_exit_code_1(lake_dir: Path, statement: str) -> None:
    result = sql(lake_dir, statement, "table", check=False)
    assert result.returncode == 1
    assert "read-only" in result.stderr
    assert sql(lake_dir, "SELECT count(*) AS n FROM ratings", "json").stdout.count('"n":') == 1


@pytest.mark.parametrize("statement", [
    "COPY (SELECT 1 AS x) TO '{home}/keys.json'",                         # a file written
    "USE memory; DETACH lake; ATTACH 'ducklake:sqlite:{home}/lake/catalog.sqlite' AS w",  # writable
    "SET enable_external_access = true",                                   # the guard turned off
    "SELECT * FROM read_text('{home}/keys.json')",                         # outside the lake's data
])
def test_the_session_cannot_write_files_attach_or_unlock_itself(lake_dir: Path, statement: str) -> None:
    keys = lake_dir / "keys.json"
    keys.write_text('{"keys": []}')
    result = sql(lake_dir, statement.format(home=lake_dir.resolve()), "table", check=False)
    assert result.returncode == 1 and result.stderr.startswith("tollgate sql: ")
    assert keys.read_text() == '{"keys": []}'
    assert sql(lake_dir, "SELECT count(*) AS n FROM ratings", "json").stdout.count('"n":') == 1


def test_a_bad_query_fails_clearly(lake_dir: Path, tmp_path: Path) -> None:
    result = sql(lake_dir, "SELECT nope FROM events", "json", check=False)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("tollgate sql: ") and "nope" in result.stderr
    missing = sql(tmp_path, "SELECT 1", "json", check=False)
    assert missing.returncode == 1 and "no lake" in missing.stderr


def test_without_a_query_statements_are_read_from_stdin(lake_dir: Path) -> None:
    out, err = raw_sql(lake_dir, "--format", "csv", stdin="SELECT count(*) AS n\nFROM events;\n"
                       "INSERT INTO events (realm) VALUES ('x');\nSELECT 'x' AS y;\n", code=1)
    assert out == "n\r\n8\r\ny\r\nx\r\n"  # the script runs on; a failed statement fails it
    assert "read-only" in err
    assert raw_sql(lake_dir, "--format", "csv", stdin="SELECT 1 AS one;\n")[0] == "one\r\n1\r\n"


# ---- the analysts' guide --------------------------------------------------------------

def guide_queries() -> dict[str, str]:
    """Every ```sql block of docs/analysts.md that is a query, by its first comment line."""
    text = (ROOT / "docs" / "analysts.md").read_text()
    blocks = re.findall(r"```sql\n(.*?)```", text, flags=re.DOTALL)
    queries = {}
    for block in blocks:
        first = block.splitlines()[0]
        if first.startswith("-- "):
            queries[first[3:].strip()] = block
    return queries


@pytest.fixture(scope="module")
def analyst(lake_dir: Path) -> Iterator[duckdb.DuckDBPyConnection]:
    conn = connect_lake(lake_dir, read_only=True)
    conn.execute("USE lake")
    yield conn
    conn.close()


def run(conn: duckdb.DuckDBPyConnection, name: str) -> list[tuple[Any, ...]]:
    return conn.execute(guide_queries()[name]).fetchall()


def test_the_guide_has_the_promised_questions() -> None:
    assert set(guide_queries()) == {
        "current ratings", "batch rows add up to their current rows", "the catalog in force",
        "usage by account and day", "revenue by meter",
        "late events and the day they were billed to", "late revenue by day of arrival",
        "events without a policy", "amounts by policy version", "what a re-rating changed, per run",
        "usage by account and day from the rollup"}


def test_current_ratings_are_what_the_flows_take_as_current(analyst: duckdb.DuckDBPyConnection,
                                                            event_ids: dict[str, str]) -> None:
    guide = guide_queries()["current ratings"].rstrip().rstrip(";")
    columns = "run_id, source_id, status, policy_version, meter_code, quantity_minor, amount_xusd"
    rows = analyst.execute(f"SELECT {columns} FROM ({guide}) ORDER BY ALL").fetchall()
    assert rows == analyst.execute(f"SELECT {columns} FROM ({current_ratings_sql()}) ORDER BY ALL").fetchall()
    # e1, e2, e3 (rerated), e4: 7 lines; s1-s3 deferred, their day's line; e5 inline; 3 gate lines
    assert len(rows) == 16
    ids = event_ids
    assert {r[0] for r in rows if r[1] == ids["e5"]} == {"inline"}
    assert {r[0].split("-")[0] for r in rows if r[1] in (ids["e1"], ids["e3"])} == {"sweep", "rerate"}
    assert sum(r[6] or 0 for r in rows) == CURRENT
    # Inline rows of swept events are superseded without reversals: every row sums to more.
    assert analyst.execute("SELECT sum(amount_xusd) FROM ratings").fetchone()[0] == CURRENT + 1800


def test_batch_rows_add_up_to_their_current_rows(analyst: duckdb.DuckDBPyConnection) -> None:
    assert run(analyst, "batch rows add up to their current rows") == [(BATCH, BATCH)]


def test_the_catalog_in_force_is_the_latest_applied(analyst: duckdb.DuckDBPyConnection) -> None:
    november = load_catalog(catalog_text(november=True)).fingerprint
    assert run(analyst, "the catalog in force") == [(november, RECEIVED + timedelta(hours=1))]


def test_usage_by_account_and_day(analyst: duckdb.DuckDBPyConnection) -> None:
    day = datetime(2026, 11, 22).date()
    assert run(analyst, "usage by account and day") == [
        # the aggregate day: most seats 7 (s3, late) at 1000 each; one source
        ("acct_a", datetime(2026, 11, 20).date(), "seats", 7, 7000, 1),
        # swept with carry: e2 2000 -> 2 blocks of 150; e1 1200 -> A(3200) - A(2000) = 150
        ("acct_a", datetime(2026, 11, 21).date(), "llm.input_tokens", 2000, 300, 1),
        ("acct_a", datetime(2026, 11, 21).date(), "llm.output_tokens", 0, 0, 1),
        ("acct_a", day, "api.calls", 3, 6000, 1),
        ("acct_a", day, "llm.input_tokens", 1200, 150, 1),
        ("acct_a", day, "llm.output_tokens", 300, 600, 1),      # 1 block, ceil
        # e3 rerated (1000 at 200), c2 (750), e5 inline (4000 at 200)
        ("acct_b", day, "llm.input_tokens", 10000, 200 + 750 + 800, 3),
        ("acct_b", day, "llm.output_tokens", 1600, 600 + 600 + 600, 3),
    ]


def test_usage_by_account_and_day_from_the_rollup(analyst: duckdb.DuckDBPyConnection) -> None:
    """The rollup gives the current usage of every line but the inline rows of events no
    sweep has reached (acct_b's e5 here): acct_a's days are those of the full query."""
    rolled = [r for r in run(analyst, "usage by account and day from the rollup") if r[0] == "acct_a"]
    assert rolled == [r[:5] for r in run(analyst, "usage by account and day") if r[0] == "acct_a"]
    assert rolled


def test_revenue_by_meter(analyst: duckdb.DuckDBPyConnection) -> None:
    rows = run(analyst, "revenue by meter")
    assert [(r[1], r[2], str(r[3])) for r in rows] == [
        ("seats", 7000, "0.007000"), ("api.calls", 6000, "0.006000"),
        ("llm.output_tokens", 2400, "0.002400"), ("llm.input_tokens", 2200, "0.002200")]


def test_late_events(analyst: duckdb.DuckDBPyConnection, event_ids: dict[str, str]) -> None:
    late = run(analyst, "late events and the day they were billed to")
    names = {str(v): k for k, v in event_ids.items()}
    nov = [datetime(2026, 11, d).date() for d in (20, 21, 22)]
    # e3 happened exactly 2 h before it arrived, e5 half an hour: not late.
    assert [(names[str(r[0])], r[5], r[7], r[8]) for r in late] == [
        ("s1", timedelta(days=2, hours=4), nov[0], 7000),       # the whole day's amount
        ("s2", timedelta(days=1, hours=21), nov[0], 7000),
        ("s3", timedelta(days=1, hours=18), nov[0], 7000),
        ("e2", timedelta(hours=12, minutes=30), nov[1], 300),
        ("e4", timedelta(hours=4), nov[2], None),                # no policy: nothing billed
        ("e1", timedelta(hours=3), nov[2], 150 + 600)]
    assert {r[6] for r in late} == {nov[2]}
    # e2 (300, billed to the 21st) and the seats day (7000, to the 20th; its last event, s3,
    # arrived on the 22nd).
    assert run(analyst, "late revenue by day of arrival") == [(nov[2], 2, 7300)]


def test_events_without_a_policy(analyst: duckdb.DuckDBPyConnection) -> None:
    rows = run(analyst, "events without a policy")
    assert [r[:4] for r in rows] == [("acme", "acct_b", "job.done", 1)]


def test_a_policy_versions_effect(analyst: duckdb.DuckDBPyConnection) -> None:
    rows = run(analyst, "amounts by policy version")
    jan, nov = datetime(2026, 1, 1, tzinfo=timezone.utc), datetime(2026, 11, 1, tzinfo=timezone.utc)
    assert [r[1:] for r in rows] == [
        # (policy, version, effective_at, events, aggregate days, quantity, amount)
        ("llm-completions", "2026-01", jan, 2, 0, 1200 + 300 + 2000 + 0, 150 + 600 + 300 + 0),   # e1, e2
        ("llm-completions", "2026-11", nov, 2, 0, 1000 + 500 + 4000 + 100, 200 + 600 + 800 + 600),  # e3, e5
        ("seats", "v1", jan, 3, 1, 7, 7000)]
    changes = [(r[1], r[2], r[3], r[4], r[5]) for r in run(analyst, "what a re-rating changed, per run")]
    assert changes == [
        ("inline", "2026-01", "rated", 6, 150 + 600 + 300 + 0 + 150 + 600),
        ("inline", None, "skipped_no_policy", 1, None),
        ("sweep", "v1", "deferred", 2, None),
        ("sweep", "2026-01", "rated", 6, 1800),
        ("sweep", None, "skipped_no_policy", 1, None),
        ("aggregate", "v1", "rated", 1, 5000),                  # s1, s2: 5 seats
        ("rerate", "2026-11", "rated", 2, 200 + 600),           # e3 under 2026-11
        ("rerate", "2026-01", "reversal", 2, -(150 + 600)),
        ("sweep", "v1", "deferred", 1, None),                   # s3, late
        ("aggregate", "v1", "rated", 1, 7000),
        ("aggregate", "v1", "reversal", 1, -5000),
        ("inline", "2026-11", "rated", 2, 800 + 600)]           # e5


def test_an_aggregate_day_counts_once_in_a_usage_report(analyst: duckdb.DuckDBPyConnection) -> None:
    report = build_usage_report(analyst, "report-x", RECEIVED).to_pylist()
    seats = [(r["period"], r["quantity_minor"], r["amount_xusd"], r["event_count"], r["line_count"])
             for r in report if r["meter_code"] == "seats"]
    assert seats == [("day", 7, 7000, 1, 1), ("month", 7, 7000, 1, 1)]  # three events, one day
    assert sum(r["amount_xusd"] for r in report if r["period"] == "month") == CURRENT


def lake_files(data_dir: Path) -> set[Path]:
    return {p for p in (data_dir / "lake").rglob("*") if p.is_file()}


MAINTENANCE = [
    "SELECT * FROM ducklake_expire_snapshots('lake', older_than => now())",
    "SELECT * FROM ducklake_flush_inlined_data('lake')",   # writes Parquet, then fails, read-only
    "FROM query('SELECT * FROM ducklake_' || 'flush_inlined_data(''lake'')')",
    "CREATE TEMP VIEW v AS SELECT * FROM ducklake_flush_inlined_data('lake'); SELECT * FROM v",
    "EXPLAIN ANALYZE SELECT * FROM ducklake_merge_adjacent_files('lake')",
    "INSERT INTO events (realm) VALUES ('x')",
]


@pytest.mark.parametrize("statement", MAINTENANCE)
def test_a_write_or_maintenance_however_spelled_is_refused_by_both_paths(lake_dir: Path,
                                                                          statement: str) -> None:
    before = lake_files(lake_dir)
    snapshots = sql(lake_dir, "SELECT count(*) AS n FROM ducklake_snapshots('lake')", "json").stdout
    raw_sql(lake_dir, statement, code=1)                   # one query
    raw_sql(lake_dir, stdin=statement + ";\n", code=1)     # the interactive session's loop
    assert lake_files(lake_dir) == before
    assert sql(lake_dir, "SELECT count(*) AS n FROM ducklake_snapshots('lake')", "json").stdout == snapshots


def test_without_a_query_the_guarded_loop_runs_even_with_a_duckdb_shell_on_path(
        lake_dir: Path, tmp_path: Path) -> None:
    # A `duckdb` shell would run statements past the guard: it is not started.
    shell = tmp_path / "duckdb"
    shell.write_text(f"""#!/bin/sh
if [ "$1" = "-version" ]; then echo "v{duckdb.__version__} 0000000000"; exit 0; fi
touch {tmp_path / "started"}
""")
    shell.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{Path(sys.executable).parent}"}
    done = subprocess.run([sys.executable, "-m", "cli", "sql", "--format", "csv", "--data-dir", str(lake_dir)],
                          env=env, input=b"SELECT 1 AS one;\n", capture_output=True, check=True)
    assert done.stdout == b"one\r\n1\r\n"
    assert not (tmp_path / "started").exists()
