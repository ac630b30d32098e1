"""The hand-written baseline: what a competent user writes in an afternoon.

A FastAPI endpoint that takes the raw ``np.packbits`` bytes of one or more items as the body,
unpacks them with NumPy, runs the shared torch code and answers raw float32 bytes. No
protocol, no batching across requests, no validation beyond the byte count.

Run: ``python -m benchmarks.e2e.peers.baseline_app --port PORT`` (binds 127.0.0.1).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
import torch
import uvicorn
from fastapi import FastAPI, HTTPException, Request, Response
from starlette.concurrency import run_in_threadpool

from harness.workload import MODEL_NAME, N_FINE, N_FUNCTIONS, PACKED_LEN, TorchWorkload


def create_app() -> FastAPI:
    """The baseline app: ``POST /predict`` (packed bytes in, float32 bytes out)."""
    app = FastAPI(title=f"{MODEL_NAME} baseline")
    workload = TorchWorkload("cpu")
    item_bytes = N_FUNCTIONS * PACKED_LEN

    def compute(body: bytes) -> bytes:
        packed = np.frombuffer(body, dtype=np.uint8).reshape(-1, N_FUNCTIONS, PACKED_LEN)
        bits = np.unpackbits(packed, axis=-1, count=N_FINE)
        return workload(torch.from_numpy(bits)).numpy().tobytes()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/predict")
    async def predict(request: Request) -> Response:
        body = await request.body()
        if not body or len(body) % item_bytes:
            raise HTTPException(400, f"body must be a multiple of {item_bytes} bytes")
        # torch releases the GIL; running it off the loop keeps the server answering.
        out = await run_in_threadpool(compute, body)
        return Response(out, media_type="application/octet-stream")

    return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvicorn.run(create_app(), host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
