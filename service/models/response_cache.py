"""The response cache (``--cache-config local,size=BYTES``; ``[response_cache] enable = true``).

As Triton's local cache: a request equal to one answered before, in everything that changes
the answer, is answered with the stored outputs and never reaches its model. Unlike Triton's
key (model, version, input names and bytes: ``cache_manager.cc``), ours also holds what makes
equal bytes mean something else (:func:`reference_key` writes it all out):

- the model and version;
- every input as the model receives it (``service.models.signature.Bound``, config order): its
  name, wire datatype, shape, whether it is bit-packed, its bit order, and its bytes (the
  packed bytes of a packed input: 8x fewer to hash);
- the request's parameters and each input's and output's, except those that change only
  how the answer travels or when (:data:`IGNORED_PARAMETERS`: ``priority``, ``timeout``, the
  binary or JSON form, shared memory placement); so a new parameter (an index's ``k`` or
  ``threshold``) is in the key without a change here;
- the outputs asked for.

All of it goes through one 128-bit BLAKE2b (``hashlib``): first a head (everything but the
inputs' bytes), then the bytes. :func:`cache_key` hashes each form of request's head once: a
request of a :class:`~service.protocol.types.RequestForm` seen before (the header cache's:
the same header, other data) costs a copy of its form's hashed head and the hashing of its
bytes; any other request, a lookup of its hashed head by its inputs' datatypes, shapes and
bit orders, and its parameters. Both equal :func:`reference_key`, which writes out and
hashes the whole key each time.

The cache keeps a copy of each answer's outputs (their bytes, in one object) and its batch's
:class:`~service.batching.queue.BatchInfo`; a hit is framed as any answer, with the new
request's id. Entries are evicted least recently used first to stay within the size, and a
version's entries are dropped when it is reloaded, unloaded or evicted from its device. Each
``--workers`` process has its own cache of this size.

A cache that is full admits an answer only when its request missed before, recently (a
doorkeeper, as TinyLFU's in Caffeine and Ristretto): :meth:`ResponseCache.admit`. So a run
of requests seen once (random inputs, a scan) neither pushes out the answers that are asked
for again nor pays to store answers that would be evicted unread; while the cache has room,
every answer is stored, as Triton's are. A request sent twice to a full cache is stored on
its second miss and hit from its third.

With no hits the cache is pure cost, and a cost in Python objects and bytecodes more than in
hashing: measured in the server, one request's key, lookup and store took some 45,000 CPU
instructions when they built the head and parameters of each request anew and stored copies
of output arrays (a list, an array, its data and its dimensions for each answer), three
times what the same code takes in a loop of its own; hence one hashed head per form, one
bytes object per answer, and no store at all for a full cache's requests seen once.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from service.batching.queue import BatchInfo
from service.models.config import ModelConfig

if TYPE_CHECKING:
    from service.models.signature import Bound, Signature
    from service.protocol.types import InferRequest

Arrays = list[np.ndarray[Any, Any]]
Hasher = Any
"""A ``hashlib.blake2b`` object (hashlib exports no name for its type)."""

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
"""Bytes counted for each entry beyond its outputs' bytes (its key, its tuple, the index)."""

DIGEST_BYTES = 16
"""128 bits."""

ALIGN = 16
"""Where each output of an answer of several starts in its stored bytes (a multiple of)."""

DOORKEEPER_MIN = 1024
"""The fewest missed keys a full cache remembers (:meth:`ResponseCache.admit`); it remembers
at least as many as it holds entries, and at most twice that. They are not counted in the
cache's size: about 90 bytes each (a 16-byte ``bytes`` and its set slot), so up to some 180
bytes per entry beside the 256 of :data:`ENTRY_OVERHEAD`."""


class CachedVersion(Protocol):
    """What a key needs of a model version (``service.models.handle.ModelHandle`` has it):
    its name, version and config; and its signature (read only for a request with a
    :class:`~service.protocol.types.RequestForm`), whose identity stands for all three."""

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    @property
    def cfg(self) -> ModelConfig: ...

    @property
    def signature(self) -> Signature: ...


# --- the key, written out ------------------------------------------------------------------


def _params(params: dict[str, Any]) -> bytes:
    """The parameters that change the answer, canonical (empty: none do)."""
    if params.keys() <= IGNORED_PARAMETERS:  # the usual case: nothing to write
        return b""
    kept = {k: v for k, v in params.items() if k not in IGNORED_PARAMETERS}
    return json.dumps(kept, sort_keys=True, default=repr, separators=(",", ":")).encode()


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


def _head_text(name: str, version: str, outputs: tuple[int, ...], inputs: list[Any]) -> bytes:
    """The head: the model, version and outputs asked for, and each input's name, datatype,
    shape, packing and effective bit order (``inputs``: those five, config order)."""
    text = f"{name}\0{version}\0outputs{outputs!r}"
    for input_name, dtype, shape, packed, bitorder in inputs:
        text += f"\0{input_name}\0{dtype.str}{shape}{packed:d}{bitorder}\0"
    return text.encode()


