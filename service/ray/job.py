"""``bitserve score``: Parquet files of packed rows scored on Ray Data, resumable.

The input is one Parquet file or a folder of them (any filesystem pyarrow opens: a local path,
``s3://``, ``gs://``, ``hdfs://``). Each input file ``NAME.parquet`` gets an output folder
``OUTPUT/NAME/`` of files named after the rows they hold, ``<start>-<stop>.parquet`` (rows
``start`` to ``stop - 1`` of the input file, in order, 12 digits each). A file is written
whole under a temporary name and then renamed, so a file that exists is complete; a job that
stopped (a crash, Ctrl-C, a lost cluster) is resumed by running the same command again: the
rows already in an output file are skipped, only the others are read and scored.

The rows flow through Ray Data: read tasks read the missing row ranges (row groups, sliced)
and tag each row with its file and row number; :func:`service.ray.data.score` scores them on
the model's actors; write tasks sort each block by those tags and write each run of
consecutive rows as one output file. A write task that Ray retries (its node died) writes
the same rows under the same names again, and a node lost mid-job loses no rows: Ray Data
retries its tasks and restarts its actors elsewhere. At the end, every input file's rows must
be covered exactly once by its output files (else :class:`IncompleteOutput`).
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.ray.scorer import ColumnForm, ScoringError, read_config

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

log = logging.getLogger(__name__)

FILE_TAG = "__bitserve_file"
ROW_TAG = "__bitserve_row"
ROWS_PER_TASK = 256 * 1024
"""Rows one read task reads (whole row groups, or slices of one): 64 MiB of 256-byte rows."""
BLOCK_ROWS = 64 * 1024
"""Rows of one block a read task yields (Ray's unit of work between stages)."""
_OUTPUT_NAME = re.compile(r"(\d{12})-(\d{12})\.parquet")


class IncompleteOutput(RuntimeError):
    """After the job, some input rows are not covered exactly once by the output files."""


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
        if form.spec.packing == "bits":
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


# --- what is written already ---------------------------------------------------------------


@dataclass
class Coverage:
    """An input file's rows against its output folder.

    Attributes:
        kept: ``(start, stop)`` of the output files that count, in order, disjoint.
        dropped: output files that overlap a kept one (a duplicate write), to delete.
        missing: ``(start, stop)`` ranges no output file holds yet.
    """

    kept: list[tuple[int, int]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    missing: list[tuple[int, int]] = field(default_factory=list)

    @property
    def done(self) -> int:
        return sum(b - a for a, b in self.kept)


def output_name(start: int, stop: int) -> str:
    """The name of the output file of rows ``start`` to ``stop - 1``."""
    return f"{start:012d}-{stop:012d}.parquet"


def coverage(fs: pafs.FileSystem, folder: str, rows: int) -> Coverage:
    """What ``folder`` (an input file's output folder) holds of its ``rows`` rows.

    Leftover temporary files (of a write that never finished) are deleted. Files are taken
    by start, the longest first; one that overlaps an earlier one is dropped, so the kept
    ones never hold a row twice.
    """
    import pyarrow.fs as pafs

    found: list[tuple[int, int, str]] = []
    info = fs.get_file_info(folder)
    if info.type == pafs.FileType.Directory:
        for entry in fs.get_file_info(pafs.FileSelector(folder)):
            base = entry.path.rsplit("/", 1)[-1]
            if base.startswith(".") and ".tmp-" in base:
                fs.delete_file(entry.path)
                continue
            m = _OUTPUT_NAME.fullmatch(base)
            if m and entry.type == pafs.FileType.File:
                a, b = int(m.group(1)), int(m.group(2))
                if 0 <= a < b <= rows:
                    found.append((a, b, entry.path))
    cov = Coverage()
    end = 0
    for a, b, path in sorted(found, key=lambda t: (t[0], -t[1])):
        if a < end:
            cov.dropped.append(path)
            continue
        if a > end:
            cov.missing.append((end, a))
        cov.kept.append((a, b))
        end = b
    if end < rows:
        cov.missing.append((end, rows))
    return cov


# --- reading --------------------------------------------------------------------------------


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


def _read_segments(
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


def _datasource(
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
                read = functools.partial(_read_segments, fs, f.path, f.groups, task, block_rows)
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


# --- writing --------------------------------------------------------------------------------


def _runs(table: pa.Table) -> Iterator[tuple[int, int, int, pa.Table]]:
    """A block's rows as runs of consecutive rows of one file: ``(file, start, stop, rows)``,
    the tags dropped."""
    files = table.column(FILE_TAG).to_numpy()
    rows = table.column(ROW_TAG).to_numpy()
    order = np.lexsort((rows, files))
    if not np.array_equal(order, np.arange(len(order))):
        table, files, rows = table.take(order), files[order], rows[order]
    body = table.drop_columns([FILE_TAG, ROW_TAG])
    breaks = np.flatnonzero((np.diff(files) != 0) | (np.diff(rows) != 1)) + 1
    bounds = [0, *breaks.tolist(), len(rows)]
    for lo, hi in itertools.pairwise(bounds):
        if hi > lo:
            yield int(files[lo]), int(rows[lo]), int(rows[hi - 1]) + 1, body.slice(lo, hi - lo)


def write_run(fs: pafs.FileSystem, folder: str, start: int, stop: int, table: pa.Table) -> str:
    """Write one run of rows as ``folder/<start>-<stop>.parquet``: under a temporary name,
    then renamed (a file that exists is whole; the same rows written again replace it)."""
    import pyarrow.parquet as pq

    fs.create_dir(folder, recursive=True)
    final = f"{folder}/{output_name(start, stop)}"
    tmp = f"{folder}/.{output_name(start, stop)}.tmp-{uuid.uuid4().hex}"
    pq.write_table(table, tmp, filesystem=fs)
    fs.move(tmp, final)
    return final


def _datasink(fs: pafs.FileSystem, folders: Sequence[str]) -> Any:
    """A Ray Datasink writing each block's runs of rows to their input file's folder."""
    from ray.data.block import BlockAccessor
    from ray.data.datasource import Datasink

    class RowRangesDatasink(Datasink[list[tuple[int, int, int]]]):
        def get_name(self) -> str:
            return "WriteRowRanges"

        def write(self, blocks: Iterable[Any], ctx: Any) -> list[tuple[int, int, int]]:
            written = []
            for block in blocks:
                table = BlockAccessor.for_block(block).to_arrow()
                if table.num_rows == 0:
                    continue
                for file, start, stop, rows in _runs(table):
                    write_run(fs, folders[file], start, stop, rows)
                    written.append((file, start, stop))
            return written

    return RowRangesDatasink()


# --- the job --------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobReport:
    """What a job did.

    Attributes:
        files: input files.
        rows: their rows.
        skipped: rows already in output files when it started.
        scored: rows it scored and wrote.
        seconds: its wall time (planning, scoring and writing).
        output: the output folder.
    """

    files: int
    rows: int
    skipped: int
    scored: int
    seconds: float
    output: str

    @property
    def rows_per_s(self) -> float:
        return self.scored / self.seconds if self.seconds > 0 else math.inf


def score_files(
    input: str,
    output: str,
    repository: str | Path,
    model: str,
    *,
    version: str | None = None,
    rows_per_task: int = ROWS_PER_TASK,
    block_rows: int = BLOCK_ROWS,
    keep_inputs: bool = False,
    **score_args: Any,
) -> JobReport:
    """Score every row of ``input`` (a Parquet file or folder) into ``output``, skipping the
    rows already there; Ray must be initialized (``ray.init``).

    Args:
        input, output: paths or URIs (see the module).
        repository, model, version: the model (see :func:`service.ray.data.score`).
        rows_per_task, block_rows: the read tasks' and blocks' rows.
        keep_inputs: keep the input columns in the output.
        score_args: the rest of :func:`service.ray.data.score`'s options (``bitorder``,
            ``device``, ``actors``, ``num_gpus``, ``num_cpus``, ``ray_remote_args``...).

    Raises:
        ScoringError: a missing input, a model that cannot be read, or a column that does
            not fit the model (all before any actor starts).
        IncompleteOutput: the job ended but some rows are not in the output (a bug).
    """
    import ray

    from service.ray.data import score

    t0 = time.perf_counter()
    fs_in, in_path = filesystem(input)
    fs_out, out_path = filesystem(output)
    files = list_inputs(fs_in, in_path)
    root = Path(repository).resolve()
    version, cfg = read_config(root, model, version)
    forms = [ColumnForm.of(spec) for spec in cfg.inputs]
    outputs = [o.name for o in cfg.outputs]
    for f in files:
        check_schema(f, forms, outputs, keep_inputs)
    folders = [f"{out_path}/{f.name}" for f in files]
    before = [_settle(fs_out, folder, f.rows) for f, folder in zip(files, folders, strict=True)]
    tasks = plan_reads(files, [c.missing for c in before], rows_per_task)
    skipped = sum(c.done for c in before)
    total = sum(f.rows for f in files)
    log.info(
        "%d file(s), %d rows: %d already in %s, %d to score in %d read task(s)",
        len(files), total, skipped, output, total - skipped, len(tasks),
    )  # fmt: skip
    if tasks:
        # Blocks of about block_rows rows: Ray's default aims at 200 blocks or more and splits
        # smaller ones, whose per-task cost then outweighs a batch's work.
        blocks = max(len(tasks), math.ceil((total - skipped) / block_rows))
        source = _datasource(fs_in, files, tasks, block_rows)
        ds = ray.data.read_datasource(source, override_num_blocks=blocks)
        ds = score(ds, root, model, version=version, keep_inputs=keep_inputs, **score_args)
        ds.write_datasink(_datasink(fs_out, folders))
    after = [_settle(fs_out, folder, f.rows) for f, folder in zip(files, folders, strict=True)]
    short = [(f.path, c.missing) for f, c in zip(files, after, strict=True) if c.missing]
    if short:
        raise IncompleteOutput(f"rows missing from the output after the job: {short[:5]}")
    return JobReport(len(files), total, skipped, total - skipped, time.perf_counter() - t0,
                     output)  # fmt: skip


def _settle(fs: pafs.FileSystem, folder: str, rows: int) -> Coverage:
    """An output folder's coverage, with duplicate files deleted."""
    cov = coverage(fs, folder, rows)
    for path in cov.dropped:
        log.warning("deleting %s: it overlaps another output file", path)
        fs.delete_file(path)
    return cov
