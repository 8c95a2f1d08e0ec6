"""The memory settings a flow's process runs with (`flows.workspace.settle_process_memory`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import json, sys
from pathlib import Path
import pyarrow as pa
before = pa.default_memory_pool().backend_name
from flows.workspace import close_lake, open_lake
conn = open_lake(Path(sys.argv[1]))
conn.execute("SELECT count(*) FROM lake.events").fetchall()
close_lake(conn)  # gives the memory kept for reuse back
close_lake(open_lake(Path(sys.argv[1])))  # a second flow in the process: settled once
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({"before": before, "after": pa.default_memory_pool().backend_name,
                  "thp": status.get("THP_enabled", "").strip()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux's")
def test_a_flow_process_reuses_its_memory_no_huge_pages_and_arrow_on_the_system_allocator(
    tmp_path: Path,
) -> None:
    # A fresh process, so what the test process did before cannot hide a missing setting.
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path)], cwd=root, check=True,
                         capture_output=True, text=True, timeout=120)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["before"] != "system"  # pyarrow's own default, which the flows replace
    assert seen["after"] == "system"
    if not seen["thp"]:
        pytest.skip("this kernel does not report THP_enabled")
    assert seen["thp"] == "0"  # transparent huge pages off for the process