def _hash_data(h: Hasher, data: np.ndarray[Any, Any]) -> None:
    """Add one input's bytes to ``h``: its buffer as it is (no copy when contiguous); BYTES
    elements each with its length."""
    if data.dtype.hasobject:
        for item in data.reshape(-1):
            b = bytes(item)
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
        return
    try:
        h.update(data)
    except (BufferError, ValueError):  # not contiguous
        h.update(np.ascontiguousarray(data).tobytes())


def reference_key(handle: CachedVersion, request: InferRequest, bound: Bound) -> bytes:
    """The 16-byte key of ``request`` (checked and laid out as ``bound``) for ``handle``'s
    model version, written out and hashed afresh: what :func:`cache_key` must return."""
    inputs = [
        (spec.name, wire.data.dtype, wire.data.shape, wire.packed,
         (wire.bitorder or spec.bitorder) if wire.packed else "-")
        for spec, wire in zip(handle.cfg.inputs, bound.inputs, strict=True)
    ]  # fmt: skip
    h = hashlib.blake2b(_head_text(handle.name, handle.version, bound.outputs, inputs),
                        digest_size=DIGEST_BYTES)  # fmt: skip
    h.update(_all_params(request))
    for wire in bound.inputs:
        _hash_data(h, wire.data)
    key: bytes = h.digest()
    return key


# --- the key, fast -------------------------------------------------------------------------

_HEADS: dict[tuple[Any, ...], tuple[Hasher, bool, ModelConfig]] = {}
"""Each request form's head, hashed, by the model version's config (its id: the value holds
the config, so the id is not reused while the entry lives), name and version, the outputs
asked for and each input's datatype, shape, packing and bit order (a handful per model, each
hashed once); and whether an input holds BYTES elements."""


def _head(handle: CachedVersion, bound: Bound) -> tuple[Hasher, bool]:
    """``bound``'s head, hashed (copy it before adding to it), and whether an input holds
    BYTES elements."""
    cfg = handle.cfg
    form: list[Any] = [id(cfg), handle.name, handle.version, bound.outputs]
    for wire in bound.inputs:
        data = wire.data
        form += (data.dtype, data.shape, wire.packed, wire.bitorder)
    found = _HEADS.get(tuple(form))
    if found is None:
        if len(_HEADS) > 4096:
            _HEADS.clear()
        inputs = [
            (spec.name, wire.data.dtype, wire.data.shape, wire.packed,
             (wire.bitorder or spec.bitorder) if wire.packed else "-")
            for spec, wire in zip(cfg.inputs, bound.inputs, strict=True)
        ]  # fmt: skip
        text = _head_text(handle.name, handle.version, bound.outputs, inputs)
        objects = any(wire.data.dtype.hasobject for wire in bound.inputs)
        found = _HEADS[tuple(form)] = (hashlib.blake2b(text, digest_size=DIGEST_BYTES),
                                       objects, cfg)  # fmt: skip
    return found[0], found[1]


def cache_key(handle: CachedVersion, request: InferRequest, bound: Bound) -> bytes:
    """:func:`reference_key`, fast: the head hashed once per form of request (see the module
    docstring), then the inputs' bytes as they arrived (no copy of a contiguous input).

    A request's :class:`~service.protocol.types.RequestForm` keeps its head with the
    signature of the version it was hashed for: a version's signature is its own (made
    with it, never shared), and with the form it fixes all of ``bound`` but the inputs'
    bytes, so another version (a reload) hashes its head anew.
    """
    form = request.form
    if form is not None:
        memo = form.key_head
        if memo is not None and memo[0] is handle.signature:
            h = memo[1].copy()
            for wire in bound.inputs:
                try:
                    h.update(wire.data)
                except (BufferError, ValueError):  # not contiguous
                    h.update(np.ascontiguousarray(wire.data).tobytes())
            key: bytes = h.digest()
            return key
    head, objects = _head(handle, bound)
    h = head.copy()
    params = _all_params(request)
    if params:
        h.update(params)
    if form is not None and not objects:  # its head and parameters: this form's from now on
        form.key_head = (handle.signature, h.copy())
    for wire in bound.inputs:
        _hash_data(h, wire.data)
    digest: bytes = h.digest()
    return digest


class _VersionKeys(set[bytes]):
    """The keys of one model version's entries, and that version (``(model, version)``)."""

    __slots__ = ("version",)

    def __init__(self, version: tuple[str, str]) -> None:
        super().__init__()
        self.version = version


_Entry = tuple[_VersionKeys, bytes, Any, Any, BatchInfo]
"""A stored answer: its version's keys; its outputs' bytes, one after the other (each at a
multiple of :data:`ALIGN`), in one object; their dtype and shape (one output: an
``np.dtype`` and a shape; several: a tuple of each); its batch. It counts for
:data:`ENTRY_OVERHEAD` and its bytes."""


