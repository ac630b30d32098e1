"""The output side of ``bitserve score``: what is written already, the writer, the report.

Each input file ``NAME`` has an output folder of files named after the rows they hold,
``<start>-<stop>.parquet`` (:func:`output_name`). :func:`coverage` reads a folder back against
its input's rows (what to skip when a job is resumed, what is missing at the end:
:func:`check_complete`); :func:`datasink` is the Ray Datasink whose write tasks sort each
block by the rows' tags and write each run of consecutive rows as one file, whole under a
temporary name and then renamed (:func:`write_run`), so a file that exists is complete.
:func:`tensor_column` makes an output column as Ray Data's blocks hold it, for a writer
without Ray (:mod:`service.ray.bed_local`). Nothing here imports Ray or torch until used.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from service.ray.inputs import FILE_TAG, ROW_TAG

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.fs as pafs

log = logging.getLogger(__name__)

_OUTPUT_NAME = re.compile(r"(\d{12})-(\d{12})\.parquet")
TENSOR_EXTENSION = b"ray.data.arrow_tensor_v2"
"""The Arrow extension type of Ray Data's fixed-shape tensor columns (``ArrowTensorTypeV2``)."""


class IncompleteOutput(RuntimeError):
    """After the job, some input rows are not covered exactly once by the output files."""


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

    def line(self) -> str:
        """The line ``bitserve score`` prints at the end."""
        return (
            f"{self.output}: {self.scored} row(s) scored, {self.skipped} already there, "
            f"{self.files} file(s), {self.seconds:.1f} s ({self.rows_per_s:,.0f} rows/s)"
        )


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


def datasink(fs: pafs.FileSystem, folders: Sequence[str]) -> Any:
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


def settle(fs: pafs.FileSystem, folder: str, rows: int) -> Coverage:
    """An output folder's coverage, with duplicate files deleted."""
    cov = coverage(fs, folder, rows)
    for path in cov.dropped:
        log.warning("deleting %s: it overlaps another output file", path)
        fs.delete_file(path)
    return cov


def check_complete(
    fs: pafs.FileSystem, folders: Sequence[str], rows: Sequence[int], inputs: Sequence[str]
) -> None:
    """After a job: every input's rows (``rows``, from ``inputs``, written to ``folders``)
    are in its output files exactly once (duplicates are deleted, :func:`settle`).

    Raises:
        IncompleteOutput: naming the inputs and their missing rows.
    """
    short = [(path, c.missing) for path, folder, n in zip(inputs, folders, rows, strict=True)
             if (c := settle(fs, folder, n)).missing]  # fmt: skip
    if short:
        raise IncompleteOutput(f"rows missing from the output after the job: {short[:5]}")


def flat_array(values: np.ndarray) -> pa.Array:
    """A 1-D NumPy array as an Arrow array of its dtype, built on its buffer (no copy for a
    contiguous one): ``pa.array`` would import pandas to check its argument (0.2 s on a
    2-core host, a sixth of ``bitserve score``'s run on a .bed). Booleans (bits in Arrow)
    and other kinds go through ``pa.array``."""
    import pyarrow as pa

    if values.dtype.kind not in "iuf":
        return pa.array(values)
    data = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(data.dtype), len(data),
                                 [None, pa.py_buffer(data)])  # fmt: skip


def tensor_column(name: str, values: np.ndarray) -> tuple[pa.Field, pa.Array]:
    """An output column as the Ray path writes it (Ray Data's ``batch_to_block`` of the
    scorer's arrays), without importing Ray: ``(rows,)`` a column of its dtype; ``(rows,
    *shape)`` Ray Data's fixed-shape tensor column, a ``large_list`` of the dtype whose field
    metadata names the extension type and its shape (JSON). Where Ray is imported it is read
    back as that type; elsewhere as the ``large_list``. ``tests/ray/test_bed_local.py`` checks
    it against Ray's own conversion.
    """
    import pyarrow as pa

    if values.ndim == 1:
        return pa.field(name, pa.from_numpy_dtype(values.dtype)), flat_array(values)
    shape = list(values.shape[1:])
    width = math.prod(shape)
    offsets = flat_array(np.arange(0, len(values) * width + 1, width, dtype=np.int64))
    column = pa.LargeListArray.from_arrays(offsets, flat_array(values.reshape(-1)))
    metadata = {b"ARROW:extension:metadata": json.dumps(shape).encode(),
                b"ARROW:extension:name": TENSOR_EXTENSION}  # fmt: skip
    return pa.field(name, column.type, metadata=metadata), column
