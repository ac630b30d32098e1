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

The input side (files, schemas, read tasks) is :mod:`service.ray.inputs`, the output side
(coverage, the writer) :mod:`service.ray.outputs`; this module runs the job.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from service.ray.inputs import (
    BLOCK_ROWS,
    ROWS_PER_TASK,
    check_schema,
    datasource,
    filesystem,
    list_inputs,
    plan_reads,
)
from service.ray.outputs import IncompleteOutput as IncompleteOutput
from service.ray.outputs import JobReport, check_complete, datasink, settle
from service.ray.scorer import ColumnForm, read_config

log = logging.getLogger(__name__)


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

    from service.ray.data import batch_rows, score

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
    before = [settle(fs_out, folder, f.rows) for f, folder in zip(files, folders, strict=True)]
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
        source = datasource(fs_in, files, tasks, block_rows)
        ds = ray.data.read_datasource(source, override_num_blocks=blocks)
        ds = score(ds, root, model, version=version, keep_inputs=keep_inputs,
                   batch_size=batch_rows(cfg, most=min(block_rows, rows_per_task)),
                   **score_args)  # fmt: skip
        ds.write_datasink(datasink(fs_out, folders))
    check_complete(fs_out, folders, [f.rows for f in files], [f.path for f in files])
    return JobReport(len(files), total, skipped, total - skipped, time.perf_counter() - t0,
                     output)  # fmt: skip
