"""Torch dtypes of the server's datatypes: the registry's (``service.protocol.types.REGISTRY``)
and the operator's compute dtypes (``service.models.config.COMPUTE_DTYPES``), in torch's terms, for
the model files, their checks and the pipeline."""

from __future__ import annotations

import torch

from service.models.config import COMPUTE_DTYPES as COMPUTE_DTYPE_NAMES
from service.protocol.types import REGISTRY

COMPUTE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in COMPUTE_DTYPE_NAMES
}
"""The operator's compute dtypes by their config names
(``service.models.config.COMPUTE_DTYPES``)."""


def torch_dtype(datatype: str) -> torch.dtype:
    """The torch dtype of a V2 datatype (from the one registry, ``REGISTRY``)."""
    name = REGISTRY[datatype].torch
    if name is None:
        raise ValueError(f"{datatype} has no torch dtype")
    dtype: torch.dtype = getattr(torch, name)
    return dtype
