"""MLServer serving the workload: a custom ``MLModel`` runtime (V2 JSON; no binary extension).

Imported by ``mlserver start DIR`` inside the MLServer venv (``benchmarks/e2e/.venvs/mlserver``)
with the repository root on ``PYTHONPATH``; the settings it runs with are written by
:func:`benchmarks.e2e.servers.write_mlserver_settings`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch
from mlserver import MLModel  # type: ignore[import-not-found]
from mlserver.codecs import NumpyCodec  # type: ignore[import-not-found]
from mlserver.types import InferenceRequest, InferenceResponse  # type: ignore[import-not-found]

from harness.workload import OUTPUT_NAME, TorchWorkload


class ResampleRuntime(MLModel):  # type: ignore[misc]
    """The workload as an MLServer runtime: BOOL (M, N, B) in, FP32 (M, N, A) out."""

    async def load(self) -> bool:
        self.workload = TorchWorkload("cpu")
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        bits = np.asarray(NumpyCodec.decode_input(payload.inputs[0]))
        # Off the event loop, as the baseline and bitserve do (torch releases the GIL).
        out = await asyncio.to_thread(self._compute, bits)
        return InferenceResponse(
            model_name=self.name,
            id=payload.id,
            outputs=[NumpyCodec.encode_output(OUTPUT_NAME, out)],
        )

    def _compute(self, bits: Any) -> Any:
        return self.workload(torch.from_numpy(bits)).numpy()
