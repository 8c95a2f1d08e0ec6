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

from api.events.ingest import to_record
from pipelines.catalog import load_catalog
from pipelines.events import EventIn, ValidEvent, validate_event
from tests.conftest import tollgate
from warehouse.catalog_history import record_catalog
from warehouse.export import LakeExporter
from warehouse.lake import connect_lake
from warehouse.operational import open_operational
from warehouse.outbox import EventOutbox
from warehouse.writer import Transaction

ROOT = Path(__file__).resolve().parent.parent
RECEIVED = datetime(2026, 11, 22, 12, 0, tzinfo=timezone.utc)  # created_at of every event

CATALOG = """
[realms.acme.accounts.acct_a]
funding = "postpaid"
principals = ["team-a"]

[realms.acme.accounts.acct_b]
funding = "postpaid"
principals = ["team-b"]

[realms.acme.families.llm]
[realms.acme.families.api]
[realms.acme.meters."llm.input_tokens"]
unit = "token"
[realms.acme.meters."llm.output_tokens"]
unit = "token"
[realms.acme.meters."api.calls"]
unit = "request"

[realms.acme.features."llm.chat"]
family = "llm"
primary_meter = "llm.input_tokens"
meters = ["llm.input_tokens", "llm.output_tokens"]

[realms.acme.features."api.search"]
family = "api"
primary_meter = "api.calls"

[[realms.acme.prices]]
meter = "llm.input_tokens"
unit_price_xusd = "150"
unit_quantity_minor = "1000"
effective_at = "2026-01-01T00:00:00Z"

[[realms.acme.prices]]
meter = "llm.output_tokens"
unit_price_xusd = "600"
unit_quantity_minor = "1000"
effective_at = "2026-01-01T00:00:00Z"

[[realms.acme.prices]]
meter = "api.calls"
unit_price_xusd = "2000"
effective_at = "2026-01-01T00:00:00Z"

[[realms.acme.policies]]
id = "llm-completions"

[[realms.acme.policies.versions]]
version = "2026-01"
effective_at = "2026-01-01T00:00:00Z"
dsl_json = '''{"dsl_version": "v1", "engine": "single", "match": {"event_type": "llm.completion"},
 "emit": {"intents": [{"feature_code": "llm.chat", "meters": [
   {"meter_code": "llm.input_tokens", "quantity_minor": {"payload_int": "usage.input_tokens", "default": 0}},
   {"meter_code": "llm.output_tokens", "quantity_minor": {"payload_int": "usage.output_tokens", "default": 0}}]}]}}'''

[[realms.acme.policies.versions]]
version = "2026-11"
effective_at = "2026-11-01T00:00:00Z"
dsl_json = '''{"dsl_version": "v1", "engine": "single", "match": {"event_type": "llm.completion"},
 "emit": {"intents": [{"feature_code": "llm.chat", "meters": [
   {"meter_code": "llm.input_tokens", "quantity_minor": {"payload_int": "usage.input_tokens", "default": 0}},
   {"meter_code": "llm.output_tokens", "quantity_minor": {"payload_int": "usage.output_tokens", "default": 0}}]}]}}'''
"""

