"""An index model scored in bulk like any model: ``BatchScorer`` on NumPy and Arrow batches,
and ``bitserve score`` on a Parquet file of queries (a local Ray of its own), the ids and scores
columns checked against the NumPy reference."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.server import bitserve_command
from service.ray.scorer import BatchScorer, ScoringError
from tests.service.index_cases import as_ids, random_bits, reference_search, write_index

pytest.importorskip("ray")

RNG = np.random.default_rng(7)
CORPUS = np.packbits(random_bits(RNG, 300, 256, density=0.1), axis=1)
IDS = np.arange(300, dtype=np.int64) * 11 + 5
QUERIES = np.packbits(random_bits(RNG, 70, 256, density=0.1), axis=1)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("index-models")
    write_index(root / "fp", CORPUS, ids=IDS, k=4, max_k=64, max_batch_size=32)
    return root


def _bytes_column(packed: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    col = np.empty(len(packed), dtype=object)
    col[:] = [r.tobytes() for r in packed]
    return col


def test_scorer_gives_ids_and_scores_columns(repository: Path) -> None:
    scorer = BatchScorer(repository, "fp", device="cpu")
    out = scorer({"query": _bytes_column(QUERIES), "name": np.arange(70)})
    assert sorted(out) == ["ids", "name", "scores"]
    rows, scores = reference_search(QUERIES, CORPUS, 4, "tanimoto")
    np.testing.assert_array_equal(out["ids"], as_ids(rows, IDS))  # 70 rows: three runs of 32
    np.testing.assert_allclose(out["scores"], scores, atol=1e-6)
    table = scorer(pa.table({"query": pa.array(list(_bytes_column(QUERIES)), pa.binary(32))}))
    np.testing.assert_array_equal(np.stack(table.column("ids").to_numpy()), out["ids"])


def test_scorer_takes_k_and_threshold(repository: Path) -> None:
    scorer = BatchScorer(repository, "fp", device="cpu", parameters={"k": 9, "threshold": 0.1})
    out = scorer({"query": QUERIES.copy()})
    rows, scores = reference_search(QUERIES, CORPUS, 9, "tanimoto", threshold=0.1)
    np.testing.assert_array_equal(out["ids"], as_ids(rows, IDS))
    np.testing.assert_allclose(out["scores"], scores, atol=1e-6)
    bad = BatchScorer(repository, "fp", device="cpu", parameters={"k": 65})
    with pytest.raises(ScoringError, match=r"parameters\.k must be an integer from 1 to max_k"):
        bad({"query": QUERIES[:2].copy()})


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_score_cli_on_a_parquet_of_queries(repository: Path, tmp_path: Path) -> None:
    src = tmp_path / "queries"
    src.mkdir()
    keys = np.arange(70) + 1000
    table = pa.table({"key": keys, "query": pa.array([q.tobytes() for q in QUERIES])})
    pq.write_table(table, src / "q.parquet", row_group_size=25)
    out = tmp_path / "hits"
    cmd = [*bitserve_command(), "score", "--model-repository", str(repository), "--model", "fp",
           "--actors", "1", "--k", "6", str(src), str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=540, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "70 row(s) scored" in done.stdout
    got = pa.concat_tables([pq.read_table(f) for f in sorted(out.rglob("*.parquet"))])
    assert got.column_names == ["key", "ids", "scores"]
    order = got.column("key").to_numpy() - 1000
    ids = np.stack(got.column("ids").to_numpy(zero_copy_only=False))
    scores = np.stack(got.column("scores").to_numpy(zero_copy_only=False))
    rows, want = reference_search(QUERIES[order], CORPUS, 6, "tanimoto")
    np.testing.assert_array_equal(ids, as_ids(rows, IDS))
    np.testing.assert_allclose(scores, want, atol=1e-6)
