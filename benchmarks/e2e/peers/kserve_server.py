"""KServe's Python ``ModelServer`` serving the workload (V2 REST, binary extension and JSON).

Runs inside the KServe venv (``benchmarks/e2e/.venvs/kserve``) with the repository root on
``PYTHONPATH``: ``python -m benchmarks.e2e.peers.kserve_server --port PORT``. KServe's REST
server hard-codes ``host="0.0.0.0"`` in its ``uvicorn.Config``; this script binds it to
127.0.0.1 by replacing ``uvicorn.Config`` in this process with a subclass that forces the host.
gRPC is off.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    # kserve parses sys.argv when imported; give it nothing of ours to trip over.
    sys.argv = sys.argv[:1]

    import torch
    import uvicorn
    from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer  # type: ignore[import-not-found]

    from harness.workload import MODEL_NAME, OUTPUT_NAME, TorchWorkload

    class LoopbackConfig(uvicorn.Config):
        def __init__(self, *a: Any, **kw: Any) -> None:
            kw["host"] = "127.0.0.1"
            super().__init__(*a, **kw)

    uvicorn.Config = LoopbackConfig  # type: ignore[misc]

    class Resample(Model):  # type: ignore[misc]
        """The workload as a KServe model: BOOL (M, N, B) in, FP32 (M, N, A) out."""

        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.load()

        def load(self) -> bool:
            self.workload = TorchWorkload("cpu")
            self.ready = True
            return True

        async def predict(
            self,
            payload: InferRequest,
            headers: dict[str, str] | None = None,
            response_headers: dict[str, str] | None = None,
        ) -> InferResponse:
            bits = payload.inputs[0].as_numpy()
            out = self.workload(torch.from_numpy(bits)).numpy()
            output = InferOutput(name=OUTPUT_NAME, shape=list(out.shape), datatype="FP32")
            output.set_data_from_numpy(out, binary_data=False)
            return InferResponse(
                response_id=payload.id or "",
                model_name=self.name,
                infer_outputs=[output],
                use_binary_outputs=payload.use_binary_outputs,
                requested_outputs=payload.request_outputs,
            )

    ModelServer(http_port=args.port, enable_grpc=False, workers=1).start([Resample(MODEL_NAME)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
