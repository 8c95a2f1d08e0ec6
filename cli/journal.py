"""`tollgate journal check|accept-loss`: the writer's journal, for an operator.

The writer refuses to start when its journal may have lost an acknowledged group (bad bytes
with a valid record after them, or a jump in group numbers; `warehouse.journal_scan`). `check`
says what recovery would do, read-only. `accept-loss` accepts the loss explicitly: it keeps a
byte-for-byte copy of every segment it changes in `journal-quarantine/` of the data folder,
and records what it accepted in `journal-quarantine/accepted-loss.log`; it deletes nothing.
Both run with the service stopped (the operational file has one writing process).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

from cyclopts import App, Parameter

from cli.shared import OPTIONS, CommandError, DataDir
from core.settings import Settings

if TYPE_CHECKING:
    from warehouse.journal_scan import JournalScan

__all__ = ["app"]

app = App(name="journal", help="Check the writer's journal, or accept a loss it found.",
          group_parameters=OPTIONS)


def _scan(settings: Settings) -> JournalScan:
    import duckdb

    from warehouse.journal_scan import applied_seq, scan_journal

    try:
        applied = applied_seq(settings.operational_path)
    except duckdb.IOException as exc:
        raise CommandError(f"cannot read the operational file ({' '.join(str(exc).split())});"
                           " stop the service first", 2) from None
    return scan_journal(settings.folder.journal, applied, keep_tables=False)


@app.command(sort_key=1)
def check(*, data_dir: DataDir = None) -> int:
    """Say what the writer's recovery would do with the journal, read-only.

    Exit code 0 when the service would start, 1 when recovery would refuse.
    """
    settings = Settings.from_env(data_dir)
    scan = _scan(settings)
    for line in scan.report():
        print(line)
    return 0 if scan.ok else 1


@app.command(name="accept-loss", sort_key=2)
def accept_loss(*, through: Annotated[int | None, Parameter(metavar="GROUP")] = None,
                segment: Annotated[str | None, Parameter(metavar="NAME")] = None,
                data_dir: DataDir = None) -> int:
    """Accept the loss of groups that `journal check` reports.

    A segment it changes is first copied into journal-quarantine/ in the data
    folder; what it accepts is added to journal-quarantine/accepted-loss.log.
    The segment keeps its readable groups; an empty group stands for each one
    lost, so that the group numbers follow on again. Nothing is deleted.

    Parameters
    ----------
    through
        accept the bad bytes and lost groups numbered up to GROUP
    segment
        move the segment NAME whole into the quarantine folder first
    """
    from cli.serve import _lock_data_dir
    from warehouse import journal_scan

    if through is None and segment is None:
        raise CommandError("say what to accept: --through GROUP or --segment NAME (see"
                           " `tollgate journal check`, and `tollgate journal accept-loss --help`)", 2)
    settings = Settings.from_env(data_dir)
    if not settings.folder.journal.is_dir():
        raise CommandError(f"{settings.data_dir} has no journal", 2)
    lock = _lock_data_dir(settings.data_dir)
    if lock is None:
        raise CommandError("the service is running on this data folder; stop it first", 2)
    try:
        scan = _scan(settings)
        if segment is not None:
            try:
                aside = journal_scan.set_aside(scan, segment)
            except FileNotFoundError as exc:
                raise CommandError(str(exc), 2) from None
            print(f"moved {segment} to {aside}")
            scan = _scan(settings)
        if through is not None:
            for problem in journal_scan.accept_loss(scan, through):
                print(f"accepted: {problem.describe()}")
            scan = _scan(settings)
        for line in scan.report():
            print(line)
    finally:
        os.close(lock)
    return 0 if scan.ok else 1
