"""The `tollgate` command: the cyclopts App that gathers the subcommands, and the one error path.

Each subcommand lives in a module of its own: `cli.serve`, `cli.keys`, `cli.catalog`,
`cli.call`, `cli.sql`, `cli.flows`, `cli.report` and `cli.journal`; they import what is heavy (DuckDB,
uvicorn, Prefect, matplotlib) inside the commands, so `tollgate --help` and `tollgate call`
start quickly. This module owns the parsing and `main`, the only place where an error
becomes a message and an exit code: a usage error 2, `CommandError` its own code, a bad
setting (`ConfigError`) 2, a data folder that cannot be read or written (`OSError`) 1, a
reader that went away (`BrokenPipeError`) 141, Ctrl-C 130. (A command's own report, such as
the faults of a catalog, is its output.)
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cyclopts import App, CycloptsError, Parameter, UnusedCliTokensError

from cli import catalog, flows, journal, keys
from cli.call import call
from cli.report import report
from cli.serve import serve
from cli.shared import OPTIONS, CommandError
from cli.sql import sql
from core.layout import keep_private
from core.settings import ConfigError

__all__ = ["app", "main"]

app = App(
    name="tollgate",
    help="The tollgate service and its tools: serve, keys, catalog, call, sql, flows, report,"
         " journal.\n\n"
         "Every subcommand takes --data-dir (or TOLLGATE_DATA_DIR; default ./var).",
    # The commands and flags are those of the argparse command line before: no --version.
    version_flags=(),
    # Docstrings are plain prose, wrapped by hand under 80 columns: they print as written
    # (and rendering Markdown would load markdown-it for every --help).
    help_format="plaintext",
    group_parameters=OPTIONS,
    # A flag given twice takes its last value, as argparse did (cyclopts refuses the repeat):
    # a wrapper script may append its own --data-dir to a command line.
    default_parameter=Parameter(allow_repeating=True),
)
# The sort keys list the commands in this order (cyclopts would sort them by name): the
# service, then its tools.
app.command(serve, sort_key=1)
keys.app.sort_key = 2
app.command(keys.app)
catalog.app.sort_key = 3
app.command(catalog.app)
app.command(call, sort_key=4)
# cyclopts' usage line shows an optional positional as [ARGS]: name it.
app.command(sql, sort_key=5, usage="Usage: tollgate sql [OPTIONS] [QUERY]")
flows.app.sort_key = 6
app.command(flows.app)
app.command(report, sort_key=7)
journal.app.sort_key = 8
app.command(journal.app)


def main(argv: Sequence[str] | None = None) -> int:
    """Run `tollgate` with `argv` (default: the process's arguments); the exit code."""
    keep_private()  # what a command creates in a data folder is 0600, its folders 0700
    tokens = list(sys.argv[1:] if argv is None else argv)
    try:
        command, bound, _ = app.parse_args(tokens, print_error=False, exit_on_error=False)
        if _is_help(command):
            if not _asks_for_help(tokens):
                # cyclopts answers `tollgate keys` (a group without its command) with the help
                # page and 0; a command line that runs nothing is a usage error, as it was.
                return _fail(_needs_a_command(tokens), 2)
            # To a terminal, cyclopts' rich panels; to a pipe or a file (and tests), plain
            # text. Set here: the formatters load only for a help page.
            app.help_formatter = "default" if sys.stdout.isatty() else "plain"
        return int(command(*bound.args, **bound.kwargs) or 0)  # a help page returns None
    except CycloptsError as exc:  # the command line does not parse
        return _fail(_usage_message(exc, tokens), 2)
    except CommandError as exc:
        return _fail(f"tollgate: {exc}", exc.exit_code)
    except BrokenPipeError:
        # The reader of our output went away (`tollgate sql ... | head`): not an error here.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except ConfigError as exc:  # a setting from the environment (flags are checked when parsed)
        return _fail(f"tollgate: {exc}", 2)
    except OSError as exc:  # the data folder cannot be read or written: say so in one line
        return _fail(f"tollgate: {exc}", 1)
    except KeyboardInterrupt:
        return 130


def _fail(message: str, exit_code: int) -> int:
    print(message, file=sys.stderr)
    return exit_code


def _is_help(command: Callable[..., Any]) -> bool:
    return getattr(command, "__func__", None) is App.help_print


def _asks_for_help(tokens: list[str]) -> bool:
    before_delimiter = tokens[:tokens.index("--")] if "--" in tokens else tokens
    return any(token in app.help_flags for token in before_delimiter)


def _needs_a_command(tokens: list[str]) -> str:
    """The message for a command line that names a group (`tollgate keys`) but none of its
    commands, or nothing at all."""
    chain, apps, _ = app.parse_commands(tokens)
    names = [name for name in apps[-1] if name not in app.help_flags]
    return f"tollgate: which command? {', '.join(names)} (see `{' '.join(('tollgate', *chain))} --help`)"


def _usage_message(exc: CycloptsError, tokens: list[str]) -> str:
    """cyclopts' own message in one line, and which help page shows the usage."""
    try:
        chain: Sequence[str] = app.parse_commands(tokens)[0]
    except CycloptsError:
        chain = ()
    if isinstance(exc, UnusedCliTokensError):  # cyclopts says "Unused Tokens: ['x']"
        extra = exc.unused_tokens or []
        message = f"unexpected argument{'s' if len(extra) > 1 else ''} {' '.join(map(repr, extra))}"
    else:
        message = " ".join(str(exc).split())
    return f"tollgate: {message} (see `{' '.join(('tollgate', *chain))} --help`)"


if __name__ == "__main__":
    sys.exit(main())
