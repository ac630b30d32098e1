"""Scoring columns of packed rows with a model of a repository: the server's pipeline, no server.

:class:`BatchScorer` is a Ray Data batch callable (``Dataset.map_batches``) and works as well on
its own: it loads one model version as ``bitserve serve`` loads it
(:func:`service.models.builder.build_version`: the same files, checks, backend and dry run),
keeps it resident on its device, and computes each batch of rows as the server computes one
request: the model's :class:`~service.models.signature.Signature` checks and lays out the inputs,
and :meth:`service.models.pipeline.Pipeline.run` unpacks the bits on the device, applies the
operator and the model. Nothing of the computation is reimplemented here; this module only turns
table columns into the server's request tensors and its outputs back into columns.

Columns: one per model input, named after it, one item per row. A bit-packed input
(``packing = "bits"``) holds an item's packed bytes (``ceil(L / 8)`` per row of the logical
shape, packed along the last axis with the model's ``bitorder``): Arrow ``binary`` or
``fixed_size_binary`` (NumPy object arrays of ``bytes``), a fixed-size or variable list of
``uint8`` (object arrays of ``uint8`` arrays), or a uint8 tensor column ``(rows, ...)``. Any
other input holds its item in its datatype's NumPy dtype. Every output becomes a column named
after it, one item's tensor ``(rows, *shape)`` per row; every column that is not an input
passes through unchanged.

Batches are NumPy columns (Ray's ``"numpy"`` format) or an Arrow table (``"pyarrow"``, what
:func:`service.ray.score` asks for): from a table, packed ``binary``, ``fixed_size_binary``
and fixed-size list columns are read as NumPy views of their Arrow buffers (no copy,
:meth:`ColumnForm.arrow_view`), any other column is converted as Ray converts it for NumPy
batches, and the columns that pass through are not touched.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.errors import InvalidInput
from service.models.config import (
    DEFAULT_MAX_BATCH_BYTES,
    DEFAULT_MAX_OPERATOR_BYTES,
    ConfigError,
    InputConfig,
    ModelConfig,
    load_config,
)
from service.models.layout import VersionSource, model_versions
from service.models.signature import Signature
from service.protocol.types import DATATYPES, InferRequest, RequestInput
from service.ray.errors import ScoringError as ScoringError

if TYPE_CHECKING:
    import pyarrow as pa

Batch = dict[str, np.ndarray[Any, Any]]
"""A batch in Ray Data's NumPy batch format: column name -> array, rows first."""


def find_version(repository: Path, model: str, version: str | None = None) -> VersionSource:
    """Where a model version lives: ``version``, or the model's highest one (what a request
    without a version gets from the server).

    Raises:
        ScoringError: no such model or version (the repository's own message).
    """
    try:
        versions = model_versions(Path(repository), model)
    except ConfigError as exc:
        raise ScoringError("; ".join(exc.problems)) from None
    if not versions:
        raise ScoringError(f"{Path(repository).name}/{model}: no version of the model")
    chosen = max(versions, key=int) if version is None else version
    if chosen not in versions:
        raise ScoringError(
            f"{Path(repository).name}/{model}: no version {version} (versions: "
            f"{sorted(versions, key=int)})"
        )
    return versions[chosen]


def read_config(
    repository: Path, model: str, version: str | None = None
) -> tuple[str, ModelConfig]:
    """A model version (``version``, or the highest) and its ``config.toml``, read and
    validated (cheap: no other file, no device).

    Raises:
        ScoringError: no such model or version, or an invalid config.
    """
    src = find_version(repository, model, version)
    try:
        return src.version, load_config(src.checked_config_path(), src.source)
    except ConfigError as exc:
        raise ScoringError("; ".join(exc.problems)) from None


