"""A tiny in-memory repository for transport tests of the app (not for end-to-end tests).

It implements the repository contract (``service.endpoints.Repository``) with trivial models
so the HTTP layer can be tested on its own: framing, errors, auth, limits, compression.

* ``echo``: input ``x`` UINT8 ``[-1, 4]``; outputs ``y`` FP32 = 2·x and ``n`` INT64 = row sums.
* ``boom``: same input, its compute raises an unexpected exception (the app must answer 500).
* ``busy``: same input, its queue is always full (503 with Retry-After).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.errors import InvalidInput, ModelNotFound, ModelNotReady, Overloaded
from service.protocol.types import InferRequest, InferResponse, ResponseOutput


class FakeHandle:
    """One fake model version."""

    def __init__(self, name: str, version: str = "1") -> None:
        self.name = name
        self.version = version
        self.requests: list[InferRequest] = []
        self.checked: list[tuple[str, str, tuple[int, ...]]] = []

    def is_ready(self) -> bool:
        return True

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": "bitserve",
            "inputs": [{"name": "x", "datatype": "UINT8", "shape": [-1, 4]}],
            "outputs": [
                {"name": "y", "datatype": "FP32", "shape": [-1, 4]},
                {"name": "n", "datatype": "INT64", "shape": [-1]},
            ],
        }

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "platform": "bitserve", "max_batch_size": 8}

    def check_input(self, name: str, datatype: str, shape: tuple[int, ...]) -> int:
        """The decoder's early check: only the datatype (names are checked by ``infer``)."""
        self.checked.append((name, datatype, shape))
        if datatype != "UINT8":
            raise InvalidInput(f"model {self.name!r}: input {name!r} must be UINT8, not {datatype}")
        return shape[0] if shape else 1

    async def infer(self, request: InferRequest) -> InferResponse:
        self.requests.append(request)
        if self.name == "boom":
            raise RuntimeError("secret internal detail")
        if self.name == "busy":
            raise Overloaded(f"model {self.name!r} queue is full", retry_after=2)
        by_name = {i.name: i for i in request.inputs}
        if set(by_name) != {"x"}:
            raise InvalidInput(f"model {self.name!r} takes exactly the input 'x'")
        x = by_name["x"].data.astype(np.float64)
        outs = {
            "y": ResponseOutput("y", "FP32", x.shape, (2 * x).astype(np.float32)),
            "n": ResponseOutput("n", "INT64", x.shape[:1], x.sum(axis=1).astype(np.int64)),
        }
        names = [o.name for o in request.outputs] if request.outputs else list(outs)
        for n in names:
            if n not in outs:
                raise InvalidInput(f"model {self.name!r} has no output {n!r}")
        return InferResponse(
            self.name,
            self.version,
            request.id,
            [outs[n] for n in names],
            parameters={"batch_size": x.shape[0], "batch_requests": 1},
        )


class FakeRepository:
    """Models ``echo``, ``boom`` and ``busy``; ``ready`` can be switched off by a test."""

    def __init__(self) -> None:
        self.models = {n: FakeHandle(n) for n in ("echo", "boom", "busy")}
        self.started = False
        self.stopped = False
        self.is_ready = True
        self.loaded: list[str] = []
        self.unloaded: list[str] = []

    @property
    def ready(self) -> bool:
        return self.started and self.is_ready

    async def start(self) -> None:
        self.started = True

    async def stop(self, timeout_s: float = 30.0) -> None:
        self.stopped = True

    def index(self) -> list[dict[str, Any]]:
        return [
            {"name": n, "version": "1", "state": "READY" if n != "busy" else "UNAVAILABLE"}
            for n in self.models
        ]

    async def load(self, name: str) -> None:
        if name not in self.models:
            raise ModelNotFound(f"no model {name!r} in the repository")
        self.loaded.append(name)

    async def unload(self, name: str) -> None:
        if name not in self.models:
            raise ModelNotFound(f"no model {name!r} in the repository")
        self.unloaded.append(name)

    def get(self, name: str, version: str | None = None) -> FakeHandle:
        if name not in self.models:
            raise ModelNotFound(f"no model {name!r} in the repository")
        if version not in (None, "1"):
            raise ModelNotFound(f"model {name!r} has no version {version!r}")
        if not self.is_ready:
            raise ModelNotReady(f"model {name!r} is not ready")
        return self.models[name]
