"""A PLINK ``.bed`` as ``bitserve score``'s input (``service.ray.bed_input``): the Parquet
rows it becomes (FID, IID, each sample's codes), scored by the scorer Ray's actors run
(``BatchScorer``, here without Ray), against plink2's semantics in NumPy."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from bitserve_client import plink

from service.genotypes import write_score_model
from service.ray.bed_input import bed_as_parquet
from service.ray.scorer import BatchScorer, ScoringError, read_config
from tests.genotypes.plink_data import plink_score, write_dataset


def test_a_bed_scored_as_parquet_rows(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "d", 21, 30, seed=5)
    rows = [(v, data.a1[i], [float(i) - 3.0]) for i, v in enumerate(data.ids) if i % 4]
    score = tmp_path / "s.txt"
    score.write_text("".join(f"{v} {a} {w[0]}\n" for v, a, w in rows))
    write_score_model(data.bim, data.bed, score, tmp_path / "repo" / "prs", max_batch_size=8)
    _, cfg = read_config(tmp_path / "repo", "prs")
    (tmp_path / "tmp").mkdir()
    path = bed_as_parquet(data.bed, tmp_path / "tmp", cfg)
    assert path.name == "d.parquet"
    table = pq.read_table(path)
    assert table.column_names == ["FID", "IID", "genotypes"]
    assert table.column("IID").to_pylist() == [f"S{i}" for i in range(21)]
    codes = np.frombuffer(b"".join(table.column("genotypes").to_pylist()), np.uint8)
    np.testing.assert_array_equal(codes.reshape(21, -1), plink.read_bed(data.bed))
    out = BatchScorer(tmp_path / "repo", "prs", device="cpu")(table)
    assert out.column("FID").to_pylist() == ["F"] * 21  # passed through
    got = np.stack(out.column("SCORE_SUM").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(got[:, 0], plink_score(data, rows)[3][:, 0], rtol=1e-12)


def test_other_variants_are_refused(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "d", 8, 12, seed=6)
    score = tmp_path / "s.txt"
    score.write_text(f"{data.ids[3]} {data.a2[3]} 1.5\n")
    write_score_model(data.bim, data.bed, score, tmp_path / "repo" / "prs")
    _, cfg = read_config(tmp_path / "repo", "prs")
    other = write_dataset(tmp_path / "o", 8, 13, seed=6)
    with pytest.raises(ScoringError, match="are not the model's"):
        bed_as_parquet(other.bed, tmp_path, cfg)
