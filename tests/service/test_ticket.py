"""The data plane's core (``service.ticket``): every transport's steps, decided once.

Driven directly (as the express lane and gRPC drive it) over the fake repository: admission
counts a refused request, a reload between the decode and the submit moves the request to the
version serving now (and asks for a decode again when what the model accepts changed), a
submitted request is answered through its callback, and a cancelled one is dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from harness.probes import metric
from service.dataplane import DataPlane
from service.errors import ModelNotFound, Overloaded
from service.models.config import ModelConfig
from service.observability.metrics import Metrics
from service.protocol.types import InferRequest, InferResponse, RequestInput
from tests.service.app_fakes import ECHO_CONFIG, FakeHandle, FakeRepository

pytestmark = pytest.mark.anyio


def _request(rows: np.ndarray[Any, Any]) -> InferRequest:
    return InferRequest(id="t", inputs=[RequestInput("x", "UINT8", rows.shape, rows)])


def _plane() -> tuple[DataPlane, FakeRepository, Metrics]:
    metrics = Metrics()
    repo = FakeRepository()
    return DataPlane(repo, metrics), repo, metrics  # type: ignore[arg-type]


async def _submitted(ticket: Any, request: InferRequest) -> InferResponse | BaseException:
    answered: asyncio.Future[InferResponse | BaseException] = asyncio.Future()
    ticket.submit(request, answered.set_result)
    return await asyncio.wait_for(answered, 5)


async def test_a_refused_admission_is_counted_once() -> None:
    plane, _, metrics = _plane()
    with pytest.raises(ModelNotFound):
        plane.admit("nope", None)
    with pytest.raises(Overloaded):
        plane.admit("busy", None)
    text = metrics.render().decode()
    assert (
        metric(text, "bitserve_requests_total", 0.0, model="_unknown", outcome="ModelNotFound") == 1
    )
    assert metric(text, "bitserve_requests_total", 0.0, model="busy", outcome="Overloaded") == 1


async def test_a_reload_after_the_decode_moves_the_request_to_the_new_version() -> None:
    plane, repo, _ = _plane()
    rng = np.random.default_rng()
    rows = rng.integers(0, 256, (3, 4), dtype=np.uint8)
    ticket = plane.admit("echo", None)
    old = ticket.handle
    request = _request(rows)  # decoded for the old version
    repo.models["echo"] = new = FakeHandle("echo")  # the same inputs: no decode again
    assert ticket.settle() is None
    assert ticket.resident
    assert ticket.handle is new
    response = await _submitted(ticket, request)
    ticket.finish()
    assert isinstance(response, InferResponse)
    np.testing.assert_array_equal(response.outputs[1].data, rows.astype(np.int64).sum(axis=1))
    assert len(new.requests) == 1
    assert old.requests == []  # type: ignore[attr-defined]
    # A reload that changed what the model accepts: the request is decoded again for it.
    ticket = plane.admit("echo", None)
    wider = ModelConfig.model_validate(
        {**ECHO_CONFIG.model_dump(), "inputs": [{"name": "x", "datatype": "UINT8", "shape": [8]}]}
    )
    repo.models["echo"] = newer = FakeHandle("echo", "2", cfg=wider)
    assert ticket.settle() is newer
    assert ticket.settle() is None  # once decoded again for it, nothing more to do
    ticket.finish("Cancelled", 499)


async def test_a_cancelled_ticket_is_dropped_and_counted() -> None:
    plane, _, metrics = _plane()
    ticket = plane.admit("echo", None)
    ticket.cancel()  # the client went away before its request was submitted
    ticket.cancel()  # once only
    text = metrics.render().decode()
    labels = {"model": "echo", "version": "1"}
    assert metric(text, "bitserve_requests_cancelled_total", 0.0, **labels) == 1
    assert metric(text, "bitserve_requests_total", 0.0, model="echo", outcome="Cancelled") == 1
