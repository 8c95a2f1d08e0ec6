"""What deciding nonces, rate windows and Idempotency-Keys in one place costs an HTTP worker
(`api/shared.py`): a worker's `RemoteState` against the parent's `StateServer`, each in its own
process over a socket pair as under `tollgate serve --workers N`.

Prints, per call kind, sequential round trips (p50/p99) and the rate with 32 callers at once;
in the same run, the raw limit: the same socket pair and framing with a bare echo on the other
side, and the same calls answered in-process (`LocalState`, what one worker does).

    python bench/shared_state.py [--calls 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.shared import LocalState, RemoteState, SharedState, StateBook, StateServer  # noqa: E402
from bench.loopback import percentile  # noqa: E402


class _Echo(StateServer):
    """Answers every request with its own id and True, deciding nothing."""

    def data_received(self, data: bytes) -> None:
        from api.shared import _decode, _frame, _frames

        self._buf += data
        replies = [_frame((_decode(body)[0], True)) for body in _frames(self._buf)]
        if replies and self._transport is not None:
            self._transport.write(b"".join(replies))


def serve(fd: int, mode: str) -> None:
    async def main() -> None:
        sock = socket.socket(fileno=fd)
        book = StateBook(300)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def make() -> StateServer:
            server = (_Echo if mode == "echo" else StateServer)(book)
            lost = server.connection_lost

            def ended(exc: Exception | None) -> None:
                lost(exc)
                if not done.done():
                    done.set_result(None)

            server.connection_lost = ended  # type: ignore[method-assign]
            return server

        await loop.create_unix_connection(make, sock=sock)
        await done

    import uvloop

    uvloop.run(main())


async def measure(state: SharedState, kind: str, calls: int) -> tuple[list[float], float]:
    plan = (("acme", "r1", "p", 1, 10**9),)
    counter = iter(range(10**9))

    async def one() -> None:
        n = next(counter)
        if kind == "nonce":
            await state.first_use("k", f"n{n}", time.time())
        elif kind == "rate":
            await state.admit(plan, time.time())
        else:
            scope = ("acme", "p", "authorize", f"i{n}")
            await state.acquire(scope)
            await state.release(scope)

    took = []
    for _ in range(calls):
        began = time.perf_counter()
        await one()
        took.append(time.perf_counter() - began)
    began = time.perf_counter()
    per = calls // 32

    async def caller() -> None:
        for _ in range(per):
            await one()

    await asyncio.gather(*(caller() for _ in range(32)))
    return took, per * 32 / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve is not None:
        serve(args.serve, args.mode)
        return
    print(f"nproc={os.cpu_count()}  python={sys.version.split()[0]}  calls={args.calls}")

    def remote(mode: str) -> tuple[RemoteState, subprocess.Popen[bytes]]:
        ours, theirs = socket.socketpair()
        proc = subprocess.Popen([sys.executable, __file__, "--serve", str(theirs.fileno()), "--mode", mode],
                                pass_fds=[theirs.fileno()])
        theirs.close()
        return RemoteState(ours), proc

    async def run_all() -> None:
        rows = []
        for mode, kinds in (("echo", ["echo"]), ("state", ["nonce", "rate", "idempotency"])):
            state, proc = remote(mode)
            await state.start()
            for kind in kinds:
                took, rate = await measure(state, "nonce" if kind == "echo" else kind, args.calls)
                rows.append((f"{kind} (parent)" if kind != "echo" else "raw limit: echo over the pair",
                             took, rate))
            state.close()
            await asyncio.sleep(0.1)  # the close reaches the other end
            proc.kill()
            proc.wait()
        local = LocalState(StateBook(300))
        for kind in ("nonce", "rate", "idempotency"):
            took, rate = await measure(local, kind, args.calls)
            rows.append((f"{kind} (in-process)", took, rate))
        for name, took, rate in rows:
            took.sort()
            print(f"{name:32}: p50 {percentile(took, .5) * 1e6:6.1f} us  p99 {percentile(took, .99) * 1e6:6.1f} us"
                  f"  sequential;  {rate:9,.0f} calls/s with 32 callers")

    import uvloop

    uvloop.run(run_all())


if __name__ == "__main__":
    main()
