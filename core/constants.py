"""Constants shared by the stores and the domain."""

from __future__ import annotations

__all__ = ["INT64_MAX", "INT64_MIN", "WRITER_JOURNAL_REFUSED", "WRITER_REOPEN"]

# Amounts and quantities are BIGINT in the operational file and the lake: a value beyond
# these is refused at the edge rather than wrapped or widened on the way.
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

# The exit code of a writer process whose journal may have lost an acknowledged group: it has
# printed why and which command to run, and the service does not start.
WRITER_JOURNAL_REFUSED = 3

# The exit code of a writer process whose operational file a failed write invalidated (a full
# disk): once the disk has room again it ends, and the service starts a new one, which reopens
# the file and applies the journal.
WRITER_REOPEN = 4
