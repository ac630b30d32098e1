"""The CPU kernels of the search ops (for now: the torch kernels; compiled C follows)."""

from __future__ import annotations

from gpu_ops._search_torch import hamming_topk, popcount, tanimoto_threshold, tanimoto_topk

__all__ = ["hamming_topk", "popcount", "tanimoto_threshold", "tanimoto_topk"]
