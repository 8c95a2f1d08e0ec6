"""`tollgate sql`: the lake in DuckDB, attached read-only as `lake`, for analysts.

    tollgate sql                                 an interactive session (`USE lake` is set)
    tollgate sql "SELECT ..." [--format F]       one query; F is table (default), csv or json

The interactive session is a small read-eval-print loop over stdin, never the `duckdb`
command-line shell: every statement of either path passes the same guard (`_refusals`), which
the shell would skip. Results: `table` aligns columns (cells cut at 80
characters), `csv` is RFC 4180 with a header row, `json` is an array of objects in which
integers stay integers (amounts are xusd integers), timestamps are ISO 8601 strings and JSON
columns are nested values. The attach is read-only, so a write statement fails (exit code 1),
as does any bad query. A read-only attach alone still lets DuckLake's maintenance functions
write Parquet files before they fail (`ducklake_flush_inlined_data`, however it is spelled:
CALL, SELECT, a view, `query()`), so each statement is planned first and refused when its plan
writes a file or runs a DuckLake function other than a read.
"""

from __future__ import annotations

import base64
import csv
import datetime as dt
import functools
import math
import re
import sys
import uuid
from collections.abc import Sequence
from decimal import Decimal
from pathlib import Path
from typing import IO, TYPE_CHECKING, Annotated, Any, Literal

from cyclopts import Parameter

from cli.shared import DataDir
from core.settings import Settings

if TYPE_CHECKING:
    import msgspec

__all__ = ["sql", "write_result"]

_CELL_WIDTH = 80


@functools.cache
def _json() -> msgspec.json.Encoder:
    """The JSON encoder of results (msgspec loads on first use: --help does not pay for it).
    Decimals keep every digit as a JSON number: no float in between."""
    import msgspec

    return msgspec.json.Encoder(decimal_format="number", enc_hook=str)


_NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")


def _not_an_option(hint: Any, query: str | None) -> None:
    # A query may begin with a `--` comment, so QUERY allows a leading hyphen; but one word
    # that starts with a hyphen is a mistyped option, not a query (argparse's rule, as before).
    if (query is not None and query.startswith("-") and not any(c.isspace() for c in query)
            and not _NEGATIVE_NUMBER.fullmatch(query)):
        raise ValueError("No such option.")


Query = Annotated[str | None, Parameter(metavar="QUERY", allow_leading_hyphen=True,
                                        validator=_not_an_option)]


def sql(query: Query = None, /, *,
        fmt: Annotated[Literal["table", "csv", "json"], Parameter(
            name="--format", metavar="table|csv|json", show_choices=False)] = "table",
        data_dir: DataDir = None) -> int:
    """Query the lake (read-only) in DuckDB.

    The lake is attached read-only as lake (USE lake is set). Without QUERY, an
    interactive session: a small loop over stdin (statements end with ;).

    Results: table aligns columns, csv is RFC 4180 with a header row, json is
    an array of objects (integers stay integers, times are ISO 8601). Exit code
    1 when a query fails, a write statement too.

    Parameters
    ----------
    query
        a query to run; without it, an interactive session
    fmt
        how to print results
    """
    folder = Settings.from_env(data_dir).data_dir
    import duckdb

    try:
        conn = _open_lake(folder)
    except (duckdb.Error, FileNotFoundError) as exc:
        print(f"tollgate sql: cannot open the lake: {exc}", file=sys.stderr)
        return 1
    try:
        if query is None:
            return _repl(conn, fmt)
        return 0 if _run(conn, query, fmt, sys.stdout) else 1
    finally:
        conn.close()


def _open_lake(data_dir: Path) -> Any:
    import duckdb

    from warehouse.lake import attach_lake

    conn = duckdb.connect()
    attach_lake(conn, data_dir, read_only=True)
    conn.execute("USE lake")
    for step in _sandbox(data_dir):
        conn.execute(step)
    return conn


def _sandbox(data_dir: Path) -> list[str]:
    """What keeps an analyst's session read-only beyond the read-only attach: no other
    database may be attached (a writable attach of the same lake) and no file written (COPY
    TO could replace the service's keys); only the lake's own data folder can be read.
    `lock_configuration` keeps a query from turning this off again."""
    from warehouse.lake import lake_paths

    _, data = lake_paths(data_dir.resolve())
    return [f"SET allowed_directories = ['{data}/']",
            "SET enable_external_access = false",
            "SET lock_configuration = true"]


