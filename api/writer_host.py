"""The writer process: `python -m api.writer_host --fd N --data-dir D`.

Started by the service with one end of a socket pair. It opens the operational file (the
only process that does), rebuilds in-memory state from it, says it is ready, and then runs
the group-commit loop of `warehouse.writer` with the handlers of every write op. It exits
when the service's end closes, and, on Linux, when the service dies (PR_SET_PDEATHSIG), so
a killed service never leaves the file locked.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import msgspec

from api.events.ingest import IngestHandler, IngestOp
from warehouse.operational import open_operational, schema_version
from warehouse.outbox import EventOutbox
from warehouse.writer import run_writer

__all__ = ["OPS", "RESULT_TYPES", "main"]

OPS = IngestOp
RESULT_TYPES: dict[type, Any] = {IngestOp: IngestOp.result_type}


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--data-dir", required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    sock = socket.socket(fileno=args.fd)
    conn = open_operational(Path(args.data_dir) / "operational.duckdb")
    outbox = EventOutbox(conn)
    handlers = {IngestOp: IngestHandler(outbox)}

    def rebuild(c: Any) -> None:
        outbox.reload(c)

    decoder = msgspec.msgpack.Decoder(tuple[int, OPS])

    def decode_request(frame: bytes) -> tuple[int, Any]:
        return decoder.decode(frame)

    hello = msgspec.msgpack.encode({"ready": True, "schema_version": schema_version(conn),
                                    "events": len(outbox)})
    sock.sendall(len(hello).to_bytes(4, "big") + hello)
    run_writer(conn, sock, decode_request, handlers, on_rollback=rebuild)
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
