"""The input side of ``bitserve score``: Parquet files, their schemas, and the read tasks.

:func:`list_inputs` finds the input files (one, or a folder's, on any filesystem pyarrow
opens) with their row groups; :func:`check_schema` checks each against the model's inputs
before any actor starts; :func:`plan_reads` cuts the rows still to score into read tasks of
whole row groups or slices of one, and :func:`datasource` makes them a Ray Datasource whose
tasks (:func:`read_segments`) tag every row with its file and row number (:data:`FILE_TAG`,
:data:`ROW_TAG`), which the writer (:mod:`service.ray.outputs`) sorts and names files by.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.ray.errors import ScoringError

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

    from service.ray.scorer import ColumnForm

FILE_TAG = "__bitserve_file"
ROW_TAG = "__bitserve_row"
ROWS_PER_TASK = 256 * 1024
"""Rows one read task reads (whole row groups, or slices of one): 64 MiB of 256-byte rows."""
BLOCK_ROWS = 64 * 1024
"""Rows of one block a read task yields (Ray's unit of work between stages)."""


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem of a path or URI, and the path in it (local paths absolute)."""
    import pyarrow.fs as pafs

    if "://" in location:
        fs, path = pafs.FileSystem.from_uri(location)
        return fs, path.rstrip("/")
    return pafs.LocalFileSystem(), str(Path(location).resolve())


@dataclass(frozen=True)
class InputFile:
    """One input Parquet file.

    Attributes:
        path: its path in the input filesystem.
        name: its output folder's name (its path below the input folder, without
            ``.parquet``).
        groups: the rows of each of its row groups.
        schema: its Arrow schema.
    """

    path: str
    name: str
    groups: tuple[int, ...]
    schema: pa.Schema

    @property
    def rows(self) -> int:
        return sum(self.groups)


def list_inputs(fs: pafs.FileSystem, path: str) -> list[InputFile]:
    """The Parquet files at ``path`` (a file, or a folder searched recursively for
    ``*.parquet``, hidden entries skipped), sorted, with their row groups and schemas.

    Raises:
        ScoringError: nothing there, or no Parquet file in the folder.
    """
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise ScoringError(f"{path}: no such file or folder")
    if info.type == pafs.FileType.File:
        found = [(path, Path(path).name)]
    else:
        selector = pafs.FileSelector(path, recursive=True)
        found = []
        for entry in fs.get_file_info(selector):
            rel = entry.path[len(path) :].lstrip("/")
            if entry.type != pafs.FileType.File or not rel.endswith(".parquet"):
                continue
            if any(part.startswith((".", "_")) for part in rel.split("/")):
                continue
            found.append((entry.path, rel))
        if not found:
            raise ScoringError(f"{path}: no .parquet file in the folder")
    files = []
    for file_path, rel in sorted(found):
        with fs.open_input_file(file_path) as f:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
        groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        files.append(InputFile(file_path, rel.removesuffix(".parquet"), groups, schema))
    return files


def check_schema(
    file: InputFile, forms: Sequence[ColumnForm], outputs: Sequence[str], keep_inputs: bool
) -> None:
    """Whether a file's columns can be scored: every model input present in a form its rows
    can hold, and no output name taken by a column that passes through.

    Raises:
        ScoringError: naming the file, the column and what it holds.
    """
    import pyarrow as pa

    names = file.schema.names
    for form in forms:
        col = form.spec.name
        if col not in names:
            raise ScoringError(
                f"{file.path}: no column '{col}' for the model's input '{col}' "
                f"({form.describe()} a row); the file's columns: {names}"
            )
        t = file.schema.field(col).type
        if form.spec.packing in ("bits", "codes"):
            ok = pa.types.is_binary(t) or pa.types.is_large_binary(t)
            if pa.types.is_fixed_size_binary(t):
                ok = t.byte_width == form.row_bytes
            elif pa.types.is_fixed_size_list(t):
                ok = t.value_type == pa.uint8() and t.list_size == form.row_bytes
            elif pa.types.is_list(t) or pa.types.is_large_list(t):
                ok = t.value_type == pa.uint8()
        else:
            ok = True  # numeric rows of any layout; checked per batch by the scorer
        if not ok:
            raise ScoringError(
                f"{file.path}: column '{col}' is {t}; the model's input '{col}' takes "
                f"{form.describe()} a row (binary, fixed_size_binary[{form.row_bytes}] or "
                "a list of uint8)"
            )
    passed = set(names) if keep_inputs else set(names) - {f.spec.name for f in forms}
    clash = sorted((passed & set(outputs)) | ({FILE_TAG, ROW_TAG} & set(names)))
    if clash:
        raise ScoringError(
            f"{file.path}: column(s) {clash} have the name of a model output (or of a tag "
            "the job adds); rename them first"
        )


@dataclass(frozen=True)
class Segment:
    """Rows ``start`` to ``stop - 1`` of an input file, all in row group ``group``."""

    file: int
    group: int
    start: int
    stop: int


def plan_reads(
    files: Sequence[InputFile], missing: Sequence[Sequence[tuple[int, int]]], rows_per_task: int
) -> list[list[Segment]]:
    """The read tasks: the missing rows of each file, cut at row groups and gathered into
    tasks of about ``rows_per_task`` rows (a task reads one file)."""
    tasks: list[list[Segment]] = []
    for i, (f, gaps) in enumerate(zip(files, missing, strict=True)):
        task: list[Segment] = []
        rows = 0
        group_start = 0
        for g, n in enumerate(f.groups):
            group_stop = group_start + n
            for a, b in gaps:
                lo, hi = max(a, group_start), min(b, group_stop)
                while lo < hi:
                    take = min(hi - lo, rows_per_task - rows)
                    task.append(Segment(i, g, lo, lo + take))
                    rows += take
                    lo += take
                    if rows >= rows_per_task:
                        tasks.append(task)
                        task, rows = [], 0
            group_start = group_stop
        if task:
            tasks.append(task)
    return tasks


def read_segments(
    fs: pafs.FileSystem, path: str, groups: Sequence[int], segments: Sequence[Segment],
    block_rows: int,
) -> Iterator[pa.Table]:  # fmt: skip
    """A read task: each segment's rows, tagged with the file and row numbers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    starts = np.concatenate([[0], np.cumsum(groups)]).tolist()
    with fs.open_input_file(path) as f:
        pf = pq.ParquetFile(f)
        cache: tuple[int, pa.Table] | None = None
        for seg in segments:
            if cache is None or cache[0] != seg.group:
                cache = (seg.group, pf.read_row_group(seg.group))
            table = cache[1].slice(seg.start - starts[seg.group], seg.stop - seg.start)
            for lo in range(0, table.num_rows, block_rows):
                part = table.slice(lo, block_rows)
                first = seg.start + lo
                rows = np.arange(first, first + part.num_rows, dtype=np.int64)
                part = part.append_column(FILE_TAG, pa.array(np.full(len(rows), seg.file,
                                                                     dtype=np.int32)))  # fmt: skip
                yield part.append_column(ROW_TAG, pa.array(rows))


