"""An HTTP connection's server side driven in process: a fake transport for a protocol object.

bitserve's HTTP protocol (``service.rest.http_protocol``), or uvicorn's, runs on a
:class:`FakeClient` instead of a socket: what the client sends is fed to
``protocol.data_received``, what the server writes is kept and split into responses by
httptools' response parser. No socket, no system call: the profiling driver
(``benchmarks/overhead/inprocess.py``) and the express lane's comparison tests
(``tests/service/test_express_lane.py``) use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httptools


class Response:
    """One response as the client received it."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = bytearray()

    def header(self, name: bytes) -> bytes | None:
        """The value of a (lower-case) header, or None."""
        return next((v for k, v in self.headers if k == name), None)


class FakeClient(asyncio.Transport):
    """One client connection to ``protocol`` (attached by :meth:`attach`).

    Args:
        answered: called with each response once it is complete.
    """

    def __init__(self, answered: Callable[[FakeClient, Response], None] | None = None) -> None:
        super().__init__()
        self.protocol: asyncio.Protocol | None = None
        self.answered = answered
        self.responses: list[Response] = []
        self.closed = False
        self.paused = False
        self._parser = httptools.HttpResponseParser(self)
        self._current = Response()

    def attach(self, protocol: asyncio.Protocol) -> FakeClient:
        """Open the connection: ``protocol.connection_made`` with this transport."""
        self.protocol = protocol
        protocol.connection_made(self)
        return self

    def send(self, data: bytes) -> None:
        """Bytes from the client (one read of the server's socket)."""
        assert self.protocol is not None
        self.protocol.data_received(data)

    def hang_up(self) -> None:
        """The client closes its connection."""
        assert self.protocol is not None
        self.closed = True
        self.protocol.connection_lost(None)

    # --- httptools' response callbacks ----------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._current.body += body

    def on_message_complete(self) -> None:
        done, self._current = self._current, Response()
        done.status = self._parser.get_status_code()
        self.responses.append(done)
        if self.answered is not None:
            self.answered(self, done)

    # --- the transport --------------------------------------------------------------------

    def write(self, data: Any) -> None:
        chunk = bytes(data)
        self._current.raw += chunk
        self._parser.feed_data(chunk)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.protocol is not None:
                asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """The server's last answer is out (a lingering close): the client, having read
        it, hangs up."""
        self.close()

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        addresses = {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 40000)}
        return addresses.get(name, default)


def host_config(app: Any, http: Any) -> tuple[Any, Any]:
    """A uvicorn ``Config`` (loaded) and ``ServerState`` for protocols hosted by hand:
    ``http`` is the protocol class (``protocol(config, state, {})`` makes a connection)."""
    import uvicorn
    from uvicorn.server import ServerState

    config = uvicorn.Config(
        app, http=http, ws="none", lifespan="off", proxy_headers=False, access_log=False
    )
    config.load()
    return config, ServerState()
