"""An index's corpus: its file read and checked on the host, and one resident copy per content.

:func:`read_corpus` opens an ``[index] file`` without reading its rows into memory: a
safetensors file (``corpus`` (N, W) uint8 packed rows, optional ``ids`` (N,) int64) is
memory-mapped at the offsets its header gives, an ``.npy`` by ``np.load(mmap_mode="c")``.
It checks the tensors against the config (names, dtypes, the width ``ceil(L / 8)``, ids
unique, ``k <= N``, zero padding bits) and starts hashing the file's bytes (SHA-256, in a
thread, beside the rest of the load): the content, not the path, names a corpus.

:data:`STORE` (a :class:`CorpusStore`) keeps one :class:`ResidentCorpus` per content and
device, prepared once (``gpu_ops.PackedCorpus``: popcount order, popcounts) and shared by
every model version that names a file with the same bytes; it lives while some version
holds it (weak references) and is freed with the last one. Nothing here reads a pickle.

Every problem is reported as ``<file>: index.<key>: <problem>`` (a ConfigError).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from service.models.config import ConfigError, IndexConfig, InputConfig, library_error
from service.text import safe_text

CORPUS = "corpus"
IDS = "ids"
_MAX_HEADER = 100 << 20  # safetensors' own bound on its JSON header
_ST_DTYPES = {"U8": np.uint8, "I64": np.int64}


@dataclass
class CorpusFile:
    """A corpus file opened on the host (its rows memory-mapped, not read).

    Attributes:
        path: the file.
        corpus: (N, W) uint8 packed rows, a copy-on-write memory map of the file.
        ids: (N,) int64 external ids, unique; None: the row numbers are the ids.
        hashing: SHA-256 of the file's bytes (hex), the key of its resident copy, computed
            in a thread of its own (see :attr:`digest`).
        identity: the file's device, inode, size and modification time: a resident copy
            made from the same identity is a candidate before the hash is done.
    """

    path: Path
    corpus: np.ndarray[Any, Any]
    ids: np.ndarray[Any, Any] | None
    hashing: Future[str]
    identity: tuple[int, int, int, int]

    @property
    def num_rows(self) -> int:
        return int(self.corpus.shape[0])

    @property
    def digest(self) -> str:
        """The file's SHA-256 (waits for the hashing thread)."""
        return self.hashing.result()


_HASHER: ThreadPoolExecutor | None = None


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:  # hashlib releases the GIL on large reads
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _start_hash(path: Path) -> Future[str]:
    """The file's SHA-256, computed beside the load (hashing 256 MB takes about 0.5 s)."""
    global _HASHER
    if _HASHER is None:
        _HASHER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="corpus-hash")
    return _HASHER.submit(_sha256, path)


def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and where its data starts (8 + header bytes)."""
    with path.open("rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > _MAX_HEADER:
            raise ValueError(f"header of {n} bytes (more than {_MAX_HEADER})")
        header = json.loads(fh.read(n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + n


def _map_tensor(
    path: Path, entry: dict[str, Any], start: int, size: int, dtype: Any
) -> np.ndarray[Any, Any]:
    """One tensor of a safetensors file as a copy-on-write memory map (writable for
    ``torch.from_numpy``, never written)."""
    shape = tuple(int(d) for d in entry["shape"])
    begin, end = (int(x) for x in entry["data_offsets"])
    itemsize = np.dtype(dtype).itemsize
    if end - begin != math.prod(shape) * itemsize or start + end > size:
        raise ValueError(f"tensor of shape {list(shape)} has data_offsets {[begin, end]}")
    if math.prod(shape) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="c", offset=start + begin, shape=shape)


def _open_safetensors(path: Path) -> tuple[np.ndarray[Any, Any] | None, Any, list[str]]:
    """``(corpus, ids, problems)``: the two tensors mapped when their dtypes and ranks fit."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as fh:  # the library's own validation
        names = list(fh.keys())
    header, start = _safetensors_header(path)
    size = path.stat().st_size
    problems: list[str] = []
    corpus = ids = None
    if CORPUS not in header:
        shown = [safe_text(n, 40) for n in sorted(names)[:20]]
        return None, None, [f"has no tensor 'corpus' (has {shown})"]
    for name, want, ndim in ((CORPUS, "U8", 2), (IDS, "I64", 1)):
        entry = header.get(name)
        if entry is None:
            continue
        got = (entry.get("dtype"), list(entry.get("shape", [])))
        if got[0] != want or len(got[1]) != ndim:
            what = "uint8 (N, W) packed rows" if name == CORPUS else "int64 (N,)"
            problems.append(f"tensor '{name}' is {got[0]} {got[1]}; needs {want}: {what}")
            continue
        mapped = _map_tensor(path, entry, start, size, _ST_DTYPES[want])
        if name == CORPUS:
            corpus = mapped
        else:
            ids = mapped
    return corpus, ids, problems


