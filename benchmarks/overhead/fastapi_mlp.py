"""The hand-written baseline for the MLP: a FastAPI endpoint that takes rows as raw float32.

``POST /predict`` with the body ``rows x 2048`` float32 bytes, as a user writes it without a
serving framework: ``torch.frombuffer`` on ``await request.body()``, the same ``torch.export``
program as bitserve's repository (:mod:`benchmarks.overhead.mlp`), under
``torch.inference_mode``, and the scores back as float32 bytes. Torch keeps its default
threads; nothing is batched across requests.

Run: ``python -m benchmarks.overhead.fastapi_mlp --port PORT --program model.pt2``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response

from benchmarks.overhead.mlp import BITS


def create_app(program: str) -> FastAPI:
    import torch

    model: Any = torch.export.load(program).module()
    app = FastAPI(title="MLP baseline")

    @app.get("/v2/health/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    @app.post("/predict")
    async def predict(request: Request) -> Response:
        body = await request.body()
        rows = torch.frombuffer(bytearray(body), dtype=torch.float32).view(-1, BITS)
        with torch.inference_mode():
            scores = model(rows)
        return Response(scores.numpy().tobytes(), media_type="application/octet-stream")

    return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--program", required=True)
    args = p.parse_args(argv)
    uvicorn.run(
        create_app(args.program), host="127.0.0.1", port=args.port, http="httptools",
        loop="uvloop", log_level="warning", access_log=False,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
