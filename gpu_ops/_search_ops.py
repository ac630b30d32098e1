"""The search ops as torch operators: ``torch.ops.bitserve.popcount``, ``hamming_topk``,
``tanimoto_topk`` and ``tanimoto_threshold``.

Defined in the ``bitserve`` library (:mod:`gpu_ops._library`), so the dispatcher picks the
kernel by device and the ops run under ``torch.compile`` and in ``torch.export`` programs:

===========  ===============================================================================
device       kernel
===========  ===============================================================================
CPU          compiled C (:mod:`gpu_ops._search_c`), the popcount instructions chosen by the
             CPU's features; plain torch where no C compiler is found
CUDA         Triton (:mod:`gpu_ops._triton.search`), registered when Triton is installed
any other    chunked plain torch (:mod:`gpu_ops._search_torch`): also CUDA without Triton
fake / meta  shapes and dtypes only (the threshold search's hit count is data-dependent)
===========  ===============================================================================

Arguments the ops take (:mod:`gpu_ops.search` checks and normalises what users pass):
``queries (Q, W)`` and ``corpus (N, W)`` uint8 on one device, any strides; ``popcounts (N,)``
int32, the corpus rows' set bits; ``ids (N,)`` int64 or None: the id each corpus row is
reported (and tie-broken) by, row numbers when None, below 2**31; ``k >= 1``; ``threshold``
in [0, 1], compared as float32; ``sorted``: the corpus is in non-decreasing popcount order,
so the kernels may skip whole ranges of rows by the Tanimoto popcount bound.
No autograd: bits are integers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gpu_ops import _search_c, _search_torch
from gpu_ops._lazy_triton import triton_kernels
from gpu_ops._library import Op

if TYPE_CHECKING:
    from gpu_ops._triton import search as _triton_search
else:
    _triton_search = triton_kernels("search")

# --- popcount -----------------------------------------------------------------------------------

popcount = Op("popcount(Tensor packed) -> Tensor")


@popcount.register_kernel(None)
def _(packed: Tensor) -> Tensor:
    """Set bits per row of ``packed (R, W)`` uint8: int32 ``(R,)``."""
    return _search_torch.popcount(packed)


@popcount.register_kernel("cpu")
def _(packed: Tensor) -> Tensor:
    return _search_c.popcount(packed)


@popcount.register_fake
def _(packed: Tensor) -> Tensor:
    return packed.new_empty(packed.shape[:1], dtype=torch.int32)


# --- hamming_topk -------------------------------------------------------------------------------

hamming_topk = Op(
    "hamming_topk(Tensor queries, Tensor corpus, Tensor? ids, SymInt k) -> (Tensor, Tensor)"
)


@hamming_topk.register_kernel(None)
def _(queries: Tensor, corpus: Tensor, ids: Tensor | None, k: int) -> tuple[Tensor, Tensor]:
    """(distances int32 (Q, k), ids int64 (Q, k)): nearest first, ties by the lower id;
    slots past N: distance -1, id -1."""
    return _search_torch.hamming_topk(queries, corpus, ids, k)


@hamming_topk.register_kernel("cpu")
def _(queries: Tensor, corpus: Tensor, ids: Tensor | None, k: int) -> tuple[Tensor, Tensor]:
    return _search_c.hamming_topk(queries, corpus, ids, k)


@hamming_topk.register_fake
def _(queries: Tensor, corpus: Tensor, ids: Tensor | None, k: int) -> tuple[Tensor, Tensor]:
    Q = queries.shape[0]
    return queries.new_empty((Q, k), dtype=torch.int32), queries.new_empty(
        (Q, k), dtype=torch.int64
    )


# --- tanimoto_topk ------------------------------------------------------------------------------

tanimoto_topk = Op(
    "tanimoto_topk(Tensor queries, Tensor corpus, Tensor popcounts, Tensor? ids, SymInt k, "
    "float threshold, bool sorted) -> (Tensor, Tensor)"
)


@tanimoto_topk.register_kernel(None)
def _(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, k: int,
    threshold: float, sorted: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(similarities float32 (Q, k), ids int64 (Q, k)): best first, ties by the lower id,
    only similarities >= float32(threshold); empty slots 0 and -1."""
    return _search_torch.tanimoto_topk(queries, corpus, popcounts, ids, k, threshold, sorted)


@tanimoto_topk.register_kernel("cpu")
def _(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, k: int,
    threshold: float, sorted: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    return _search_c.tanimoto_topk(queries, corpus, popcounts, ids, k, threshold, sorted)


@tanimoto_topk.register_fake
def _(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, k: int,
    threshold: float, sorted: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    Q = queries.shape[0]
    return queries.new_empty((Q, k), dtype=torch.float32), queries.new_empty(
        (Q, k), dtype=torch.int64
    )


# --- tanimoto_threshold -------------------------------------------------------------------------

tanimoto_threshold = Op(
    "tanimoto_threshold(Tensor queries, Tensor corpus, Tensor popcounts, Tensor? ids, "
    "float threshold, bool sorted) -> (Tensor, Tensor, Tensor)"
)


@tanimoto_threshold.register_kernel(None)
def _(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, threshold: float,
    sorted: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """CSR of every hit >= float32(threshold): (offsets int64 (Q + 1), ids int64 (H,),
    similarities float32 (H,)), each query's hits best first, ties by the lower id."""
    return _search_torch.tanimoto_threshold(queries, corpus, popcounts, ids, threshold, sorted)


@tanimoto_threshold.register_kernel("cpu")
def _(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, threshold: float,
    sorted: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return _search_c.tanimoto_threshold(queries, corpus, popcounts, ids, threshold, sorted)


@tanimoto_threshold.register_fake
def _(
    queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, threshold: float,
    sorted: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    hits = torch.library.get_ctx().new_dynamic_size()
    return (
        queries.new_empty((queries.shape[0] + 1,), dtype=torch.int64),
        queries.new_empty((hits,), dtype=torch.int64),
        queries.new_empty((hits,), dtype=torch.float32),
    )


# --- CUDA ---------------------------------------------------------------------------------------

if _triton_search is not None:
    _ts = _triton_search

    @popcount.register_kernel("cuda")
    def _(packed: Tensor) -> Tensor:
        return _ts.popcount(packed)

    @hamming_topk.register_kernel("cuda")
    def _(queries: Tensor, corpus: Tensor, ids: Tensor | None, k: int) -> tuple[Tensor, Tensor]:
        return _ts.hamming_topk(queries, corpus, ids, k)

    @tanimoto_topk.register_kernel("cuda")
    def _(
        queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None, k: int,
        threshold: float, sorted: bool,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        return _ts.tanimoto_topk(queries, corpus, popcounts, ids, k, threshold, sorted)

    @tanimoto_threshold.register_kernel("cuda")
    def _(
        queries: Tensor, corpus: Tensor, popcounts: Tensor, ids: Tensor | None,
        threshold: float, sorted: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        return _ts.tanimoto_threshold(queries, corpus, popcounts, ids, threshold, sorted)