def _refused_statements() -> frozenset[Any]:
    """Statements that could write: another database attached (even the lake, writable),
    files written, extensions loaded."""
    import duckdb

    kinds = duckdb.StatementType
    return frozenset({kinds.ATTACH, kinds.DETACH, kinds.COPY, kinds.EXPORT, kinds.LOAD,
                      kinds.COPY_DATABASE})



# What a plan may run: scans, and DuckLake's functions that only read its catalog.
_READ_ONLY_DUCKLAKE = frozenset({
    "DUCKLAKE_SCAN", "DUCKLAKE_SNAPSHOTS", "DUCKLAKE_TABLE_INFO", "DUCKLAKE_TABLE_CHANGES",
    "DUCKLAKE_TABLE_INSERTIONS", "DUCKLAKE_TABLE_DELETIONS", "DUCKLAKE_LIST_FILES",
    "DUCKLAKE_OPTIONS", "DUCKLAKE_CURRENT_SNAPSHOT", "DUCKLAKE_LAST_COMMITTED_SNAPSHOT",
})
_WRITING_OPERATORS = ("COPY_TO_FILE", "INSERT", "DELETE", "UPDATE", "MERGE_INTO", "CREATE_TABLE_AS")
_EXPLAIN_PREFIX = re.compile(r"\s*EXPLAIN\s+(?:\([^)]*\)\s*)?(?:ANALY[SZ]E\s+)?", re.IGNORECASE)


def _refusals(conn: Any, statement: Any) -> list[str]:
    """Why `statement` may not run: it writes a file or runs a DuckLake function other than a
    read. Judged on its plan (EXPLAIN, which runs nothing), so the spelling does not matter:
    `CALL ducklake_flush_inlined_data(..)`, `SELECT * FROM` it, a view or macro over it, or
    `query('...')` all plan the same operators. Statements without a plan (SET, SHOW, PREPARE)
    are judged when a plan runs them (EXECUTE, a SELECT of a view)."""
    import duckdb

    kinds = duckdb.StatementType
    if statement.type not in (kinds.SELECT, kinds.CALL, kinds.EXECUTE, kinds.EXPLAIN,
                              kinds.PRAGMA, kinds.INSERT, kinds.UPDATE, kinds.DELETE):
        return []
    # By name as well, before any plan: a call that cannot be planned here (or shows under
    # another name in its plan) still names itself.
    named = sorted({w.upper() for w in re.findall(r"\b(ducklake_[a-z_]+)\s*\(", statement.query, re.IGNORECASE)
                    if w.upper() not in _READ_ONLY_DUCKLAKE})
    if named:
        return named
    found: set[str] = set()
    text = statement.query
    if statement.type == kinds.EXPLAIN:  # EXPLAIN ANALYZE runs what it explains
        text = _EXPLAIN_PREFIX.sub("", text, count=1)
    try:
        rows = conn.execute(f"EXPLAIN (FORMAT JSON) {text}").fetchall()
    except duckdb.Error:
        return []  # it cannot be planned, so it cannot run either: its own error is clearer
    for _, plan in rows:
        words = set(re.findall(r"[A-Za-z_]+", plan.upper()))
        found |= {w for w in words if w.startswith("DUCKLAKE_") and w not in _READ_ONLY_DUCKLAKE}
        found |= {w for w in _WRITING_OPERATORS if w in words}
    return sorted(found)


def _run(conn: Any, query: str, fmt: str, out: IO[str], *, blank_ok: bool = False) -> bool:
    """Run one query and print its result; False (with the error on stderr) when it fails.
    A query with no statement (blank, or only comments) fails unless `blank_ok`."""
    import duckdb

    from warehouse.lake import with_lake_retry

    def step(text: str) -> tuple[Any, list[Any]]:
        cursor = conn.execute(text)
        return cursor.description, (cursor.fetchall() if cursor.description else [])

    try:
        kinds = _refused_statements()
        statements = conn.extract_statements(query)
        if not statements:  # blank, or only comments: DuckDB returns no result at all
            if not blank_ok:
                print("tollgate sql: no statement to run", file=sys.stderr)
            return blank_ok
        refused = [st.type.name for st in statements if st.type in kinds]
        description: Any = None
        rows: list[Any] = []
        for st in statements:
            # Each statement is judged just before it runs, after the ones before it (a view
            # a later statement reads is then there to be planned).
            refused = refused or _refusals(conn, st)
            if refused:
                print(f"tollgate sql: the lake is read-only here; {', '.join(refused)} is refused",
                      file=sys.stderr)
                return False
            # Nothing here writes, so a statement that met the service's commit (`database
            # is locked` on the lake's SQLite catalog) is simply run again.
            description, rows = with_lake_retry(functools.partial(step, st.query))
    except duckdb.Error as exc:
        print(f"tollgate sql: {exc}", file=sys.stderr)
        return False
    if description:
        write_result([d[0] for d in description], [str(d[1]) for d in description], rows, fmt, out)
    return True


