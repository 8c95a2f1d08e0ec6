"""The command line's help and usage errors: `tollgate --help` lists every subcommand with a
line of help, each subcommand's help names its flags in plain text when not at a terminal,
a command line that does not parse exits 2 in one line, and --help stays quick to start
(DuckDB, uvicorn, Prefect and matplotlib load only in the commands that need them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main

SUBCOMMANDS = ("serve", "keys", "catalog", "call", "sql", "flows", "report", "journal")
FLAGS = {
    ("serve",): ["--host", "--port", "--data-dir"],
    ("keys", "create"): ["--realm", "--data-dir"],
    ("keys", "list"): ["--data-dir"],
    ("keys", "disable"): ["KEY_ID", "--data-dir"],
    ("keys", "enable"): ["KEY_ID", "--data-dir"],
    ("catalog", "check"): ["FILE", "--data-dir"],
    ("catalog", "apply"): ["FILE", "--data-dir"],
    ("call",): ["METHOD", "PATH", "--data", "--account", "--principal", "--realm", "--key-id",
                "--idempotency-key", "--host", "--port", "--data-dir"],
    ("sql",): ["QUERY", "--format", "--data-dir"],
    ("flows", "list"): ["--data-dir"],
    ("flows", "run"): ["NAME", "--param", "--data-dir"],
    ("report",): ["--account", "--month", "--realm", "--out", "--data-dir"],
    ("journal", "check"): ["--data-dir"],
    ("journal", "accept-loss"): ["--through", "--segment", "--data-dir"],
}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          timeout=60)


def plain(text: str) -> bool:
    """No terminal escapes and no box drawing: what a pipe or a file should get."""
    return "\x1b[" not in text and not re.search("[\u2500-\u257f]", text)


def test_the_help_lists_every_subcommand_with_one_line_of_help() -> None:
    r = cli("--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert plain(r.stdout), r.stdout
    listed = dict(re.findall(r"^  ([a-z]+): (\S.*)$", r.stdout, flags=re.MULTILINE))
    assert list(listed) == list(SUBCOMMANDS), r.stdout
    assert "flows" in r.stdout.split("Commands:")[0]  # the description names it too


@pytest.mark.parametrize("command", sorted(FLAGS), ids=" ".join)
def test_each_subcommand_help_names_its_flags_in_plain_text(command: tuple[str, ...]) -> None:
    r = cli(*command, "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert plain(r.stdout), r.stdout
    assert r.stdout.startswith(f"Usage: tollgate {' '.join(command)}"), r.stdout
    for flag in FLAGS[command]:
        assert re.search(rf"^  {re.escape(flag)}\b.*: \S", r.stdout, flags=re.MULTILINE), (flag, r.stdout)


@pytest.mark.parametrize("group", ["keys", "catalog", "flows", "journal"])
def test_a_group_help_lists_its_commands(group: str) -> None:
    r = cli(group, "--help")
    listed = re.findall(r"^  ([a-z-]+): \S", r.stdout, flags=re.MULTILINE)
    assert listed == [c[1] for c in FLAGS if c[0] == group], r.stdout


@pytest.mark.parametrize("args", [
    [],                                        # no command at all
    ["keys"],                                  # a group without its command
    ["nope"],                                  # no such command
    ["keys", "create"],                        # a required flag left out
    ["call", "GET"],                           # a required argument left out
    ["call", "GET", "/healthz", "--bogus"],    # no such flag
    ["call", "GET", "/healthz", "--port", "99999"],
    ["sql", "--format", "xml"],
    ["sql", "--frmat", "csv"],                 # a mistyped flag is not a query
    ["serve", "extra"],
    ["report"],                                # --account left out
    ["report", "--account", "acct_a", "--month", "2026-1"],
    ["journal", "accept-loss"],                # nothing said to accept
], ids=lambda args: " ".join(args) or "(nothing)")
def test_a_usage_error_exits_2_in_one_readable_line(args: list[str], tmp_path: Path) -> None:
    r = cli(*args, "--data-dir", str(tmp_path)) if args else cli()
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tollgate: "), r.stderr
    assert plain(r.stderr) and "--help`" in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing ran


def test_main_returns_the_exit_code_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "Usage: tollgate" in capsys.readouterr().out
    assert main(["call", "GET", "/healthz", "--port", "0"]) == 2
    assert "65535" in capsys.readouterr().err


def test_help_and_call_load_neither_duckdb_nor_uvicorn_nor_prefect(tmp_path: Path) -> None:
    script = ("import sys\nfrom cli.main import main\nmain(sys.argv[1:])\n"
              "print(sorted({m.split('.')[0] for m in sys.modules}"
              " & {'duckdb', 'uvicorn', 'prefect', 'litestar', 'matplotlib'}))")
    for argv in (["--help"], ["keys", "--help"], ["report", "--help"],
                 ["call", "GET", "/healthz", "--port", "1", "--data-dir", str(tmp_path)]):
        r = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True,
                           timeout=60)
        assert r.stdout.splitlines()[-1] == "[]", (argv, r.stdout, r.stderr)


def test_a_flag_given_twice_takes_its_last_value_as_before(tmp_path: Path) -> None:
    r = cli("keys", "create", "--realm", "first", "--realm", "acme",
            "--data-dir", str(tmp_path / "a"), "--data-dir", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "a").exists()
    assert '"realm": "acme"' in cli("keys", "list", "--data-dir", str(tmp_path / "b")).stdout
