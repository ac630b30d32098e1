"""Binary V2 request headers decoded once per model version, not once per request.

A client sends the same JSON header again and again: the same inputs, shapes, datatypes and
requested outputs, with only the binary data after it changing (perf_analyzer, tritonclient
and ``bitserve_client`` batches of one size all do). :class:`HeaderCache` keeps what the full
decoder (:func:`~service.protocol.request.decode_infer_request`) made of such a header,
checks included, keyed by the header's bytes; a request whose header was seen before costs a
dictionary lookup and one ``np.frombuffer`` view per input.

Only what depends on the header alone is reused. A header is kept when every input's data is
binary (``binary_data_size``), of a fixed-size datatype, and nothing names shared memory; the
data themselves are viewed afresh each time (and BOOL bytes checked each time), and a body
whose data part is not the size the header declares goes to the full decoder, which answers
the error. The cache belongs to one model version (its signature's checks are part of what
is kept) and holds at most ``capacity`` headers of at most ``max_header_bytes`` each (the
oldest goes first).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from service.protocol.request import InputChecker, decode_infer_request
from service.protocol.shared import SharedMemoryRegions
from service.protocol.tensors import from_binary
from service.protocol.types import BYTES, InferRequest, RequestForm, RequestInput, RequestOutput


@dataclass(frozen=True)
class _Input:
    name: str
    datatype: str
    shape: tuple[int, ...]
    parameters: dict[str, Any]
    start: int
    """Where its bytes start in the data part."""
    nbytes: int


@dataclass(frozen=True)
class _Plan:
    """What a header decoded to, less its inputs' data (a plan holds no request's bytes). Its
    parameter dicts are shared by every request decoded from the same header (the data plane
    only reads them)."""

    inputs: tuple[_Input, ...]
    id: str | None
    outputs: list[RequestOutput] | None
    parameters: dict[str, Any]
    binary_data_output: bool
    timeout_us: int | None
    data_bytes: int
    form: RequestForm = field(default_factory=RequestForm, compare=False)
    """Given to each request built: they differ in their inputs' data alone."""

    def build(self, data: memoryview) -> InferRequest:
        inputs = [
            RequestInput(
                i.name,
                i.datatype,
                i.shape,
                from_binary(
                    data[i.start : i.start + i.nbytes], i.datatype, i.shape, f"input {i.name!r}"
                ),
                i.parameters,
            )
            for i in self.inputs
        ]
        return InferRequest(
            id=self.id,
            inputs=inputs,
            outputs=self.outputs,
            parameters=self.parameters,
            binary_data_output=self.binary_data_output,
            timeout_us=self.timeout_us,
            form=self.form,
        )


def _plan(request: InferRequest, data_bytes: int) -> _Plan | None:
    """A plan for the header ``request`` came from, or None when it cannot be reused."""
    inputs = []
    offset = 0
    for inp in request.inputs:
        size = inp.parameters.get("binary_data_size")
        if inp.datatype == BYTES or size is None or "shared_memory_region" in inp.parameters:
            return None
        inputs.append(_Input(inp.name, inp.datatype, inp.shape, inp.parameters, offset, size))
        offset += size
    outputs: list[RequestOutput] = request.outputs or []
    if any(o.shared_memory is not None for o in outputs) or offset != data_bytes:
        return None
    return _Plan(
        tuple(inputs),
        request.id,
        request.outputs,
        request.parameters,
        request.binary_data_output,
        request.timeout_us,
        data_bytes,
    )


class HeaderCache:
    """One model version's decoded request headers (see the module docstring).

    Args:
        capacity: the most headers kept.
        max_header_bytes: longer headers are decoded each time and not kept.
    """

    def __init__(self, capacity: int = 256, max_header_bytes: int = 4096) -> None:
        self.capacity = capacity
        self.max_header_bytes = max_header_bytes
        self._plans: OrderedDict[bytes, _Plan] = OrderedDict()
        self.hits = 0

    def decode(
        self,
        body: bytes | bytearray | memoryview,
        header_length: int | None,
        model: InputChecker,
        shm: SharedMemoryRegions | None,
    ) -> InferRequest:
        """What :func:`~service.protocol.request.decode_infer_request` returns for these
        arguments (``model`` must be this cache's model version), from a kept header when it
        can be."""
        if not header_length or header_length > self.max_header_bytes:
            return decode_infer_request(body, header_length, model, shm)
        view = memoryview(body)
        key = bytes(view[:header_length])
        plan = self._plans.get(key)
        data = view[header_length:]
        if plan is not None and plan.data_bytes == data.nbytes:
            self.hits += 1
            return plan.build(data)
        request = decode_infer_request(view, header_length, model, shm)
        if plan is None:
            plan = _plan(request, data.nbytes)
            if plan is not None:
                if len(self._plans) >= self.capacity:
                    # Decodes off the loop may race here: the GIL keeps each step whole.
                    with contextlib.suppress(KeyError):
                        self._plans.popitem(last=False)
                self._plans[key] = plan
        return request
