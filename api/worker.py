"""An HTTP worker of `tollgate serve`: `python -m api.worker --data-dir D --listen-fd L ...`.

Started by the service's parent process (`api.supervisor`) with the listening TCP socket it
bound (`--listen-fd`), a pipe to say it is ready on (`--ready-fd`) and, when the service runs
more than one worker, its end of a socket pair to the parent (`--state-fd`, `api.shared`) and
the memory where the workers count their connections (`--connections-fd`,
`api.http_protocol.ConnectionCount`). It
serves the Litestar app with uvicorn on that socket and connects to the writer on the data
folder's `writer.sock` (`api.runtime`).

SIGTERM stops it gracefully: it stops accepting, answers the requests it holds (at most half
of TOLLGATE_STOP_SECONDS, then the rest are cut), and exits 0. SIGINT is ignored, here and in
the processes it starts (a Ctrl-C in a terminal reaches every process of the group; the
parent answers it with a SIGTERM to each worker). It ends at once when the parent dies
(PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Iterator
from types import FrameType

from core.lifetime import end_with_parent

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m api.worker")
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--state-fd", type=int, default=None)
    parser.add_argument("--connections-fd", type=int, default=None)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--workers", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # see Server.capture_signals below
    if not end_with_parent(signal.SIGKILL, os.getppid()):  # the parent died before the request
        return 0

    import uvicorn

    from api.app import create_app
    from api.http_protocol import ConnectionCount, http_protocol
    from api.shared import RemoteState
    from core.layout import keep_private
    from core.logs import setup_logging
    from core.settings import Settings

    keep_private()
    settings = Settings.from_env(args.data_dir, args.host, args.port, workers=args.workers)
    setup_logging("http", settings.log_format or None)
    shared = RemoteState(socket.socket(fileno=args.state_fd)) if args.state_fd is not None else None
    ready_fd = args.ready_fd

    def ready() -> None:
        try:
            os.write(ready_fd, b"r")
            os.close(ready_fd)
        except OSError:
            pass

    app = create_app(settings, shared=shared, worker=args.index)
    app.on_startup.append(lambda _app: ready())
    listen = socket.socket(fileno=args.listen_fd)
    counter = (ConnectionCount(args.connections_fd, args.workers, args.index)
               if args.connections_fd is not None else None)
    config = uvicorn.Config(app, loop="uvloop", http=http_protocol(settings, counter), lifespan="on",
                            log_level="warning", log_config=None,  # through core.logs
                            access_log=False,  # api/observe.py writes the access log
                            timeout_keep_alive=settings.keep_alive_seconds, proxy_headers=False,
                            timeout_graceful_shutdown=max(1, int(settings.stop_seconds * 0.5)))
    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # SIGTERM only (from the parent); SIGINT stays ignored, and so do the processes
            # this worker starts (its decoding processes inherit that): a Ctrl-C reaches the
            # whole process group, and the parent turns it into a SIGTERM to each worker.
            previous = signal.signal(signal.SIGTERM, self.handle_exit)
            try:
                yield
            finally:
                signal.signal(signal.SIGTERM, previous)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Stopped by SIGTERM or SIGINT alike, without re-raising the signal at the end
            # (uvicorn ends its process by the signal that stopped it; a worker exits 0), and
            # a second signal does not cut the requests in flight: the parent bounds the stop.
            self.should_exit = True

    server = Server(config)
    server.run(sockets=[listen])
    if not server.started:
        return 1  # its start failed (logged by uvicorn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
