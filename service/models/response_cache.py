"""The response cache (``--cache-config local,size=BYTES``; ``[response_cache] enable = true``).

As Triton's local cache: a request equal to one answered before, in everything that changes
the answer, is answered with the stored outputs and never reaches its model. Unlike Triton's
key (model, version, input names and bytes: ``cache_manager.cc``), ours also holds what makes
equal bytes mean something else (:func:`cache_key`):

- the model and version;
- every input as the model receives it (``service.models.signature.Bound``, config order): its
  name, wire datatype, shape, whether it is bit-packed, its bit order, and its bytes (the
  packed bytes of a packed input: 8x fewer to hash);
- the request's parameters and each input's and output's, except those that change only
  how the answer travels or when (:data:`IGNORED_PARAMETERS`: ``priority``, ``timeout``, the
  binary or JSON form, shared memory placement); so a new parameter (an index's ``k`` or
  ``threshold``) is in the key without a change here;
- the outputs asked for.

All of it goes through one 128-bit BLAKE2b (``hashlib``). The cache keeps each answer's
output arrays (copies) and its batch's :class:`~service.batching.queue.BatchInfo`; a hit is
framed as any answer, with the new request's id. Entries are evicted least recently used
first to stay within the size, and a version's entries are dropped when it is reloaded,
unloaded or evicted from its device. Each ``--workers`` process has its own cache of this
size.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from service.batching.queue import BatchInfo
from service.models.config import ModelConfig

if TYPE_CHECKING:
    from service.models.signature import Bound
    from service.protocol.types import InferRequest

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


def _params(params: dict[str, Any]) -> bytes:
    """The parameters that change the answer, canonical (empty: none do)."""
    if params.keys() <= IGNORED_PARAMETERS:  # the usual case: nothing to write
        return b""
    kept = {k: v for k, v in params.items() if k not in IGNORED_PARAMETERS}
    return json.dumps(kept, sort_keys=True, default=repr, separators=(",", ":")).encode()


_HEADS: dict[tuple[Any, ...], tuple[bytes, bool]] = {}
"""The bytes in the key of each request form: the model, version, every input's name,
datatype, shape, packing and bit order, and the outputs asked for (a handful per model, each
written once; the key then hashes this head and the inputs' bytes, in one BLAKE2b); and
whether an input holds BYTES elements."""

_SPECS: dict[int, tuple[ModelConfig, tuple[tuple[str, str], ...]]] = {}
"""Each config's inputs' names and bit orders (read from the config object once)."""


def _specs(cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
    got = _SPECS.get(id(cfg))
    if got is None or got[0] is not cfg:  # a new config (or another one at a reused id)
        if len(_SPECS) > 4096:
            _SPECS.clear()
        got = _SPECS[id(cfg)] = (cfg, tuple((s.name, s.bitorder) for s in cfg.inputs))
    return got[1]


class CachedVersion(Protocol):
    """What a key needs of a model version (``service.models.handle.ModelHandle`` has it)."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def cfg(self) -> ModelConfig: ...


def cache_key(handle: CachedVersion, request: InferRequest, bound: Bound) -> bytes:
    """The 16-byte key of ``request`` (checked and laid out as ``bound``) for ``handle``'s
    model version: see the module docstring for what it covers.

    The miss path's cost (a lookup that finds nothing costs this and a dict probe): one
    BLAKE2b over a cached head and the inputs' bytes as they arrived (no copy of a
    contiguous input), plus the parameters only when one of them changes the answer.
    """
    form: list[Any] = [handle.name, handle.version, bound.outputs]
    for (name, order), wire in zip(_specs(handle.cfg), bound.inputs, strict=True):
        data = wire.data
        form.append((name, data.dtype, data.shape, wire.packed,
                     (wire.bitorder or order) if wire.packed else "-"))  # fmt: skip
    head_key = tuple(form)
    found = _HEADS.get(head_key)
    if found is None:
        if len(_HEADS) > 4096:
            _HEADS.clear()
        text = f"{handle.name}\0{handle.version}\0outputs{bound.outputs!r}"
        for name, dtype, shape, packed, bitorder in form[3:]:
            text += f"\0{name}\0{dtype.str}{shape}{packed:d}{bitorder}\0"
        objects = any(dtype.hasobject for _, dtype, *_ in form[3:])
        found = _HEADS[head_key] = (text.encode(), objects)
    head, objects = found
    h = hashlib.blake2b(head, digest_size=16)
    params = _all_params(request)
    if params:
        h.update(params)
    update = h.update
    for wire in bound.inputs:
        data = wire.data
        if objects and data.dtype.hasobject:  # BYTES elements: each with its length
            for item in data.reshape(-1):
                b = bytes(item)
                update(len(b).to_bytes(8, "little"))
                update(b)
            continue
        try:
            update(data)  # type: ignore[arg-type]  # its buffer, as it is: no copy
        except (BufferError, ValueError):  # not contiguous
            update(np.ascontiguousarray(data).tobytes())
    return h.digest()


def _all_params(request: InferRequest) -> bytes:
    """The request's, its inputs' and its outputs' parameters that change the answer,
    canonical (empty, without any work, when none do: the usual case)."""
    parts: list[bytes] = []
    if not request.parameters.keys() <= IGNORED_PARAMETERS:
        parts += [b"\0request\0", _params(request.parameters)]
    for inp in request.inputs:
        if inp.parameters and not inp.parameters.keys() <= IGNORED_PARAMETERS:
            parts += [b"\0input\0", inp.name.encode(), b"\0", _params(inp.parameters)]
    for out in request.outputs or ():
        if out.parameters and not out.parameters.keys() <= IGNORED_PARAMETERS:
            parts += [b"\0output\0", out.name.encode(), b"\0", _params(out.parameters)]
    return b"".join(parts)


class ResponseCache:
    """Answers by key, least recently used first out, within ``size_bytes``.

    Used from the event loop only (the data plane's lookups and stores, the repository's
    drops), so it takes no lock.

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

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[Arrays, BatchInfo] | None:
        """The stored answer of ``key`` (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[1], entry[2]

    def put(self, key: bytes, version: tuple[str, str], arrays: Arrays, info: BatchInfo) -> None:
        """Store a copy of ``arrays`` (the outputs of one answer, config order) under ``key``
        for ``version`` (``(model, version)``); one larger than the whole cache is not
        stored. A copy: a request's outputs are views of its batch's arrays, which the cache
        must neither keep whole nor share with a pipeline that may reuse them."""
        copies = [a.copy() for a in arrays]
        nbytes = ENTRY_OVERHEAD
        for a in copies:
            nbytes += a.nbytes
        if nbytes > self.size_bytes:
            return
        if key in self._entries:
            self._remove(key)
        while self.used_bytes + nbytes > self.size_bytes and self._entries:
            self._remove(next(iter(self._entries)))
        self._entries[key] = (version, copies, info, nbytes)
        keys = self._by_version.get(version)
        if keys is None:
            keys = self._by_version[version] = set()
        keys.add(key)
        self.used_bytes += nbytes

    def drop(self, name: str, version: str) -> None:
        """Forget every answer of ``name`` version ``version`` (reloaded, unloaded, evicted)."""
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
