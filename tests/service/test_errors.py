"""One error writer: every layer of every transport answers and logs an error by the same rule
(``service.errors``): its status, its message escaped and bounded, its log level. REST writes
it through ASGI, a FastAPI handler or raw HTTP/1.1 bytes (``service.rest.errors``), gRPC as a
status with details (``service.grpc.rpc``); each is compared here with the others."""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
import h11
import pytest

from service.errors import (
    MAX_MESSAGE_CHARS,
    DeadlineExceeded,
    HeaderLimit,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Overloaded,
    Relayed,
    RequestTimeout,
    ServiceError,
    Unauthorized,
    Unimplemented,
    log_level,
    report,
    shown_message,
)
from service.grpc.rpc import Rpcs
from service.rest.errors import error_bytes, error_parts, error_response, send_error

ERRORS = [
    InvalidInput("bad input 'x'"),
    Unauthorized(),
    ModelNotFound("Request for unknown model: 'm' is not found"),
    RequestTimeout("the request body did not arrive within 1 s"),
    HeaderLimit("too many request headers: 101 (limit 100)"),
    Overloaded("queue full", retry_after=2.4),
    ModelNotReady("the server is shutting down"),
    Unimplemented("no trace extension"),
    DeadlineExceeded("timeout expired"),
    Relayed(405, "method PUT is not allowed on /v2"),
    ServiceError("internal error (request id 1)"),
]


@pytest.mark.parametrize(
    ("error", "level"),
    [
        (InvalidInput("x"), logging.INFO),
        (ModelNotFound("x"), logging.INFO),
        (Relayed(405, "x"), logging.INFO),
        (Unimplemented("x"), logging.INFO),  # a question a client may ask
        (ServiceError("x"), logging.WARNING),
        (Overloaded("x"), logging.WARNING),
        (DeadlineExceeded("x"), logging.WARNING),
        (Relayed(502, "x"), logging.WARNING),
    ],
)
def test_one_log_level_rule(error: ServiceError, level: int) -> None:
    assert log_level(error) == level


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        ("plain 'é' text", "plain 'é' text"),
        ("two\nlines", "two\\nlines"),
        ("escape \x1b[2J", "escape \\x1b[2J"),
        ("lone \ud800", "lone \\ud800"),
    ],
)
def test_messages_are_shown_escaped(message: str, shown: str) -> None:
    assert shown_message(InvalidInput(message)) == shown


def test_messages_are_bounded() -> None:
    shown = shown_message(InvalidInput("n" * 100_000))
    assert shown == "n" * MAX_MESSAGE_CHARS + "..."


def parse_http(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """A response as a real HTTP/1.1 parser reads it."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
    conn.receive_data(raw)
    head = conn.next_event()
    assert isinstance(head, h11.Response)
    data = conn.next_event()
    assert isinstance(data, h11.Data)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    headers = {k.decode(): v.decode() for k, v in head.headers}
    return head.status_code, headers, bytes(data.data)


@pytest.mark.anyio
@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
async def test_every_rest_layer_writes_the_same_answer(error: ServiceError) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await send_error(send, error, "rid-1", close=True)
    start, body = sent
    asgi_headers = {k.decode(): v.decode() for k, v in start["headers"]}
    raw_status, raw_headers, raw_body = parse_http(error_bytes(error))
    response = error_response(error)
    handler_headers = {k.decode(): v.decode() for k, v in response.raw_headers}
    assert start["status"] == raw_status == response.status_code == error.status_code
    assert body["body"] == raw_body == response.body
    assert json.loads(raw_body) == {"error": shown_message(error)}
    assert raw_body.isascii()
    assert asgi_headers.pop("x-request-id") == "rid-1"
    assert asgi_headers == raw_headers  # both close the connection
    assert raw_headers["connection"] == "close"
    assert {k: v for k, v in handler_headers.items() if k != "connection"} == {
        k: v for k, v in raw_headers.items() if k != "connection"
    }
    assert raw_headers["content-type"] == "application/json"
    for name, value in error.headers.items():  # Retry-After, WWW-Authenticate, ...
        assert raw_headers[name.lower()] == value


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_grpc_shows_and_logs_what_rest_does(
    error: ServiceError, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        code, details, trailers = Rpcs.status(error, "ModelInfer")
        report(logging.getLogger("service.rest.app"), "POST /v2", error)
    status, _, body = error_parts(error)
    assert details == json.loads(body)["error"]
    grpc_record, rest_record = caplog.records
    assert grpc_record.levelno == rest_record.levelno == log_level(error)
    assert grpc_record.getMessage() == f"gRPC ModelInfer -> {status}: {details}"
    assert rest_record.getMessage() == f"POST /v2 -> {status}: {details}"
    expected_code = {400: grpc.StatusCode.INVALID_ARGUMENT, 503: grpc.StatusCode.UNAVAILABLE}
    if status in expected_code:
        assert code == expected_code[status]
    if isinstance(error, Overloaded):
        assert trailers == (("retry-after", "2"),)


def test_a_control_character_in_a_message_is_escaped_everywhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    error = InvalidInput("name 'a\nFORGED LOG LINE'")
    with caplog.at_level(logging.INFO):
        _, details, _ = Rpcs.status(error, "RepositoryModelLoad")
    assert "\n" not in details
    assert "\n" not in caplog.records[0].getMessage()
    _, _, body = error_parts(error)
    assert json.loads(body)["error"] == details == "name 'a\\nFORGED LOG LINE'"
