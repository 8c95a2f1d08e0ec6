"""Each response leaves in one write; nothing is ever held back for good."""

from __future__ import annotations

import socket

from api.http_protocol import OneWriteHttpToolsProtocol, _OneWriteTransport, http_protocol
from tests.conftest import Service


class _Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_head_waits_for_its_body_and_leaves_with_it() -> None:
    sent = _Recorder()
    t = _OneWriteTransport(sent)
    t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    assert sent.writes == []
    t.write(b"{}")
    assert sent.writes == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}"]
    t.write(b"more")                                   # a later chunk passes straight through
    assert sent.writes[-1] == b"more"
    assert t.is_closing() is False                     # everything else is the transport's


def test_a_head_without_body_is_flushed_at_completion_or_close_and_100_continue_is_not_held() -> None:
    sent = _Recorder()
    t = _OneWriteTransport(sent)
    t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert sent.writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    t.write(b"HTTP/1.1 204 No Content\r\n\r\n")
    t._flush()                                         # what the protocol does on completion
    assert sent.writes[-1] == b"HTTP/1.1 204 No Content\r\n\r\n"
    t.write(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
    t.close()
    assert sent.writes[-1].startswith(b"HTTP/1.1 500") and sent.closed


def test_the_service_runs_on_it_and_answers_head_and_pipelined_requests(service: Service) -> None:
    assert http_protocol() is OneWriteHttpToolsProtocol
    with socket.create_connection(("127.0.0.1", service.port), timeout=5) as s:
        s.sendall(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                  b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    first, second = data.split(b"HTTP/1.1 ")[1:3]
    assert first.startswith(b"200 ") and first.endswith(b"\r\n\r\n")  # a head, no body
    assert second.startswith(b"200 ") and second.endswith(b"}")


def test_a_request_the_parser_refuses_gets_the_error_envelope(service: Service) -> None:
    import json

    for request in (b"HELLO\r\n\r\n",
                    b"POST /mgt/v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", service.port), timeout=5) as s:
            s.sendall(request)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 400 "), data
        headers = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
        envelope = json.loads(body)
        assert envelope["ok"] is False and envelope["code"] == "REQUEST.INVALID"
        assert envelope["meta"] == {"status": 400} and envelope["errors"] == []
        assert headers[b"x-request-id"].decode() == envelope["trace_id"]
        assert headers[b"content-type"] == b"application/json"
