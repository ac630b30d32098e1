"""Where ``infer_many`` puts its results: memory, or ``.npy`` files that can be resumed.

A file is written row block by row block, in input order, and its header is rewritten (same
length) after every block to state the rows written so far. At any moment, also after a
crash, it is a valid ``.npy`` of the rows done; ``resume=True`` reads that count back and
appends the rest.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._exceptions import DecodeError, InvalidInputError
from ._spec import DATATYPES, ModelSpec
from ._types import BulkResult, InferResult

Out = str | os.PathLike[str] | Mapping[str, str | os.PathLike[str]] | None

_MAGIC = b"\x93NUMPY\x01\x00"


def _npy_header(dtype: np.dtype[Any], shape: tuple[int, ...], size: int | None = None) -> bytes:
    """A version 1.0 ``.npy`` header, padded to ``size`` bytes (default: to 64 bytes)."""
    text = repr(
        {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    )
    # magic (6) + version (2) + length (2) + text + "\n", padded with spaces.
    total = size if size is not None else -(-(10 + len(text) + 1) // 64) * 64
    if 10 + len(text) + 1 > total:
        raise ValueError(f"a .npy header for shape {shape} does not fit in {total} bytes")
    text = text.ljust(total - 10 - 1) + "\n"
    return _MAGIC + (total - 10).to_bytes(2, "little") + text.encode("latin1")


def _read_header(path: Path) -> tuple[np.dtype[Any], tuple[int, ...], int, int]:
    """(dtype, shape, header size, rows whose data is complete) of a C-order ``.npy`` file."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        except ValueError as exc:
            raise InvalidInputError(f"cannot resume: {path} is not a .npy file: {exc}") from None
        offset = f.tell()
    if fortran or not shape or dtype.hasobject:
        raise InvalidInputError(f"cannot resume: {path} is not a C-order array with rows")
    row_bytes = dtype.itemsize * int(np.prod(shape[1:]))
    on_disk = (os.path.getsize(path) - offset) // row_bytes if row_bytes else shape[0]
    return dtype, tuple(shape), offset, min(shape[0], on_disk)


class _NpyWriter:
    """Appends row blocks to a ``.npy`` file whose header always states the rows in it."""

    _RESERVED_ROWS = 10**18  # no row count's repr is longer than this one's

    def __init__(
        self, path: Path, dtype: np.dtype[Any], item: tuple[int, ...], keep_rows: int = 0
    ) -> None:
        self.path, self.dtype, self.item, self.rows = path, dtype, item, keep_rows
        if keep_rows:
            old_dtype, shape, self._size, _ = _read_header(path)
            if old_dtype != dtype or shape[1:] != item:
                raise InvalidInputError(
                    f"cannot resume: {path} holds {old_dtype} rows of {list(shape[1:])}, "
                    f"the model gives {dtype} rows of {list(item)}"
                )
            _npy_header(dtype, (self._RESERVED_ROWS, *item), self._size)  # the count fits?
            self._file = open(path, "r+b")  # noqa: SIM115 - closed in close()
            # Drop whatever a crash left past the last complete block.
            self._file.truncate(self._size + keep_rows * dtype.itemsize * int(np.prod(item)))
        else:
            self._size = len(_npy_header(dtype, (self._RESERVED_ROWS, *item)))
            self._file = open(path, "w+b")  # noqa: SIM115 - closed in close()
        self._set_rows()
        self._file.seek(0, os.SEEK_END)

    def _set_rows(self) -> None:
        self._file.seek(0)
        self._file.write(_npy_header(self.dtype, (self.rows, *self.item), self._size))

    def write(self, block: np.ndarray[Any, Any]) -> None:
        """Append rows, then state them in the header (so a crash loses at most this block)."""
        self._file.write(np.ascontiguousarray(block, dtype=self.dtype).data)
        self.rows += block.shape[0]
        self._set_rows()
        self._file.seek(0, os.SEEK_END)

    def close(self) -> None:
        self._file.close()


def rows_in(path: Path) -> int:
    """The complete rows of a ``.npy`` file written by :class:`_NpyWriter`; 0 if none."""
    if not path.exists():
        return 0
    return _read_header(path)[3]


