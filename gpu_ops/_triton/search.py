"""CUDA kernels of the search ops (for now: the chunked torch kernels on the device)."""

from __future__ import annotations

from gpu_ops._search_torch import hamming_topk, popcount, tanimoto_threshold, tanimoto_topk

__all__ = ["hamming_topk", "popcount", "tanimoto_threshold", "tanimoto_topk"]
