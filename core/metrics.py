"""What the processes of `tollgate serve` share to publish Prometheus metrics.

The HTTP process serves GET /metrics (`api.metrics`). The writer and the scheduler keep
registries of their own and write them, in the Prometheus text format, to
`metrics/writer.prom` and `metrics/scheduler.prom` in the data folder (`write_registry`:
a new file renamed into place, so a reader never sees half of one); the writer on each tick
(every 0.25 s), the scheduler after each flow run and every 15 s. The HTTP process merges
them into its answer at each scrape, and reports the age of the writer's file as
`tollgate_writer_last_tick_age_seconds`: a hung writer shows as a growing age.
"""

from __future__ import annotations

import os
from pathlib import Path

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

__all__ = ["rss_bytes", "rss_family", "write_registry"]

# No `_created` series: they double the lines and, merged across processes, say nothing.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int | str = "self") -> int:
    """The resident set size of a process (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def rss_family(process: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily("tollgate_process_resident_memory_bytes",
                               "Resident memory of each process of the service", labels=["process"])
    family.add_metric([process], rss_bytes())
    return family


def write_registry(registry: CollectorRegistry, path: Path) -> None:
    """The registry's text exposition to `path`, replaced whole."""
    text = generate_latest(registry)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(text)
    os.replace(tmp, path)
