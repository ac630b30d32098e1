"""A PLINK ``.bed`` as the input of ``bitserve score``: one Parquet row per sample.

``bitserve score ... DATA.bed OUTPUT/`` (with ``DATA.bim`` and ``DATA.fam`` beside it) scores
a genotype model (``bitserve genotypes score-model``) on Ray Data as it scores Parquet: the
``.bed`` is first written as ``DATA.parquet`` in a private temporary folder, with the columns
``FID`` and ``IID`` (passed through to the output) and the model's input, each sample's
2-bit codes as ``fixed_size_binary`` (:func:`service.genotypes.plink_files.sample_major`);
the output is then ``OUTPUT/DATA/<start>-<stop>.parquet`` as for any input file, its rows in
``.fam`` order. The data's variants are checked against the model's ``ids_sha256`` first.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from service.genotypes.plink_files import ids_sha256, open_bed, read_bim, read_fam, sample_major
from service.models.config import ModelConfig
from service.ray.scorer import ScoringError

ROW_GROUP = 4096
"""Samples per Parquet row group (and per transpose step)."""


def bed_as_parquet(bed: Path, folder: Path, cfg: ModelConfig) -> Path:
    """Write ``folder/<stem>.parquet`` from ``bed``: FID, IID and the model's one input.

    Raises:
        ScoringError: not a one-input codes model, or the ``.bim``'s variants are not the
            model's (ids and alleles, in order), or the files cannot be read.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if len(cfg.inputs) != 1 or cfg.inputs[0].packing != "codes":
        raise ScoringError(f"{bed}: a .bed input needs a genotype model (one codes input)")
    spec = cfg.inputs[0]
    try:
        variants = read_bim(bed.with_suffix(".bim"))
        samples = read_fam(bed.with_suffix(".fam"))
        if spec.shape != [len(variants)] or spec.ids_sha256 != ids_sha256(variants):
            raise ScoringError(f"{bed.with_suffix('.bim')}: its variants (ids and alleles, in "
                               "order) are not the model's")  # fmt: skip
        data = open_bed(bed, len(samples), len(variants))
    except (OSError, ValueError) as e:
        raise ScoringError(str(e)) from e
    nb = spec.packed_shape[-1]
    out = folder / f"{bed.stem}.parquet"
    schema = pa.schema([("FID", pa.string()), ("IID", pa.string()),
                        (spec.name, pa.binary(nb))])  # fmt: skip
    n = len(samples)
    with pq.ParquetWriter(str(out), schema, compression="none") as writer:
        for s0 in range(0, n, ROW_GROUP):
            s1 = min(n, s0 + ROW_GROUP)
            codes = sample_major(np.asarray(data[:, s0 // 4 : math.ceil(s1 / 4)]), s1 - s0)
            column = pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(nb), s1 - s0, [None, pa.py_buffer(np.ascontiguousarray(codes))]
            )
            writer.write_table(pa.table({"FID": samples.fid[s0:s1], "IID": samples.iid[s0:s1],
                                         spec.name: column}, schema=schema))  # fmt: skip
    return out
