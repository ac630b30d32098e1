"""Tensors in a client's system shared memory (Triton's extension), as every transport's
decoder finds them: an input's data read from the region its parameters name, an output's
place in one. The regions themselves are ``service.shared_memory``'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from service.errors import InvalidInput
from service.protocol.tensors import from_binary
from service.protocol.types import SharedOutput


class SharedMemoryRegions(Protocol):
    """What the decoder asks of the registered shared memory regions
    (``service.shared_memory.SystemSharedMemory``)."""

    def read(self, region: object, offset: object, byte_size: object, what: str) -> memoryview:
        """A copy of ``byte_size`` bytes at ``offset`` of ``region``, bounds checked;
        InvalidInput naming the region otherwise."""
        ...

    def output(self, region: object, offset: object, byte_size: object, what: str) -> SharedOutput:
        """Where an output of ``byte_size`` bytes at ``offset`` of ``region`` goes, bounds
        checked; InvalidInput naming the region otherwise."""
        ...


def shared_input(
    params: Mapping[str, Any],
    datatype: str,
    shape: tuple[int, ...],
    what: str,
    shm: SharedMemoryRegions | None,
) -> np.ndarray[Any, Any] | None:
    """An input's data from the shared memory region its parameters name (a copy, its size
    checked against the shape before it is read), or None when they name none (every
    transport's decoder asks this before it looks for the data elsewhere).

    Raises:
        InvalidInput: an unknown region, a range outside it, client shared memory disabled,
            a size that does not fit the shape, or an object that shrank.
    """
    region = _shared_region(params, what, shm)
    if region is None:
        return None
    assert shm is not None
    data = shm.read(*_shared_place(params), what)  # at most the region's registered size
    size_of = f"shared_memory_byte_size of region '{region}'"
    return from_binary(data, datatype, shape, what, size_of)


def shared_output(
    params: Mapping[str, Any], what: str, shm: SharedMemoryRegions | None
) -> SharedOutput | None:
    """Where an output goes in the shared memory region its parameters name (bounds checked),
    or None when they name none.

    Raises:
        InvalidInput: an unknown region, a range outside it, or client shared memory disabled.
    """
    if _shared_region(params, what, shm) is None:
        return None
    assert shm is not None
    return shm.output(*_shared_place(params), what)


def _shared_region(
    params: Mapping[str, Any], what: str, shm: SharedMemoryRegions | None
) -> object | None:
    """The shared memory region a tensor names in its parameters, or None when it names
    none."""
    region: object = params.get("shared_memory_region")
    if region is None:
        for key in ("shared_memory_byte_size", "shared_memory_offset"):
            if key in params:
                raise InvalidInput(f"{what}: parameter {key!r} without 'shared_memory_region'")
        return None
    if shm is None:
        raise InvalidInput(
            f"{what}: names shared memory region {str(region)[:64]!r}, but client shared "
            "memory is disabled on this server (bitserve serve --allow-client-shm)"
        )
    return region


def _shared_place(params: Mapping[str, Any]) -> tuple[object, object, object]:
    """A tensor's region, offset and byte size, as its parameters give them."""
    return (
        params.get("shared_memory_region"),
        params.get("shared_memory_offset"),
        params.get("shared_memory_byte_size"),
    )
