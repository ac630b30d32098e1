"""A PLINK ``.bed`` as the input of ``bitserve score`` on Ray: one Parquet row per sample.

``bitserve score --ray ... DATA.bed OUTPUT/`` (with ``DATA.bim`` and ``DATA.fam`` beside it;
``--ray`` or ``--address``: without either the ``.bed`` is scored in the process, into the
same files, :mod:`service.ray.bed_local`) scores a genotype model (``bitserve genotypes
score-model``) on Ray Data as it scores Parquet: the ``.bed`` is first written as
``DATA.parquet`` in a private temporary folder, with the columns ``FID`` and ``IID`` (passed
through to the output) and the model's input, each sample's 2-bit codes as
``fixed_size_binary`` (:func:`service.genotypes.plink_files.sample_rows`); the output is
then ``OUTPUT/DATA/<start>-<stop>.parquet`` as for any input file, its rows in ``.fam``
order. The data's variants are checked against the model's ``ids_sha256`` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from service.genotypes.plink_files import check_variants, open_bed, read_bim, read_fam, sample_rows
from service.ray.errors import ScoringError

if TYPE_CHECKING:
    import pyarrow as pa

    from service.models.config import InputConfig, ModelConfig

ROW_GROUP = 4096
"""Samples per Parquet row group (and per transpose step)."""


def genotype_input(bed: Path, cfg: ModelConfig) -> InputConfig:
    """The model's one input, which a ``.bed``'s samples become.

    Raises:
        ScoringError: not a one-input codes model.
    """
    if len(cfg.inputs) != 1 or cfg.inputs[0].packing != "codes":
        raise ScoringError(f"{bed}: a .bed input needs a genotype model (one codes input)")
    return cfg.inputs[0]


def codes_column(codes: np.ndarray) -> pa.Array:
    """Samples' codes (samples, bytes) uint8 as a ``fixed_size_binary[bytes]`` column (one
    copy at most: the buffer is the array's)."""
    import pyarrow as pa

    rows, width = codes.shape
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), rows, [None, pa.py_buffer(np.ascontiguousarray(codes))]
    )


def bed_as_parquet(bed: Path, folder: Path, cfg: ModelConfig, model: str = "") -> Path:
    """Write ``folder/<stem>.parquet`` from ``bed``: FID, IID and the model's one input
    (``cfg``, of the model named ``model`` in messages).

    Raises:
        ScoringError: not a one-input codes model, or the ``.bim``'s variants are not the
            model's (ids and alleles, in order), or the files cannot be read.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = genotype_input(bed, cfg)
    try:
        variants = read_bim(bed.with_suffix(".bim"))
        samples = read_fam(bed.with_suffix(".fam"))
        check_variants(bed.with_suffix(".bim"), variants, spec.shape, spec.ids_sha256, model)
        data = open_bed(bed, len(samples), len(variants))
    except (OSError, ValueError) as e:
        raise ScoringError(str(e)) from e
    nb = spec.packed_shape[-1]
    out = folder / f"{bed.stem}.parquet"
    schema = pa.schema([("FID", pa.string()), ("IID", pa.string()),
                        (spec.name, pa.binary(nb))])  # fmt: skip
    with pq.ParquetWriter(str(out), schema, compression="none") as writer:
        for s0, s1, codes in sample_rows(data, 0, len(samples), ROW_GROUP):
            columns = {"FID": samples.fid[s0:s1], "IID": samples.iid[s0:s1],
                       spec.name: codes_column(codes)}  # fmt: skip
            writer.write_table(pa.table(columns, schema=schema))
    return out
