"""What every benchmark shares: a real `tollgate serve` in a fresh data folder, and a lean
HTTP/1.1 keep-alive client on loopback (a protocol on uvloop) so the load generator costs as
little CPU as possible (it shares the machine with the server)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    data_dir: Path
    port: int
    key_id: str
    secret: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def start_server(catalog: Path | None = None, *, schedules: bool = False,
                 args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Server:
    """`tollgate serve` on a fresh data folder. The flow schedules are off unless `schedules`:
    most benchmarks measure the request path alone, and a rating sweep of the benchmark's own
    events would run beside it (bench/rating.py measures that; bench/mixed.py runs the service
    as users start it, schedules on)."""
    data_dir = Path(tempfile.mkdtemp(prefix="tollgate-bench-"))
    cli = [sys.executable, "-m", "cli"]
    subprocess.run([*cli, "catalog", "apply", str(catalog or ROOT / "cli" / "demo" / "catalog.toml"),
                    "--data-dir", str(data_dir)], check=True, capture_output=True, cwd=ROOT)
    key = json.loads(subprocess.run([*cli, "keys", "create", "--realm", "acme", "--data-dir", str(data_dir)],
                                    check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    port = free_port()
    proc = subprocess.Popen([*cli, "serve", "--port", str(port), "--data-dir", str(data_dir), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1",
                                 "TOLLGATE_SCHEDULES": "on" if schedules else "off", **(env or {})})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                if b" 200 " in s.recv(200):
                    return Server(data_dir, port, key["key_id"], key["secret"], proc)
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("server did not start")


def run(coro: Any) -> Any:
    """Run a load generator on uvloop, the same loop as the server: it costs less CPU per
    request than asyncio's own, and the load generator shares the machine."""
    import uvloop

    return uvloop.run(coro)


class _Client(asyncio.Protocol):
    """Reads HTTP/1.1 responses framed by Content-Length (what the service sends)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None:
            return
        lines = bytes(self.buf[:end]).split(b"\r\n")
        length = 0
        for line in lines[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if len(self.buf) < end + 4 + length:
            return
        status = int(lines[0][9:12])
        body = bytes(self.buf[end + 4:end + 4 + length])
        del self.buf[:end + 4 + length]
        waiter, self.waiter = self.waiter, None
        waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))


class Connection:
    """One keep-alive HTTP/1.1 connection; requests go one at a time."""

    def __init__(self, protocol: _Client) -> None:
        self.protocol = protocol

    @staticmethod
    async def open(port: int) -> Connection:
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.create_connection(_Client, "127.0.0.1", port)
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Connection(protocol)

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
        head.extend(f"{k}: {v}" for k, v in headers.items())
        waiter = self.protocol.waiter = asyncio.get_running_loop().create_future()
        self.protocol.transport.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)  # type: ignore[union-attr]
        return await waiter

    def close(self) -> None:
        self.protocol.transport.close()  # type: ignore[union-attr]


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