@dataclass(frozen=True)
class ColumnForm:
    """What one model input's column must hold, per row.

    Attributes:
        spec: the input's config.
        datatype: the V2 datatype its rows become (``UINT8`` for a bit-packed input).
        shape: one row's item in that datatype (the packed shape for a bit-packed input).
    """

    spec: InputConfig
    datatype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, spec: InputConfig) -> ColumnForm:
        if spec.packing in ("bits", "codes"):
            return cls(spec, "UINT8", tuple(spec.packed_shape))
        return cls(spec, spec.datatype, tuple(spec.shape))

    @property
    def dtype(self) -> np.dtype[Any]:
        return DATATYPES[self.datatype]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> str:
        """What a row holds, for messages."""
        if self.spec.packing == "codes":
            return f"{self.row_bytes} bytes of {self.spec.code_bits}-bit codes"
        if self.spec.packing == "bits":
            return (
                f"{self.row_bytes} packed bytes (bits of {self.spec.shape}, "
                f"bitorder {self.spec.bitorder})"
            )
        return f"{self.datatype} {list(self.shape)}"

    def array(self, values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """A column as ``(rows, *shape)`` of the datatype's dtype; zero-copy for a tensor
        column, one copy for a column of bytes or of per-row arrays.

        Raises:
            ScoringError: a row of the wrong size or type, or a null, naming the row.
        """
        name = self.spec.name
        rows = len(values)
        if values.dtype != object:
            if values.dtype != self.dtype or math.prod(values.shape[1:]) != math.prod(self.shape):
                raise ScoringError(
                    f"column '{name}' holds {values.dtype} {list(values.shape[1:])} per row; "
                    f"the model's input '{name}' takes {self.describe()}"
                )
            return np.ascontiguousarray(values).reshape(rows, *self.shape)
        for i, v in enumerate(values):
            if isinstance(v, bytes | bytearray | memoryview):
                if len(v) != self.row_bytes:
                    raise self._bad_row(i, f"{len(v)} bytes")
            elif isinstance(v, np.ndarray):
                if v.dtype != self.dtype or v.size != math.prod(self.shape):
                    raise self._bad_row(i, f"{v.dtype} {list(v.shape)}")
            else:
                raise self._bad_row(i, "null" if v is None else type(v).__name__)
        if rows and isinstance(values[0], bytes | bytearray | memoryview):
            if not all(isinstance(v, bytes | bytearray | memoryview) for v in values):
                raise ScoringError(f"column '{name}' mixes bytes and arrays")
            flat = np.frombuffer(b"".join(values), dtype=self.dtype)
            return flat.reshape(rows, *self.shape)
        if not rows:
            return np.empty((0, *self.shape), self.dtype)
        return np.stack([np.asarray(v).reshape(self.shape) for v in values])

    def arrow_view(self, column: pa.Array | pa.ChunkedArray) -> np.ndarray[Any, Any] | None:
        """An Arrow column as ``(rows, *shape)`` of the datatype's dtype, a view of its
        buffer (no copy): ``binary`` rows of exactly :attr:`row_bytes` each,
        ``fixed_size_binary[row_bytes]``, or a fixed-size list of the dtype, without nulls
        (a column of several chunks is joined first). None for any other column: the caller
        converts it as Ray does and :meth:`array` checks each row."""
        import pyarrow as pa

        if isinstance(column, pa.ChunkedArray):
            column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
        n, width, t = len(column), self.row_bytes, column.type
        if column.null_count:
            return None
        if n == 0:
            return np.empty((0, *self.shape), self.dtype)
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            kind = np.int64 if pa.types.is_large_binary(t) else np.int32
            bounds = np.frombuffer(
                column.buffers()[1], kind, n + 1, column.offset * kind(0).itemsize
            )
            if not (np.diff(bounds) == width).all():
                return None
            data = np.frombuffer(column.buffers()[2], np.uint8, n * width, int(bounds[0]))
        elif pa.types.is_fixed_size_binary(t) and t.byte_width == width:
            data = np.frombuffer(column.buffers()[1], np.uint8, n * width, column.offset * width)
        elif (
            pa.types.is_fixed_size_list(t)
            and t.list_size == math.prod(self.shape)
            and t.value_type == pa.from_numpy_dtype(self.dtype)
            and column.flatten().null_count == 0
        ):
            flat: np.ndarray[Any, Any] = column.flatten().to_numpy()
            return flat.reshape(n, *self.shape)
        else:
            return None
        return data.view(self.dtype).reshape(n, *self.shape)

    def _bad_row(self, i: int, got: str) -> ScoringError:
        return ScoringError(
            f"column '{self.spec.name}', row {i} of the batch: {got}; the model's input "
            f"'{self.spec.name}' takes {self.describe()} per row"
        )


class BatchScorer:
    """A model of a repository, resident on its device, scoring batches of rows.

    Use it as a Ray Data callable class (one model per actor)::

        ds.map_batches(BatchScorer, fn_constructor_kwargs={"repository": "models/",
                       "model": "fingerprint"}, batch_size=..., batch_format="numpy")

    (:func:`service.ray.score` does exactly that, with the batch size and actors chosen for
    the model and the cluster), or call it on a dict of NumPy columns.

    Args:
        repository: the model repository folder (as for ``bitserve serve``).
        model: the model's name.
        version: the version; None: the highest.
        device: where a config that says ``device = "auto"`` goes: ``auto`` (the GPU Ray
            gave this actor, else the CPU), ``cpu``, ``cuda``, ``cuda:N``.
        bitorder: the bit order of every packed column (``big``, ``little``); None: the
            model's ``bitorder``.
        parameters: the request parameters of every batch, as a V2 request's (an index's
            ``k`` and ``threshold``: its ids and scores columns then hold ``k`` per row).
        keep_inputs: also pass the input columns through (by default they are dropped: a
            result holds the outputs and every other column).
        max_operator_bytes, max_batch_bytes: the server's limits (``BITSERVE_MAX_*``).
        torch_threads: intra-op threads; None: the CPUs Ray gave this actor (inside Ray),
            else torch's default.

    Raises:
        ScoringError: no such model, or it fails to load (every problem, as ``check-repo``
            says it).
    """

    def __init__(
        self,
        repository: str | Path,
        model: str,
        *,
        version: str | None = None,
        device: str = "auto",
        bitorder: str | None = None,
        parameters: Mapping[str, Any] | None = None,
        keep_inputs: bool = False,
        max_operator_bytes: int = DEFAULT_MAX_OPERATOR_BYTES,
        max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
        torch_threads: int | None = None,
    ) -> None:
        from service.models.builder import build_version
        from service.models.devices import set_torch_threads

        threads = torch_threads if torch_threads is not None else ray_cpus()
        if threads is not None:
            set_torch_threads(threads, 1)
        src = find_version(Path(repository), model, version)
        try:
            cfg, pipeline = build_version(
                model,
                src,
                default_device=device,
                max_operator_bytes=max_operator_bytes,
                max_batch_bytes=max_batch_bytes,
            )
        except ConfigError as exc:
            raise ScoringError("; ".join(exc.problems)) from None
        self.model = model
        self.version = src.version
        self.pipeline = pipeline
        self.signature = Signature(model, cfg, pipeline.output_shapes)
        self.forms = [ColumnForm.of(spec) for spec in cfg.inputs]
        self.outputs = [o.name for o in cfg.outputs]
        self._parameters = {} if bitorder is None else {"bitorder": bitorder}
        self._request_parameters = dict(parameters or {})
        self._keep_inputs = keep_inputs
        self._inputs = {f.spec.name for f in self.forms}

    @property
    def batch_size(self) -> int:
        """The rows computed at once: the model's ``max_batch_size`` (1 without batching)."""
        return self.pipeline.capacity

    def __call__(self, batch: Mapping[str, np.ndarray[Any, Any]] | pa.Table) -> Batch | pa.Table:
        """Score one batch.

        Args:
            batch: NumPy columns, rows first (Ray's ``"numpy"`` batches), or an Arrow table
                (its ``"pyarrow"`` batches): one column per model input (see the module),
                any others passed through.

        Returns:
            the batch's kind: the pass-through columns (and the inputs with
            ``keep_inputs``), then one column per output: ``(rows, *shape)`` in the output's
            datatype (in a table, as Ray Data converts such an array: a tensor column).

        Raises:
            ScoringError: a missing input column, a row of the wrong size, an output name
                that is also a pass-through column, or a request the model refuses (its
                message, as the server's 400).
        """
        if not isinstance(batch, Mapping):
            return self._score_table(batch)
        self._check_columns(list(batch))
        out: Batch = {k: v for k, v in batch.items() if self._keep_inputs or k not in self._inputs}
        out.update(self._score([f.array(np.asarray(batch[f.spec.name])) for f in self.forms]))
        return out

    def _score_table(self, table: pa.Table) -> pa.Table:
        """:meth:`__call__` on an Arrow table: packed columns read in place (no copy, see
        :meth:`ColumnForm.arrow_view`), the other columns left as they are."""
        from ray.data.block import BlockAccessor

        self._check_columns(table.column_names)
        columns = []
        for f in self.forms:
            column = table.column(f.spec.name)
            view = f.arrow_view(column)
            if view is None:  # converted as Ray converts it for NumPy batches
                one = BlockAccessor.for_block(table.select([f.spec.name]))
                view = f.array(np.asarray(one.to_batch_format("numpy")[f.spec.name]))
            columns.append(view)
        out = table if self._keep_inputs else table.drop_columns(list(self._inputs))
        scored = BlockAccessor.batch_to_block(self._score(columns))
        for name in self.outputs:
            out = out.append_column(scored.schema.field(name), scored.column(name))
        return out

    def _check_columns(self, names: list[str]) -> None:
        missing = [f.spec.name for f in self.forms if f.spec.name not in names]
        if missing:
            raise ScoringError(
                f"model '{self.model}' needs column(s) {missing}; the batch has {sorted(names)}"
            )
        passed = names if self._keep_inputs else [n for n in names if n not in self._inputs]
        clash = sorted(set(passed) & set(self.outputs))
        if clash:
            raise ScoringError(
                f"column(s) {clash} would be overwritten by the model's outputs of the same "
                "name; rename them (or drop them) first"
            )

    def _score(self, columns: list[np.ndarray[Any, Any]]) -> Batch:
        """Every output of the rows of ``columns`` (one per input, ``(rows, *shape)``), run
        ``max_batch_size`` rows at a time."""
        rows = len(columns[0])
        results: list[list[np.ndarray[Any, Any]]] = [[] for _ in self.outputs]
        step = self.batch_size if self.signature.batched else 1
        for start in range(0, rows, step):
            parts = [c[start : start + step] for c in columns]
            for i, arr in enumerate(self._run(parts)):
                results[i].append(arr)
        out: Batch = {}
        for name, shape, parts in zip(
            self.outputs, self.signature.output_shapes, results, strict=True
        ):
            dtype = DATATYPES[self.signature.outputs[self.outputs.index(name)].datatype]
            out[name] = (
                np.concatenate(parts) if len(parts) > 1
                else parts[0] if parts else np.empty((0, *shape), dtype)
            )  # fmt: skip
        return out

    def _run(self, parts: list[np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
        """One request of ``len(parts[0])`` rows through the signature and the pipeline."""
        batched = self.signature.batched
        inputs = []
        for form, data in zip(self.forms, parts, strict=True):
            item = data if batched else data[0]
            try:
                self.signature.check_input(form.spec.name, form.datatype, item.shape)
            except InvalidInput as exc:
                raise ScoringError(exc.message) from None
            inputs.append(
                RequestInput(form.spec.name, form.datatype, item.shape, item, self._parameters)
            )
        try:
            request = InferRequest(id=None, inputs=inputs, parameters=self._request_parameters)
            bound = self.signature.bind(request)
        except InvalidInput as exc:
            raise ScoringError(exc.message) from None
        arrays = self.pipeline.run([bound])[0]
        return arrays if batched else [a[np.newaxis] for a in arrays]

    def __repr__(self) -> str:
        return f"BatchScorer({self.model!r}, version={self.version}, {self.pipeline!r})"


def ray_cpus() -> int | None:
    """The CPUs Ray assigned to this worker (whole ones, at least 1), or None outside Ray
    (where Ray is not even imported: importing it takes seconds)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    return None if not cpus else max(1, int(cpus))
