"""Constants shared by the stores and the domain."""

from __future__ import annotations

__all__ = ["INT64_MAX", "INT64_MIN"]

# Amounts and quantities are BIGINT in the operational file and the lake: a value beyond
# these is refused at the edge rather than wrapped or widened on the way.
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