class ResponseCache:
    """Answers by key, least recently used first out, within ``size_bytes``.

    Used from the event loop only (the data plane's lookups and stores, the repository's
    drops), so it takes no lock. An answer is stored in as few objects as can be (its
    outputs' bytes in one), since with no hits each entry is written once and freed once and
    never read: what it costs then is mostly the memory it touches.

    Args:
        size_bytes: the most bytes the entries may take (their outputs' bytes plus
            :data:`ENTRY_OVERHEAD` each).
    """

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._by_version: dict[tuple[str, str], _VersionKeys] = {}
        self._last_nbytes = 0  # the last stored entry's: what the next one is taken to need
        self._missed: set[bytes] = set()  # the doorkeeper: keys missed while full, newest
        self._missed_before: set[bytes] = set()  # and the generation before
        self.refused = 0  # misses admit() did not store (a full cache's requests seen once)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> tuple[Arrays, BatchInfo] | None:
        """The stored answer of ``key`` (now the most recently used), or None: its outputs
        are new read-only arrays over the stored bytes."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        _, data, dtype, shape, info = entry
        if type(dtype) is not tuple:  # one output
            return [np.frombuffer(data, dtype).reshape(shape)], info
        arrays = []
        offset = 0
        for d, sh in zip(dtype, shape, strict=True):
            offset += -offset % ALIGN
            count = math.prod(sh)
            arrays.append(np.frombuffer(data, d, count, offset).reshape(sh))
            offset += count * d.itemsize
        return arrays, info

    def admit(self, key: bytes) -> bool:
        """Whether to store the answer of ``key``, which just missed: yes while the cache
        has room for an answer as large as the last one stored; when it is full, only if
        ``key`` missed before, among the last :data:`DOORKEEPER_MIN` (or as many as there
        are entries) to twice that many keys refused; a refused key is remembered.

        A full cache so stores answers asked for twice, not those asked for once, which
        would only push out others and be evicted unread (a scan, random inputs)."""
        if self.used_bytes + self._last_nbytes <= self.size_bytes:
            return True
        missed = self._missed
        if key in missed or key in self._missed_before:
            return True
        missed.add(key)
        self.refused += 1
        if len(missed) >= DOORKEEPER_MIN and len(missed) >= len(self._entries):
            self._missed_before, self._missed = missed, set()  # the older generation goes
        return False

    def put(self, key: bytes, version: tuple[str, str], arrays: Arrays, info: BatchInfo) -> None:
        """Store a copy of ``arrays`` (the outputs of one answer, config order) under ``key``
        for ``version`` (``(model, version)``); one larger than the whole cache is not
        stored, nor one under a key stored already (an equal request answered meanwhile: that
        one stays, now the most recently used). A copy:
        a request's outputs are views of its batch's arrays, which the cache must neither
        keep whole nor share with a pipeline that may reuse them."""
        dtype: Any
        shape: Any
        if len(arrays) == 1:  # the usual case
            a = arrays[0]
            dtype = a.dtype
            if dtype.hasobject:
                return  # no model answers objects; their bytes would be pointers
            data = a.tobytes()
            shape = a.shape
        else:
            dtype = tuple([a.dtype for a in arrays])
            if any(d.hasobject for d in dtype):
                return
            parts = []
            offset = 0
            for a in arrays:
                if offset % ALIGN:
                    parts.append(bytes(-offset % ALIGN))
                    offset += -offset % ALIGN
                parts.append(a.tobytes())
                offset += a.nbytes
            data = b"".join(parts)
            shape = tuple([a.shape for a in arrays])
        nbytes = ENTRY_OVERHEAD + len(data)
        if nbytes > self.size_bytes:
            return
        self._last_nbytes = nbytes
        keys = self._by_version.get(version)
        if keys is None:
            keys = self._by_version[version] = _VersionKeys(version)
        entries = self._entries
        entry = (keys, data, dtype, shape, info)
        if entries.setdefault(key, entry) is not entry:  # stored already: it stays
            entries.move_to_end(key)
            return
        keys.add(key)
        used = self.used_bytes + nbytes
        while used > self.size_bytes:  # least recently used first (never this one: it fits)
            old_key, old = entries.popitem(False)
            used -= ENTRY_OVERHEAD + len(old[1])
            old_keys = old[0]
            old_keys.discard(old_key)
            if not old_keys:
                del self._by_version[old_keys.version]
        self.used_bytes = used

    def drop(self, name: str, version: str) -> None:
        """Forget every answer of ``name`` version ``version`` (reloaded, unloaded, evicted)."""
        keys = self._by_version.pop((name, version), None)
        if keys is None:
            return
        for key in keys:
            entry = self._entries.pop(key)
            self.used_bytes -= ENTRY_OVERHEAD + len(entry[1])
