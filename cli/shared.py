"""What the `tollgate` commands share: the `--data-dir`, `--host` and `--port` parameters, and
`CommandError`, the way a command stops early with a one-line message (`cli.main` prints it
and turns it into the exit code).

The flags carry no environment fallback of their own: a flag left out is None, and
`core.settings.Settings.from_env` reads TOLLGATE_DATA_DIR, TOLLGATE_HOST and TOLLGATE_PORT, so a
bad value in the environment is named the same way for every command.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from cyclopts import Parameter, Token

from core.settings import parse_port

__all__ = ["OPTIONS", "CommandError", "DataDir", "Host", "Port", "Workers"]


# The heading of the flags on every help page (cyclopts says "Parameters"); a group's App
# passes it on to the commands registered on it, so each group sets it too.
OPTIONS = "Options"


class CommandError(Exception):
    """A command that cannot go on: `tollgate: <message>` on stderr, and `exit_code` (2 for
    what the caller can fix in the command line or the set-up, 1 for a failure)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _port(hint: Any, tokens: Sequence[Token]) -> int:
    # parse_port raises ConfigError, a ValueError: cyclopts reports it as a usage error of
    # --port (exit code 2), so 0 or 99999 never reach the socket (99999 would wrap around).
    return parse_port(tokens[0].value)


DataDir = Annotated[str | None, Parameter(
    name="--data-dir", metavar="DIR", help="data folder (TOLLGATE_DATA_DIR; default ./var)")]
# What the address means differs (listen on it, or send to it): each command's docstring says.
Host = Annotated[str | None, Parameter(name="--host", metavar="HOST")]
Port = Annotated[int | None, Parameter(name="--port", metavar="PORT", converter=_port)]


def _workers(hint: Any, tokens: Sequence[Token]) -> int:
    text = tokens[0].value
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--workers must be a whole number, 1 or more, not {text!r}")
    return int(text)


Workers = Annotated[int | None, Parameter(name="--workers", metavar="N", converter=_workers)]