def _open_npy(path: Path) -> tuple[np.ndarray[Any, Any] | None, None, list[str]]:
    arr = np.load(path, mmap_mode="c", allow_pickle=False)
    if arr.dtype != np.uint8 or arr.ndim != 2:
        return (
            None,
            None,
            [
                f"holds {arr.dtype} {list(arr.shape)}; needs uint8 (N, W) packed rows (bool "
                "rows: `bitserve index build` packs them)"
            ],
        )
    return arr, None, []


def padding_mask(spec: InputConfig) -> int | None:
    """The bits of the last packed byte that hold data (in the input's bit order), or None
    when the bit count is a multiple of 8."""
    r = spec.shape[-1] % 8
    if r == 0:
        return None
    return (0xFF << (8 - r)) & 0xFF if spec.bitorder == "big" else (1 << r) - 1


def read_corpus(
    path: Path, index: IndexConfig, query: InputConfig, source: str, folder: tuple[Path, str]
) -> CorpusFile:
    """Open and check an index's corpus file (see the module docstring).

    Args:
        path: the file (resolved inside the model's folder).
        index: the ``[index]`` table.
        query: the index's input (its bit count L and bit order).
        source: the config's name in messages.
        folder: the model's folder and how messages show it.

    Raises:
        ConfigError: every problem, each ``<source>: index.<key>: ...``.
    """
    where = f"{source}: index.file"
    file = safe_text(index.file)
    try:
        opened = _open_npy(path) if path.suffix == ".npy" else _open_safetensors(path)
    except Exception as exc:  # numpy and safetensors raise several types for a bad file
        kind = ".npy file" if path.suffix == ".npy" else "safetensors file"
        raise library_error(where, f"{file}: not a readable {kind}", exc, *folder) from exc
    corpus, ids, found = opened
    problems = [f"{where}: {file}: {p}" for p in found]
    if corpus is None:
        raise ConfigError(problems)
    n, width = corpus.shape
    L = query.shape[-1]
    if width != (L + 7) // 8:
        problems.append(
            f"{where}: {file}: rows of {width} bytes; inputs[0].shape [{L}] needs "
            f"{(L + 7) // 8} (ceil({L} / 8))"
        )
    if n < 1:
        problems.append(f"{where}: {file}: the corpus has no rows")
    elif index.k > n:
        problems.append(f"{source}: index.k: k = {index.k} is more than the corpus's {n} rows")
    if ids is not None:
        if ids.shape != (n,):
            problems.append(f"{where}: {file}: ids has shape {list(ids.shape)}; needs [{n}]")
        else:
            problems += [f"{where}: {file}: {p}" for p in _unique(ids)]
    mask = padding_mask(query)
    if not problems and mask is not None:
        bad = np.flatnonzero(corpus[:, -1] & (~mask & 0xFF))
        if bad.size:
            problems.append(
                f"{where}: {file}: row {int(bad[0])} (and {bad.size - 1} more) has bits set past "
                f"bit {L} in its last byte ({query.bitorder} bit order); padding bits must be 0"
            )
    if problems:
        raise ConfigError(problems)
    st = path.stat()
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return CorpusFile(path, corpus, ids, _start_hash(path), identity)