class _Sink:
    """Collects results in order, into memory or ``.npy`` files.

    Args:
        spec: the model's spec.
        outputs: the outputs asked for (None: all).
        total: the input's row count, or None for an iterator.
        out: None (memory), one path, or output name -> path.
        resume: keep the rows the files already hold (``done`` starts there).
    """

    def __init__(
        self,
        spec: ModelSpec,
        outputs: Sequence[str] | None,
        total: int | None,
        out: Out,
        resume: bool,
    ) -> None:
        self.spec, self.total, self.done = spec, total, 0
        names = list(outputs) if outputs is not None else list(spec.outputs) or None
        self.paths: dict[str, Path] | None = None
        if isinstance(out, Mapping):
            self.paths = {str(k): Path(v) for k, v in out.items()}
            if names is not None and sorted(self.paths) != sorted(names):
                raise InvalidInputError(
                    f"out names {sorted(self.paths)} != outputs {sorted(names)}"
                )
        elif out is not None:
            if names is not None and len(names) != 1:
                raise InvalidInputError(
                    f"model {spec.name!r} has outputs {names}: give out as a dict name -> path, "
                    "or select one output"
                )
            self.paths = {names[0] if names else "": Path(out)}
        if resume:
            if self.paths is None:
                raise InvalidInputError("resume=True needs out= (the files to resume)")
            self._check_resumable(spec)
            self.done = min(rows_in(p) for p in self.paths.values())
            if total is not None and self.done > total:
                raise InvalidInputError(
                    f"cannot resume: the out files hold {self.done} rows, the input has {total}"
                )
        self.resumed = self.done
        self.arrays: dict[str, np.ndarray[Any, Any]] = {}
        self.parts: dict[str, list[np.ndarray[Any, Any]]] = {}
        self.writers: dict[str, _NpyWriter] = {}
        self._opened = False

    def _check_resumable(self, spec: ModelSpec) -> None:
        """Refuse, before anything is sent, files whose rows are not the model's outputs."""
        for name, path in (self.paths or {}).items():
            t = spec.outputs.get(name)
            if t is None or not path.exists():
                continue  # checked against the first result instead
            dtype, shape, _, _ = _read_header(path)
            want = DATATYPES.get(t.datatype)
            fits = len(shape) == len(t.shape) + 1 and all(
                d < 0 or d == s for s, d in zip(shape[1:], t.shape, strict=True)
            )
            if not fits or (want is not None and dtype != want):
                raise InvalidInputError(
                    f"cannot resume: {path} holds {dtype} rows of {list(shape[1:])}, "
                    f"output {name!r} is {t.datatype} rows of {list(t.shape)}"
                )

    def _open(self, result: InferResult) -> None:
        self._opened = True
        if self.paths is not None and "" in self.paths:  # one path, output name learnt now
            if len(result) != 1:
                raise InvalidInputError(f"results have outputs {list(result)}: give out as a dict")
            self.paths = {next(iter(result)): self.paths[""]}
        for name, arr in result.items():
            item = tuple(arr.shape[1:])
            if self.paths is not None:
                path = self.paths.get(name)
                if path is not None:  # an output without a path is not kept
                    self.writers[name] = _NpyWriter(path, arr.dtype, item, self.resumed)
            elif self.total is None:
                self.parts[name] = []
            else:
                self.arrays[name] = np.empty((self.total, *item), dtype=arr.dtype)

    def write(self, result: InferResult, rows: int) -> None:
        """Store the next ``rows`` rows' results."""
        if not self._opened:
            self._open(result)
        for name, arr in result.items():
            if arr.ndim == 0 or arr.shape[0] != rows:
                raise DecodeError(f"output {name!r}: {arr.shape} for a batch of {rows} rows")
        for name, arr in result.items():
            if name in self.arrays:
                self.arrays[name][self.done : self.done + rows] = arr
            elif name in self.parts:
                self.parts[name].append(arr)
            elif name in self.writers:
                self.writers[name].write(arr)
        self.done += rows

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()

    def result(self) -> BulkResult:
        """The rows done so far (all of them after a complete run); closes the files."""
        self.close()
        outputs: dict[str, np.ndarray[Any, Any]] = {}
        if self.paths is not None and "" not in self.paths:
            for name, path in self.paths.items():
                if path.exists():
                    outputs[name] = np.load(path, mmap_mode="r")[: self.done]
        for name, arr in self.arrays.items():
            outputs[name] = arr[: self.done]
        for name, parts in self.parts.items():
            outputs[name] = np.concatenate(parts)
        if not outputs and self.done == 0:  # no rows at all: empty outputs shaped from the spec
            for name, t in self.spec.outputs.items():
                shape = (0, *(max(d, 0) for d in t.shape))
                outputs[name] = np.empty(shape, dtype=DATATYPES.get(t.datatype, np.dtype(object)))
        paths = {n: p for n, p in (self.paths or {}).items() if n in outputs}
        return BulkResult(outputs, model_name=self.spec.name, rows=self.done, paths=paths)