# (name, account, event type, occurred_at, input tokens, output tokens, labels)
EVENTS = [
    ("e1", "acct_a", "llm.completion", "2026-11-22T09:00:00Z", 1200, 300, {"env": "prod", "n": 2}),
    ("e2", "acct_a", "llm.completion", "2026-11-21T23:30:00Z", 2000, 0, {}),  # 12.5 h late
    ("e3", "acct_b", "llm.completion", "2026-11-22T10:00:00Z", 1000, 500, {"ok": True}),
    ("e4", "acct_b", "job.done", "2026-11-22T08:00:00Z", 0, 0, {}),  # no policy matches
]
# Inline ratings: (event, line, meter, quantity, amount) or (event, None, ...) for a skip.
INLINE = [
    ("e1", 0, "llm.input_tokens", 1200, 180), ("e1", 1, "llm.output_tokens", 300, 180),
    ("e2", 0, "llm.input_tokens", 2000, 300), ("e2", 1, "llm.output_tokens", 0, 0),
    ("e3", 0, "llm.input_tokens", 1000, 150), ("e3", 1, "llm.output_tokens", 500, 300),
]
# Gate commit lines: (commit, account, meter, quantity, amount, committed_at)
COMMITS = [
    ("c1", "acct_a", "api.calls", 3, 6000, "2026-11-22T11:00:00Z"),
    ("c2", "acct_b", "llm.input_tokens", 5000, 750, "2026-11-22T11:30:00Z"),
    ("c2", "acct_b", "llm.output_tokens", 1000, 600, "2026-11-22T11:30:00Z"),
]


def _event(name: str, account: str, event_type: str, occurred: str, tokens_in: int, tokens_out: int,
           labels: dict[str, Any]) -> ValidEvent:
    body = {"semantic_kind": "activity", "event_type": event_type, "occurred_at": occurred,
            "subject_ref": name, "labels": labels,
            "payload": {"usage": {"input_tokens": tokens_in, "output_tokens": tokens_out}}}
    item = msgspec.json.decode(json.dumps(body).encode(), type=EventIn)
    event = validate_event(item, realm="acme", billing_account_id=account, now=RECEIVED,
                           max_future_skew_seconds=300)
    assert isinstance(event, ValidEvent), event
    return event


def build_lake(data_dir: Path) -> dict[str, str]:
    """A lake as the service and a re-rating run would leave it; the event ids by name."""
    record_catalog(data_dir, load_catalog(CATALOG))
    conn = open_operational(data_dir / "operational.duckdb")
    outbox = EventOutbox(conn)
    conn.execute("BEGIN")
    tx = Transaction(conn, RECEIVED)
    ids = {}
    for spec in EVENTS:
        event = _event(*spec)
        ids[spec[0]] = event.event_id
        outbox.stage(tx, "acme", to_record(event), "single")
    tx.flush()
    tx.commit()
    conn.execute("COMMIT")
    occurred = {spec[0]: spec[3] for spec in EVENTS}
    accounts = {spec[0]: spec[1] for spec in EVENTS}
    rated = RECEIVED + timedelta(seconds=1)
    for seq, (name, line, meter, qty, amount) in enumerate(INLINE, start=1):
        # Rated inline before version 2026-11 was added (with an effective_at in the past).
        conn.execute("INSERT INTO inline_ratings VALUES (?, ?, ?, 'acme', ?, 'rated', 'llm-completions', "
                     "'2026-01', 'llm.chat', ?, ?, ?, ?, 1000, ?, ?, ?, ?)",
                     [seq, f"r-{name}-{line}", ids[name], accounts[name], meter, qty,
                      f"{meter}@2026-01-01T00:00:00Z", 150 if "input" in meter else 600, amount,
                      occurred[name], rated, line])
    conn.execute("INSERT INTO inline_ratings VALUES (7, 'r-e4', ?, 'acme', 'acct_b', 'skipped_no_policy', "
                 "NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, ?, ?, NULL)",
                 [ids["e4"], occurred["e4"], rated])
    for seq, (commit, account, meter, qty, amount, at) in enumerate(COMMITS, start=1):
        conn.execute("INSERT INTO commit_lines VALUES (?, ?, ?, 'lease', 'acme', ?, 'team', ?, ?, ?, ?, "
                     "1, 1, 'floor', 0, 0, ?, 'fp', ?)",
                     [seq, f"{commit}:{seq}", commit, account, "api.search" if "api" in meter else "llm.chat",
                      meter, qty, f"{meter}@2026-01-01T00:00:00Z", amount, at])
    assert LakeExporter(data_dir).export_once(conn) == {"events": 4, "commit_lines": 3, "inline_ratings": 7}
    conn.close()

    # A rerate of e3 under version 2026-11, a day later: reversals of its inline rows, then new rows.
    lake = connect_lake(data_dir)
    run, at = "rerate-1", RECEIVED + timedelta(days=1)
    lake.execute("INSERT INTO lake.rating_runs VALUES (?, 'rerate', 'succeeded', ?, ?, '{}', 1, 4)", [run, at, at])
    for line, meter, qty, old, new in ((0, "llm.input_tokens", 1000, 150, 200), (1, "llm.output_tokens", 500, 300, 400)):
        for status, q, amount in (("reversal", -qty, -old), ("rated", qty, new)):
            lake.execute(
                "INSERT INTO lake.rating_rows VALUES (?, ?, 'event', ?, ?::UUID, 'acme', 'acct_b', ?, "
                "'llm-completions', '2026-11', 'llm.chat', ?, ?, NULL, NULL, NULL, ?, ?, ?, ?, NULL)",
                [f"{run}-{status}-{line}", run, ids["e3"], ids["e3"], status, meter, q, amount,
                 occurred["e3"], at, line])
    lake.close()
    return ids


