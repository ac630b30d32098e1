"""The response cache (``--cache-config local,size=BYTES``; ``[response_cache] enable = true``).

As Triton's local cache: a request equal to one answered before, in everything that changes
the answer, is answered with the stored outputs and never reaches its model. Unlike Triton's
key (model, version, input names and bytes: ``cache_manager.cc``), ours also holds what makes
equal bytes mean something else (:func:`cache_key`):

- the model and version;
- every input as the model receives it (``service.signature.Bound``, config order): its
  name, wire datatype, shape, whether it is bit-packed, its bit order, and its bytes (the
  packed bytes of a packed input: 8x fewer to hash);
- the request's parameters and each input's and output's, except those that change only
  how the answer travels or when (:data:`IGNORED_PARAMETERS`: ``priority``, ``timeout``, the
  binary or JSON form, shared memory placement); so a new parameter (an index's ``k`` or
  ``threshold``) is in the key without a change here;
- the outputs asked for.

All of it goes through one 128-bit BLAKE2b (``hashlib``). The cache keeps each answer's
output arrays (copies) and its batch's :class:`~service.batch_queue.BatchInfo`; a hit is
framed as any answer, with the new request's id. Entries are evicted least recently used
first to stay within the size, and a version's entries are dropped when it is reloaded,
unloaded or evicted from its device. Each ``--workers`` process has its own cache of this
size.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from service.batch_queue import BatchInfo

if TYPE_CHECKING:
    from service.handle import ModelHandle
    from service.protocol.types import InferRequest
    from service.signature import Bound

Arrays = list[np.ndarray[Any, Any]]

IGNORED_PARAMETERS = frozenset(
    {
        "priority",
        "timeout",
        "binary_data_output",
        "binary_data",
        "binary_data_size",
        "bitorder",  # an input's: in the key as the effective bit order (model's if unset)
        "shared_memory_region",
        "shared_memory_byte_size",
        "shared_memory_offset",
        "triton_enable_empty_final_response",
    }
)
"""Parameters that change when or in which form an answer travels, not what it is."""

ENTRY_OVERHEAD = 256
"""Bytes counted for each entry beyond its arrays (key, lists, headers of the arrays)."""


def _params(params: dict[str, Any] | None) -> bytes:
    kept = {k: v for k, v in (params or {}).items() if k not in IGNORED_PARAMETERS}
    return json.dumps(kept, sort_keys=True, default=repr, separators=(",", ":")).encode()


def cache_key(handle: ModelHandle, request: InferRequest, bound: Bound) -> bytes:
    """The 16-byte key of ``request`` (checked and laid out as ``bound``) for ``handle``'s
    model version: see the module docstring for what it covers."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{handle.name}\0{handle.version}\0".encode())
    specs = handle.cfg.inputs
    for spec, wire in zip(specs, bound.inputs, strict=True):
        data = wire.data
        bitorder = (wire.bitorder or spec.bitorder) if wire.packed else "-"
        head = f"{spec.name}\0{data.dtype.str}\0{data.shape}\0{int(wire.packed)}\0{bitorder}\0"
        h.update(head.encode())
        if data.dtype.hasobject:  # BYTES elements: each with its length
            for item in data.reshape(-1):
                b = bytes(item)
                h.update(len(b).to_bytes(8, "little"))
                h.update(b)
        else:
            h.update(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
    h.update(b"\0params\0" + _params(request.parameters))
    for inp in request.inputs:
        if inp.parameters:
            h.update(f"\0input\0{inp.name}\0".encode() + _params(inp.parameters))
    h.update(b"\0outputs\0" + ",".join(map(str, bound.outputs)).encode())
    for out in request.outputs or ():
        if out.parameters:
            h.update(f"\0output\0{out.name}\0".encode() + _params(out.parameters))
    return h.digest()


class ResponseCache:
    """Answers by key, least recently used first out, within ``size_bytes``.

    Thread-safe (a lock around each operation); the data plane uses it from the event loop.

    Args:
        size_bytes: the most bytes the entries may take (their arrays plus
            :data:`ENTRY_OVERHEAD` each).
    """

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, tuple[tuple[str, str], Arrays, BatchInfo, int]] = (
            OrderedDict()
        )
        self._by_version: dict[tuple[str, str], set[bytes]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[Arrays, BatchInfo] | None:
        """The stored answer of ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[1], entry[2]

    def put(self, key: bytes, version: tuple[str, str], arrays: Arrays, info: BatchInfo) -> None:
        """Store a copy of ``arrays`` (the outputs of one answer, config order) under ``key``
        for ``version`` (``(model, version)``); one larger than the whole cache is not
        stored."""
        copies = [np.array(a, copy=True) for a in arrays]
        nbytes = sum(a.nbytes for a in copies) + ENTRY_OVERHEAD
        if nbytes > self.size_bytes:
            return
        with self._lock:
            self._remove(key)
            while self.used_bytes + nbytes > self.size_bytes and self._entries:
                self._remove(next(iter(self._entries)))
            self._entries[key] = (version, copies, info, nbytes)
            self._by_version.setdefault(version, set()).add(key)
            self.used_bytes += nbytes

    def drop(self, name: str, version: str) -> None:
        """Forget every answer of ``name`` version ``version`` (reloaded, unloaded, evicted)."""
        with self._lock:
            for key in list(self._by_version.get((name, version), ())):
                self._remove(key)

    def _remove(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        version, _, _, nbytes = entry
        self.used_bytes -= nbytes
        keys = self._by_version.get(version)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_version[version]
