"""The floor: a raw ASGI app on uvicorn + httptools + uvloop doing the same V2 framing.

No framework at all: the path is compared as a string, the body gathered from ``receive``,
the answer written with two ``send`` calls. Nothing a real server can skip is skipped (the
JSON header is parsed, the answer framed: :func:`~benchmarks.overhead.tiny.infer_binary`, as
in the FastAPI baseline), and nothing else is done. What bitserve costs above this is the
price of its guarantees.

Run: ``python -m benchmarks.overhead.asgi_v2 --port PORT`` (binds 127.0.0.1).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import uvicorn

from benchmarks.overhead.tiny import CONFIG, METADATA, NAME, SERVER, infer_binary

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_GETS = {
    "/v2/health/ready": json.dumps({"ready": True}).encode(),
    "/v2": json.dumps(SERVER).encode(),
    f"/v2/models/{NAME}": json.dumps(METADATA).encode(),
    f"/v2/models/{NAME}/config": json.dumps(CONFIG).encode(),
}
_INFER = f"/v2/models/{NAME}/infer"


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The whole server."""
    if scope["type"] != "http":  # lifespan: nothing to set up
        message = await receive()
        while message["type"] != "lifespan.shutdown":
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            message = await receive()
        await send({"type": "lifespan.shutdown.complete"})
        return
    path = scope["path"]
    if scope["method"] == "GET" and path in _GETS:
        await _answer(send, 200, _GETS[path], _JSON)
        return
    if scope["method"] != "POST" or path != _INFER:
        await _answer(send, 404, b'{"error":"not found"}', _JSON)
        return
    chunks = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    n = len(body)
    for k, v in scope["headers"]:
        if k == b"inference-header-content-length":
            n = int(v)
    head, out = infer_binary(body, n)
    headers = [
        (b"content-type", b"application/octet-stream"),
        (b"inference-header-content-length", str(len(head)).encode()),
    ]
    await _answer(send, 200, head + out, headers)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvicorn.run(
        app, host="127.0.0.1", port=args.port, http="httptools", loop="uvloop",
        log_level="warning", access_log=False, lifespan="on",
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
