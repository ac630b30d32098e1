"""Device-agnostic torch ops for bit-packed features.

Each op family lives in its own module; the public names are re-exported here.
"""

from gpu_ops.bits import packbits, unpackbits
from gpu_ops.codes import decode_codes, score_codes, score_table
from gpu_ops.resample import BandedResampler, OnTheFlyResampler, banded_resample
from gpu_ops.search import (
    PackedCorpus,
    hamming_topk,
    popcount,
    tanimoto_threshold,
    tanimoto_topk,
)
from gpu_ops.transfer import (
    StagingBuffer,
    StagingPool,
    from_dlpack,
    to_device,
    to_dlpack,
    to_numpy,
)

__all__: list[str] = [
    "BandedResampler",
    "OnTheFlyResampler",
    "PackedCorpus",
    "StagingBuffer",
    "StagingPool",
    "banded_resample",
    "decode_codes",
    "from_dlpack",
    "hamming_topk",
    "packbits",
    "popcount",
    "score_codes",
    "score_table",
    "tanimoto_threshold",
    "tanimoto_topk",
    "to_device",
    "to_dlpack",
    "to_numpy",
    "unpackbits",
]
