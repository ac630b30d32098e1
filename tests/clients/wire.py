"""A FakeV2 on a real socket: the client's own transport (``_h1``) under the client tests.

:class:`WireServer` is the standard library's threading HTTP/1.1 server: each request it reads
becomes an ``httpx.Request`` for ``FakeV2.handler``, whose ``httpx.Response`` goes back on the
wire as it stands (its ``Content-Encoding`` not undone, its own framing replaced by a
``Content-Length``). A scripted exception (a transport failure for ``MockTransport``) has no
answer to send: the connection is closed with no response, which the client sees as a broken
connection.
"""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from .fake_v2 import FakeV2

_FRAMING = {"content-length", "transfer-encoding", "connection"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.paths.append(self.path)
        path = self.path
        if self.server.prefix and path.startswith(self.server.prefix + "/"):
            path = path[
                len(self.server.prefix) :
            ]  # the URL's route prefix, as an ingress strips it
        request = httpx.Request(
            self.command,
            "http://fake" + path,
            headers=list(self.headers.items()),
            content=body,
        )
        try:
            response = self.server.fake.handler(request)
        except Exception:  # a scripted transport failure: drop the connection unanswered
            self.close_connection = True
            return
        raw = b"".join(response.stream)  # type: ignore[arg-type]  # the body as encoded
        self.send_response_only(response.status_code, response.reason_phrase)
        for name, value in response.headers.multi_items():
            if name.lower() not in _FRAMING:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog: 16 clients connecting at once (not 5)
    fake: FakeV2
    prefix = ""
    paths: list[str]

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away (the tests' failed and cancelled calls) is not an error
        to print: and on Python 3.11 printing it from this thread parses source lines with
        ``ast`` for the carets, which can leave the interpreter's AST recursion counter wrong
        for a parse in the test's thread (CPython gh-106905: ``SystemError: AST constructor
        recursion depth mismatch`` from ``np.load``, seen once in CI)."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class WireServer:
    """``fake`` served on ``127.0.0.1`` (an ephemeral port) until :meth:`close`."""

    def __init__(self, fake: FakeV2) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = fake
        self._server.paths = []
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, like: str, strip_prefix: bool = False) -> str:
        """``like`` (a URL, perhaps with a route prefix) on this server's host and port; with
        ``strip_prefix``, its route prefix is taken off before the fake sees a path (as an
        ingress would), else the fake answers 404 to the prefixed paths."""
        url = httpx.URL(like).copy_with(host="127.0.0.1", port=self.port)
        self._server.prefix = url.path.rstrip("/") if strip_prefix else ""
        return str(url)

    @property
    def paths(self) -> list[str]:
        """Every request's target as it arrived (route prefix included)."""
        return self._server.paths

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