def datasource(
    fs: pafs.FileSystem, files: Sequence[InputFile], tasks: Sequence[Sequence[Segment]],
    block_rows: int,
) -> Any:  # fmt: skip
    """A Ray Datasource of the read tasks (one ReadTask each)."""
    import functools

    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    def size(task: Sequence[Segment]) -> int:
        return sum((s.stop - s.start) * _row_size(files[s.file]) for s in task)

    class PackedRowsDatasource(Datasource):
        def get_name(self) -> str:
            return "ReadPackedRows"

        def estimate_inmemory_data_size(self) -> int:
            return sum(size(t) for t in tasks)

        def get_read_tasks(
            self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
        ) -> list[ReadTask]:
            out = []
            for task in tasks:
                f = files[task[0].file]
                meta = BlockMetadata(
                    num_rows=sum(s.stop - s.start for s in task),
                    size_bytes=size(task),
                    exec_stats=None,
                    input_files=(f.path,),
                )
                read = functools.partial(read_segments, fs, f.path, f.groups, task, block_rows)
                out.append(ReadTask(read, meta, per_task_row_limit=per_task_row_limit))
            return out

    return PackedRowsDatasource()  # type: ignore[no-untyped-call]


def _row_size(f: InputFile) -> int:
    """A rough size of one row in memory (for Ray's planning): fixed-width columns' widths,
    256 bytes for each variable one."""
    import pyarrow as pa

    total = 16  # the two tags
    for t in f.schema.types:
        width = t.byte_width if pa.types.is_fixed_size_binary(t) else None
        if width is None:
            try:
                width = t.bit_width // 8
            except ValueError:
                width = 256
        total += max(width, 1)
    return total
