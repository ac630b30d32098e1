"""The hand-written baseline: a FastAPI V2 endpoint for the tiny model, as a user writes it.

One infer route: ``await request.body()``, the binary V2 request (a JSON header, then the
tensor: Triton's binary extension, which perf_analyzer sends) answered by
:func:`~benchmarks.overhead.tiny.infer_binary` (header parsed, maths in NumPy, answer framed:
the same function the raw ASGI floor calls, so the two differ only by the framework), and a
``Response`` carrying the binary V2 answer. The metadata and config routes are there because
perf_analyzer reads them first. No validation beyond what the maths needs, no batching, no
metrics, no auth: the least a working V2 endpoint is.

Run: ``python -m benchmarks.overhead.fastapi_v2 --port PORT`` (binds 127.0.0.1).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response

from benchmarks.overhead.tiny import CONFIG, METADATA, NAME, SERVER, infer_binary


def create_app() -> FastAPI:
    """The baseline app."""
    app = FastAPI(title="tiny V2 baseline")

    @app.get("/v2/health/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    @app.get("/v2")
    async def server() -> dict[str, Any]:
        return SERVER

    @app.get(f"/v2/models/{NAME}")
    async def metadata() -> dict[str, Any]:
        return METADATA

    @app.get(f"/v2/models/{NAME}/config")
    async def config() -> dict[str, Any]:
        return CONFIG

    @app.post(f"/v2/models/{NAME}/infer")
    async def infer(request: Request) -> Response:
        body = await request.body()
        n = int(request.headers.get("inference-header-content-length", len(body)))
        head, out = infer_binary(body, n)
        return Response(
            head + out,
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(len(head))},
        )

    return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