def _unique(ids: np.ndarray[Any, Any]) -> list[str]:
    """A problem when some id repeats (the first repeated one named)."""
    ordered = np.sort(ids, kind="stable")
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if same.size == 0:
        return []
    value = int(ordered[same[0]])
    rows = np.flatnonzero(ids == value)[:2].tolist()
    return [f"ids are not unique: {value} is the id of rows {rows[0]} and {rows[1]}"]


class ResidentCorpus:
    """A corpus prepared on its device (``gpu_ops.PackedCorpus``) with its ids.

    Args:
        file: the opened file.
        device: where it lives.

    Attributes:
        packed: the prepared corpus (one copy of the rows, in popcount order).
        ids: (N,) int64 on the device, or None (row numbers).
        digest: the file's SHA-256 (set by the store once the hash is done).
        nbytes: bytes it holds on the device (rows, popcounts, order, ids).
    """

    def __init__(self, file: CorpusFile, device: torch.device) -> None:
        from gpu_ops import PackedCorpus

        rows = torch.from_numpy(file.corpus)  # over the map: no copy here
        # PackedCorpus makes the one copy (popcount order) on the device; the map's pages
        # are dropped when ``file`` goes.
        self.packed = PackedCorpus(rows.to(device))
        self.ids = None if file.ids is None else torch.from_numpy(file.ids).to(device, copy=True)
        self.identity = file.identity
        self.digest = ""
        self.num_rows = file.num_rows
        self.nbytes = int(self.packed.nbytes) + (0 if self.ids is None else self.ids.numel() * 8)
        self._device = str(device)

    @property
    def shared_key(self) -> tuple[str, str, str]:
        """What names this copy among the versions that share it (``service.residency.budget.
        shared_parts``: the device memory budget counts it once per device)."""
        return ("corpus", self.digest or f"file:{self.identity}", self._device)


class CorpusStore:
    """One :class:`ResidentCorpus` per (content, device), shared while anyone holds it.

    The file's hash runs beside the build: a load waits for it first only when a resident
    copy of the same file (its identity) lives, and otherwise prepares the rows while the
    hash is computed, then keeps the copy already resident if the content turns out to be
    one (a copy of the file elsewhere) and drops its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[tuple[str, str], weakref.ref[ResidentCorpus]] = {}

    def _find(
        self, device: torch.device, match: Callable[[ResidentCorpus], bool]
    ) -> ResidentCorpus | None:
        with self._lock:
            for (_, dev), ref in list(self._live.items()):
                found = ref()
                if found is not None and dev == str(device) and match(found):
                    return found
        return None

    def get(
        self, file: CorpusFile, device: torch.device, make: Callable[[], ResidentCorpus]
    ) -> ResidentCorpus:
        """The resident corpus of ``file``'s content on ``device``; ``make`` builds one
        when none lives."""
        same_file = self._find(device, lambda r: r.identity == file.identity)
        if same_file is not None and same_file.digest == file.digest:
            return same_file
        made = make()  # while the hash runs
        key = (file.digest, str(device))
        with self._lock:
            ref = self._live.get(key)
            found = ref() if ref is not None else None
            if found is not None:
                return found
            made.digest = file.digest
            self._live[key] = weakref.ref(made, lambda _r, k=key: self._forget(k))  # type: ignore[misc]
            return made

    def _forget(self, key: tuple[str, str]) -> None:
        ref = self._live.get(key)
        if ref is not None and ref() is None:
            self._live.pop(key, None)

    def __len__(self) -> int:
        """How many corpora are resident (for tests and metrics)."""
        return sum(1 for r in list(self._live.values()) if r() is not None)


STORE = CorpusStore()
"""The process's corpora (each ``bitserve`` worker process has its own)."""


def load_error(source: str, exc: BaseException, folder: tuple[Path | None, str]) -> ConfigError:
    """A failure to prepare the corpus on its device, as a load problem."""
    return library_error(f"{source}: index.file", "cannot prepare the corpus", exc, *folder)