@pytest.fixture(scope="module")
def lake_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    data_dir = tmp_path_factory.mktemp("lake")
    build_lake(data_dir)
    yield data_dir


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
    assert json.loads(sql(lake_dir, "SELECT sum(amount_xusd) AS total FROM ratings", "json").stdout) == [
        {"total": 180 + 180 + 300 + 0 + 200 + 400 + 6000 + 750 + 600}]


def raw_sql(data_dir: Path, *args: str, stdin: str = "") -> tuple[str, str]:
    """(stdout, stderr) exactly as written (no newline translation), with no `duckdb` shell
    on PATH so that the built-in loop answers when no query is given."""
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    result = subprocess.run([sys.executable, "-m", "api.cli", "sql", *args, "--data-dir", str(data_dir)],
                            input=stdin.encode(), capture_output=True, env=env, check=True)
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


def test_a_bad_query_fails_clearly(lake_dir: Path, tmp_path: Path) -> None:
    result = sql(lake_dir, "SELECT nope FROM events", "json", check=False)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("tollgate sql: ") and "nope" in result.stderr
    missing = sql(tmp_path, "SELECT 1", "json", check=False)
    assert missing.returncode == 1 and "no lake" in missing.stderr


def test_without_a_query_statements_are_read_from_stdin(lake_dir: Path) -> None:
    out, err = raw_sql(lake_dir, "--format", "csv", stdin="SELECT count(*) AS n\nFROM events;\n"
                       "INSERT INTO events (realm) VALUES ('x');\nSELECT 'x' AS y;\n")
    assert out == "n\r\n4\r\ny\r\nx\r\n"
    assert "read-only" in err


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
        "current ratings", "usage by account and day", "revenue by meter",
        "late events and the day they were billed to", "late revenue by day of arrival",
        "events without a policy", "amounts by policy version", "what a re-rating changed, per run"}


def test_current_ratings_are_the_latest_run_without_reversals(analyst: duckdb.DuckDBPyConnection) -> None:
    rows = analyst.execute(f"SELECT rating_id, run_id, status, amount_xusd FROM ({guide_queries()['current ratings'].rstrip().rstrip(';')})").fetchall()
    ids = {r[0] for r in rows}
    assert len(rows) == 10  # 4 lines of e1 and e2, 2 rerated lines of e3, e4's skip, 3 gate lines
    assert {"rerate-1-rated-0", "rerate-1-rated-1"} <= ids
    assert not {"r-e3-0", "r-e3-1", "rerate-1-reversal-0"} & ids
    assert sum(r[3] or 0 for r in rows) == analyst.execute("SELECT sum(amount_xusd) FROM ratings").fetchone()[0]


