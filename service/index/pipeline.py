"""An index model's pipeline: packed queries -> Hamming or Tanimoto top-k over a resident corpus.

The ``[index]`` kind beside the operator/model pipeline (:mod:`service.models.pipeline`), run by the
same batcher through the same :meth:`Pipeline.run`: the batch's queries are staged as the
operator's packed input is (one gather, one host-to-device copy, a request's own bit order or
BOOL form turned into the model's packed bytes), stacked into one ``(Q, W)`` call of
``gpu_ops.PackedCorpus`` (``hamming_topk`` or ``tanimoto_topk``), and the hits' rows become
the file's ids. The batch is searched with its largest ``k`` and its least ``threshold``;
each request then gets its own first ``k`` hits, those under its own threshold emptied.

Outputs, per query: ``ids`` (INT64 [k]) and ``scores`` (FP32 [k]), best first, ties by the
lower row: Tanimoto similarity, or Hamming distance. An empty slot (fewer than k rows, or
fewer above the threshold) has id -1 and score 0 (Tanimoto) or -1 (Hamming).

The corpus is the process's one copy of the file's content on the device
(:data:`service.index.corpus.STORE`); the dry run at load searches its first rows only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from service.index.corpus import STORE, CorpusFile, ResidentCorpus, load_error, padding_mask
from service.models.config import IndexConfig, ModelConfig
from service.models.files import Artifacts
from service.models.pipeline import Pipeline
from service.models.signature import Bound

DRY_RUN_ROWS = 64
"""Corpus rows the dry run at load searches (its outputs' shapes do not depend on N)."""


class _Rows:
    """The first rows of a corpus, prepared as the whole one is (the dry run's corpus)."""

    def __init__(self, file: CorpusFile, device: torch.device, rows: int) -> None:
        from gpu_ops import PackedCorpus

        part = file.corpus[:rows]
        self.packed = PackedCorpus(torch.from_numpy(np.array(part)).to(device))
        self.ids = None if file.ids is None else torch.from_numpy(np.array(file.ids[:rows]))
        self.ids = None if self.ids is None else self.ids.to(device)


class IndexPipeline(Pipeline):
    """An ``[index]`` model version resident on its device (see the module docstring).

    Args:
        name: the model name (messages).
        cfg: its configuration (``cfg.index`` set).
        artifacts: its files (``artifacts.corpus``: the opened corpus file).
        device: ``"cpu"`` or ``"cuda:N"``.
        source: the config's path for messages.

    Raises:
        ConfigError: the corpus cannot be prepared on the device.
    """

    def __init__(
        self,
        name: str,
        cfg: ModelConfig,
        artifacts: Artifacts,
        device: str,
        *,
        source: str = "config.toml",
    ) -> None:
        assert cfg.index is not None
        assert artifacts.corpus is not None
        self._init_state(name, cfg, device, source)
        self.index: IndexConfig = cfg.index
        self.operator_input = None
        self.compute_dtype = torch.uint8
        self._dtypes = [torch.uint8]
        self._codes = {}  # no packing = "codes" input: queries stay packed bits
        self.operator = None
        self.model = None
        self._ids_at, self._scores_at = cfg.index_outputs
        self._batch_k = self.index.k
        self._batch_threshold: float | None = None
        mask = padding_mask(self.inputs[0])
        file = artifacts.corpus
        folder = artifacts.folder or (None, "")
        try:
            with torch.inference_mode(), self._device_context():
                self._buffers = [
                    torch.zeros(
                        (self.capacity, *self.inputs[0].packed_shape),
                        dtype=torch.uint8,
                        device=self.device,
                    )
                ]
                self._mask = (
                    None
                    if mask is None
                    else torch.full((1,), mask, dtype=torch.uint8, device=self.device)
                )
                self._search: _Rows | ResidentCorpus = _Rows(
                    file, self.device, min(DRY_RUN_ROWS, file.num_rows)
                )
        except Exception as exc:  # the device's own error (out of memory, no such device)
            raise load_error(source, exc, folder) from exc
        self._file = file
        self._folder = folder
        self.device_memory_bytes = self._buffers[0].numel()
        """The query buffer's bytes; the corpus's are added once it is resident."""

    def after_dry_run(self) -> None:
        """The dry run (on a few rows) has passed: the whole corpus goes to the device."""
        file = self._file
        try:
            with torch.inference_mode(), self._device_context():
                self._search = STORE.get(
                    file, self.device, lambda: ResidentCorpus(file, self.device)
                )
        except Exception as exc:
            raise load_error(self.source, exc, self._folder) from exc
        self.resident: ResidentCorpus = self._search
        self.device_memory_bytes = self._buffers[0].numel() + self.resident.nbytes

    # --- the pipeline's hooks -------------------------------------------------------------

    def _packs(self, i: int) -> bool:
        return True  # the query reaches the search packed

    def _stage(self, requests: Sequence[Bound]) -> int:
        m = super()._stage(requests)
        wanted = [r.search for r in requests]
        self._batch_k = max(self.index.k if s is None else s.k for s in wanted)
        thresholds = [None if s is None else s.threshold for s in wanted]
        self._batch_threshold = (
            None if None in thresholds else min(t for t in thresholds if t is not None)
        )
        return m

    def _forward(self, m: int) -> list[torch.Tensor]:
        """``(ids (m, k) int64, scores (m, k) float32)`` in config order."""
        queries = self._buffers[0][:m] if self._packed is None else self._packed[:m]
        if self._mask is not None:  # the padding bits of a query count for nothing
            queries = queries.clone()
            queries[:, -1] &= self._mask
        k = self._batch_k
        corpus = self._search.packed
        if self.index.metric == "tanimoto":
            scores, rows = corpus.tanimoto_topk(queries, k, threshold=self._batch_threshold or 0.0)
        else:
            distances, rows = corpus.hamming_topk(queries, k)
            scores = distances.to(torch.float32)
        ids = rows
        if self._search.ids is not None:
            ids = torch.where(rows >= 0, self._search.ids[rows.clamp(min=0)], -1)
        outs: list[torch.Tensor] = [ids, scores]
        if self._ids_at == 1:
            outs.reverse()
        return outs

    def _split(
        self, requests: Sequence[Bound], arrays: list[np.ndarray[Any, Any]]
    ) -> list[list[np.ndarray[Any, Any]]]:
        """Each request's rows, its own first ``k`` hits, those under its threshold emptied."""
        results: list[list[np.ndarray[Any, Any]]] = []
        row = 0
        empty = 0.0 if self.index.metric == "tanimoto" else -1.0
        for r in requests:
            k = self.index.k if r.search is None else r.search.k
            ids = arrays[self._ids_at][row : row + r.size, :k]
            scores = arrays[self._scores_at][row : row + r.size, :k]
            if k < self._batch_k:
                ids, scores = np.ascontiguousarray(ids), np.ascontiguousarray(scores)
            threshold = None if r.search is None else r.search.threshold
            if threshold is not None and threshold != self._batch_threshold:
                below = (scores < np.float32(threshold)) | (ids < 0)
                ids, scores = ids.copy(), scores.copy()  # their own: the batch's may be shared
                ids[below], scores[below] = -1, empty
            out = [ids, scores] if self._ids_at == 0 else [scores, ids]
            results.append(out if self.batched else [a[0] for a in out])
            row += r.size
        return results

    def parameters(self) -> dict[str, Any]:
        """The index as the model's metadata shows it."""
        return {
            "index": {
                "metric": self.index.metric,
                "k": self.index.k,
                "max_k": self.index.max_k,
                "num_rows": self.resident.num_rows,
                "width_bits": self.inputs[0].shape[-1],
                "ids": "file" if self.resident.ids is not None else "row numbers",
                "corpus_sha256": self.resident.digest,
            }
        }

    def __repr__(self) -> str:
        return (
            f"IndexPipeline({self.name!r}, device={self.device}, metric={self.index.metric}, "
            f"rows={self.resident.num_rows}, bits={self.inputs[0].shape[-1]})"
        )
