"""One loaded model version: its V2 metadata, Triton-style config, and ``infer``.

``ModelHandle.infer`` validates a request against the model's config before it queues (so a
bad request never reaches the batcher), joins the model's dynamic batcher, and builds the
response from the per-request result views.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.batcher import Batcher
from service.config import ModelConfig
from service.errors import InvalidInput, ModelNotReady
from service.pipeline import Pipeline, WireInput
from service.protocol.types import DATATYPES, InferRequest, InferResponse, ResponseOutput

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
Result = list[np.ndarray[Any, Any]]


class ModelHandle:
    """One loaded model version: metadata, config and ``infer``."""

    def __init__(
        self,
        name: str,
        version: str,
        cfg: ModelConfig,
        pipeline: Pipeline,
        batcher: Batcher[WireInput, Result],
        versions: list[str],
    ) -> None:
        self.name = name
        self.version = version
        self.cfg = cfg
        self.pipeline = pipeline
        self.batcher = batcher
        self.versions = versions
        self.state = READY

    def is_ready(self) -> bool:
        """Whether the model accepts requests."""
        return self.state == READY

    # --- description ----------------------------------------------------------------------

    def _batch_dims(self) -> list[int]:
        return [-1] if self.cfg.max_batch_size > 0 else []

    def _input_wire(self) -> tuple[str, list[int], dict[str, Any]]:
        spec = self.cfg.inputs[0]
        if spec.packing == "bits":
            params = {
                "packing": "bits",
                "bitorder": spec.bitorder,
                "logical_shape": list(spec.shape),
                "logical_datatype": spec.datatype,
            }
            return "UINT8", spec.packed_shape, params
        return spec.datatype, list(spec.shape), {}

    def metadata(self) -> dict[str, Any]:
        """V2 model metadata; a packed input is advertised in its wire form (UINT8)."""
        datatype, dims, params = self._input_wire()
        inp: dict[str, Any] = {
            "name": self.cfg.inputs[0].name,
            "datatype": datatype,
            "shape": self._batch_dims() + dims,
        }
        if params:
            inp["parameters"] = params
        outputs = [
            {"name": o.name, "datatype": o.datatype, "shape": self._batch_dims() + shape}
            for o, shape in zip(self.cfg.outputs, self.pipeline.output_shapes, strict=True)
        ]
        return {
            "name": self.name,
            "versions": list(self.versions),
            "platform": "bitserve",
            "inputs": [inp],
            "outputs": outputs,
            "parameters": {
                "device": str(self.pipeline.device),
                "device_memory_bytes": self.pipeline.device_memory_bytes,
            },
        }

    def config(self) -> dict[str, Any]:
        """Triton-style model configuration (``GET .../config``)."""
        datatype, dims, params = self._input_wire()
        inp: dict[str, Any] = {
            "name": self.cfg.inputs[0].name,
            "data_type": f"TYPE_{datatype}",
            "dims": dims,
        }
        if params:
            inp["parameters"] = params
        cfg: dict[str, Any] = {
            "name": self.name,
            "platform": "bitserve",
            "backend": "bitserve",
            "max_batch_size": self.cfg.max_batch_size,
            "input": [inp],
            "output": [
                {"name": o.name, "data_type": f"TYPE_{o.datatype}", "dims": shape}
                for o, shape in zip(self.cfg.outputs, self.pipeline.output_shapes, strict=True)
            ],
            "instance_group": [
                {"kind": "KIND_GPU" if self.pipeline.device.type == "cuda" else "KIND_CPU",
                 "count": 1}
            ],
        }  # fmt: skip
        if self.cfg.max_batch_size > 0:
            cfg["dynamic_batching"] = {
                "max_queue_delay_microseconds": self.cfg.max_queue_delay_us,
                "preferred_batch_size": [self.cfg.max_batch_size],
                "default_queue_policy": {"max_queue_size": self.cfg.max_queue_size},
            }
        return cfg

    # --- inference ------------------------------------------------------------------------

    def check_input(self, name: str, datatype: str, shape: tuple[int, ...]) -> int:
        """Check one input's name, datatype and shape against the config (no data needed).

        The decoder calls this before it converts an input's data, so a request the model
        refuses (a BYTES tensor, a wrong shape) costs no element parsing.

        Args:
            name: the input's name.
            datatype: its V2 datatype as sent.
            shape: its declared shape.

        Returns:
            the request's batch size (1 for a model without a batch dimension).

        Raises:
            InvalidInput: naming what is wrong.
        """
        spec = self.cfg.inputs[0]
        m = f"model '{self.name}'"
        if name != spec.name:
            raise InvalidInput(f"{m}: unknown input '{name}' (expected inputs: ['{spec.name}'])")
        packed_dims = spec.packed_shape
        if spec.packing == "bits":
            accepted = {"UINT8": packed_dims, "BOOL": list(spec.shape)}
        else:
            accepted = {spec.datatype: list(spec.shape)}
        if datatype not in accepted:
            forms = " or ".join(f"{d} {self._batch_dims() + s}" for d, s in accepted.items())
            raise InvalidInput(
                f"{m}: input '{name}' has datatype {datatype}; expected {forms}"
                + (" (UINT8: bits packed along the last axis)" if spec.packing == "bits" else "")
            )
        dims = accepted[datatype]
        dims_shape = list(shape)
        if self.cfg.max_batch_size > 0:
            if dims_shape[1:] != dims or not dims_shape or dims_shape[0] < 1:
                raise InvalidInput(
                    f"{m}: input '{name}' has shape {dims_shape}; expected [batch, "
                    f"{', '.join(map(str, dims))}] for {datatype}"
                )
            size = dims_shape[0]
            if size > self.cfg.max_batch_size:
                raise InvalidInput(
                    f"{m}: input '{name}' has batch size {size}, more than the model's "
                    f"max_batch_size {self.cfg.max_batch_size}"
                )
            return size
        if dims_shape != dims:
            raise InvalidInput(
                f"{m}: input '{name}' has shape {dims_shape}; expected {dims} for {datatype} "
                "(this model has max_batch_size 0: no batch dimension)"
            )
        return 1

    def _validate(self, request: InferRequest) -> tuple[WireInput, list[int]]:
        """Check a request against the config; returns the staged input and output indices.

        Raises:
            InvalidInput: naming the input or output that is wrong.
        """
        spec = self.cfg.inputs[0]
        m = f"model '{self.name}'"
        names = [t.name for t in request.inputs]
        for n in names:
            if names.count(n) > 1:
                raise InvalidInput(f"{m}: input '{n}' is given more than once")
            if n != spec.name:
                raise InvalidInput(f"{m}: unknown input '{n}' (expected inputs: ['{spec.name}'])")
        if not names:
            raise InvalidInput(f"{m}: missing input '{spec.name}'")
        t = request.inputs[0]
        size = self.check_input(t.name, t.datatype, t.shape)
        shape = list(t.shape)
        dims = shape[1:] if self.cfg.max_batch_size > 0 else shape
        wire_dtype = DATATYPES[t.datatype]
        data = np.asarray(t.data)
        if data.shape != tuple(shape):
            raise InvalidInput(f"{m}: input '{t.name}' data does not have its shape {shape}")
        data = np.ascontiguousarray(data, dtype=wire_dtype).reshape(size, *dims)
        wire = WireInput(data, packed=spec.packing == "bits" and t.datatype == "UINT8", size=size)

        out_names = [o.name for o in self.cfg.outputs]
        if request.outputs is None:
            return wire, list(range(len(out_names)))
        wanted = [o.name for o in request.outputs]
        indices = []
        for n in wanted:
            if wanted.count(n) > 1:
                raise InvalidInput(f"{m}: output '{n}' is requested more than once")
            if n not in out_names:
                raise InvalidInput(f"{m}: unknown output '{n}' (outputs: {out_names})")
            indices.append(out_names.index(n))
        return wire, indices

    async def infer(self, request: InferRequest) -> InferResponse:
        """Validate, queue, compute and answer one request.

        Raises:
            InvalidInput: the request does not match the model (never queued).
            Overloaded: the queue is full. DeadlineExceeded: the timeout expired first.
            ModelNotReady: the model is unloading. ServiceError: the batch failed.
        """
        if not self.is_ready():
            raise ModelNotReady(f"model '{self.name}' version {self.version} is not ready")
        wire, indices = self._validate(request)
        arrays, info = await self.batcher.submit(wire, wire.size, timeout_us=request.timeout_us)
        outs = [
            ResponseOutput(
                name=self.cfg.outputs[i].name,
                datatype=self.cfg.outputs[i].datatype,
                shape=tuple(arrays[i].shape),
                data=arrays[i],
            )
            for i in indices
        ]
        return InferResponse(
            model_name=self.name,
            model_version=self.version,
            id=request.id,
            outputs=outs,
            parameters={"batch_size": info.batch_size, "batch_requests": info.batch_requests},
        )