def test_usage_by_account_and_day(analyst: duckdb.DuckDBPyConnection) -> None:
    day = datetime(2026, 11, 22).date()
    assert [r[:5] for r in run(analyst, "usage by account and day")] == [
        ("acct_a", datetime(2026, 11, 21).date(), "llm.input_tokens", 2000, 300),
        ("acct_a", datetime(2026, 11, 21).date(), "llm.output_tokens", 0, 0),
        ("acct_a", day, "api.calls", 3, 6000),
        ("acct_a", day, "llm.input_tokens", 1200, 180),
        ("acct_a", day, "llm.output_tokens", 300, 180),
        ("acct_b", day, "llm.input_tokens", 6000, 950),
        ("acct_b", day, "llm.output_tokens", 1500, 1000),
    ]


def test_revenue_by_meter(analyst: duckdb.DuckDBPyConnection) -> None:
    rows = run(analyst, "revenue by meter")
    assert [(r[1], r[2], str(r[3])) for r in rows] == [
        ("api.calls", 6000, "0.006000"), ("llm.input_tokens", 1430, "0.001430"),
        ("llm.output_tokens", 1180, "0.001180")]


def test_late_events(analyst: duckdb.DuckDBPyConnection, lake_dir: Path) -> None:
    late = run(analyst, "late events and the day they were billed to")
    assert len(late) == 3  # all arrived at 12:00; e3 happened at 10:00, exactly 2 h before
    e2 = late[0]
    assert e2[5] == timedelta(hours=12, minutes=30)
    assert (e2[6], e2[7], e2[8]) == (datetime(2026, 11, 22).date(), datetime(2026, 11, 21).date(), 300)
    assert run(analyst, "late revenue by day of arrival") == [(datetime(2026, 11, 22).date(), 1, 300)]


def test_events_without_a_policy(analyst: duckdb.DuckDBPyConnection) -> None:
    rows = run(analyst, "events without a policy")
    assert [r[:4] for r in rows] == [("acme", "acct_b", "job.done", 1)]


def test_a_policy_versions_effect(analyst: duckdb.DuckDBPyConnection) -> None:
    rows = run(analyst, "amounts by policy version")
    assert [(r[1], r[2], r[3], r[4], r[6]) for r in rows] == [
        ("llm-completions", "2026-01", datetime(2026, 1, 1, tzinfo=timezone.utc), 2, 180 + 180 + 300 + 0),
        ("llm-completions", "2026-11", datetime(2026, 11, 1, tzinfo=timezone.utc), 1, 200 + 400)]
    changes = run(analyst, "what a re-rating changed, per run")
    assert [(r[0], r[1], r[3], r[5]) for r in changes] == [
        ("inline", "inline", "rated", 1110), ("inline", "inline", "skipped_no_policy", None),
        ("rerate-1", "rerate", "rated", 600), ("rerate-1", "rerate", "reversal", -450)]


def test_without_a_query_a_duckdb_shell_of_the_same_version_gets_the_session(lake_dir: Path, tmp_path: Path) -> None:
    # A stand-in shell that reports its version and records how it was started.
    shell = tmp_path / "duckdb"
    shell.write_text(f"""#!/bin/sh
if [ "$1" = "-version" ]; then echo "v{duckdb.__version__} 0000000000"; exit 0; fi
printf '%s\\n' "$@" > {tmp_path / "args"}
""")
    shell.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{Path(sys.executable).parent}"}
    subprocess.run([sys.executable, "-m", "api.cli", "sql", "--data-dir", str(lake_dir)],
                   env=env, check=True, capture_output=True)
    flag, init = (tmp_path / "args").read_text().splitlines()[:2]
    assert flag == "-cmd"
    assert "LOAD ducklake" in init and init.endswith("USE lake;")
    assert f"ATTACH 'ducklake:sqlite:{lake_dir / 'lake' / 'catalog.sqlite'}' AS lake (READ_ONLY)" in init