def write_result(columns: Sequence[str], types: Sequence[str], rows: Sequence[Sequence[Any]],
                 fmt: str, out: IO[str]) -> None:
    """Print a result as an aligned table, RFC 4180 CSV or a JSON array of objects."""
    if fmt == "json":
        json_columns = {i for i, t in enumerate(types) if t == "JSON"}
        out.write("[")
        for n, row in enumerate(rows):
            record = {name: _json_value(v, i in json_columns) for i, (name, v) in enumerate(zip(columns, row, strict=False))}
            out.write(("\n" if n == 0 else ",\n") + _json().encode(record).decode())
        out.write("\n]\n" if rows else "]\n")
    elif fmt == "csv":
        writer = csv.writer(out, lineterminator="\r\n")
        writer.writerow(columns)
        writer.writerows([["" if v is None else _text(v) for v in row] for row in rows])
    else:
        _write_table(columns, rows, out)


def _write_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], out: IO[str]) -> None:
    cells = [[_cut(_text(v)) for v in row] for row in rows]
    numeric = [_numeric([row[i] for row in rows if row[i] is not None]) for i in range(len(columns))]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return " | ".join(v.rjust(w) if num else v.ljust(w)
                          for v, w, num in zip(values, widths, numeric, strict=False)).rstrip()

    out.write(line(list(columns)) + "\n")
    out.write("-+-".join("-" * w for w in widths) + "\n")
    for row in cells:
        out.write(line(row) + "\n")
    out.write(f"({len(rows)} row{'' if len(rows) == 1 else 's'})\n")


def _numeric(values: list[Any]) -> bool:
    """Right-align a column that holds numbers and nothing else."""
    return bool(values) and all(isinstance(v, (int, float, Decimal)) and not isinstance(v, bool)
                                for v in values)


def _cut(text: str) -> str:
    text = text.replace("\n", " ")
    return text if len(text) <= _CELL_WIDTH else text[:_CELL_WIDTH - 1] + "…"


def _text(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (list, tuple, dict)):
        return _json().encode(_json_value(value, False)).decode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, Decimal):
        return format(value, "f")  # every digit, never an exponent (str gives 1E-7, 0E-10)
    return str(value)


def _json_value(value: Any, is_json: bool) -> Any:
    """A value as JSON: ints and decimals stay numbers, times become ISO 8601 strings."""
    if value is None or isinstance(value, (bool, int, str, Decimal)):
        if is_json and isinstance(value, str):
            import msgspec

            try:
                return msgspec.json.decode(value)
            except msgspec.DecodeError:
                return value
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, (list, tuple)):
        return [_json_value(v, False) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_value(v, False) for k, v in value.items()}
    return str(value)


# ---- interactive -----------------------------------------------------------------------

def _repl(conn: Any, fmt: str) -> int:
    """Statements end with `;`; `.quit` or end of input leaves."""
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 (line editing and history for input())
        except ImportError:
            pass
        print("tollgate sql: the lake is attached read-only as `lake` (USE lake). "
              "End statements with ';', leave with .quit", file=sys.stderr)
    buffer: list[str] = []
    failed = False
    while True:
        try:
            line = input(("lake> " if not buffer else "  ...> ") if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            buffer.clear()
            continue
        if not buffer and line.strip() in (".quit", ".exit", "\\q"):
            break
        buffer.append(line)
        statement = "\n".join(buffer).strip()
        if statement.endswith(";"):
            buffer.clear()
            if statement.strip("; \n"):
                failed |= not _run(conn, statement, fmt, sys.stdout, blank_ok=True)
                sys.stdout.flush()
    rest = "\n".join(buffer).strip()
    if rest:
        failed |= not _run(conn, rest, fmt, sys.stdout, blank_ok=True)
    # Read from a pipe (a script), any failed statement fails the command; typed at a
    # terminal, the session goes on after an error and ends well.
    return 1 if failed and not interactive else 0


