"""``bitserve score --ray`` on a PLINK ``.bed`` end to end: a real ``bitserve score`` process
with a Ray of its own over ``plink2 --dummy`` data, its scores against plink2's own
``--score`` output, FID and IID passed through; then ``bitserve score`` without ``--ray``
(in its process, no Ray): the same files (names, Arrow schema byte for byte, rows), and run
on the Ray job's output it finds every row already there.

Ray's start-up needs the host to have some room: on a shared 2-core host at a load average
of 14 its raylet gave up waiting for its agents' port files (``Timed out waiting for file``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.server import bitserve_command
from service.genotypes import write_score_model

pytest.importorskip("ray")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("plink2") is None, reason="plink2 is not installed"),
]

PLINK = ["plink2", "--threads", "1", "--memory", "1000"]


def test_bitserve_score_of_a_bed_matches_plink2(tmp_path: Path) -> None:
    d = tmp_path / "data"
    subprocess.run([*PLINK, "--dummy", "83", "250", "0.02", "acgt", "--make-bed", "--out",
                    str(d)], check=True, capture_output=True)  # fmt: skip
    fam = [line.split()[:2] for line in d.with_suffix(".fam").read_text().splitlines()]
    # distinct family ids, so that FID's pass-through is seen (plink2 --dummy writes 0s)
    fam = [[f"fam{i % 7}", iid] for i, (_, iid) in enumerate(fam)]
    d.with_suffix(".fam").write_text("".join(f"{f} {i} 0 0 1 -9\n" for f, i in fam))
    rng = np.random.default_rng()
    lines = ["ID\tA\tW1\tW2"]
    for i, line in enumerate(d.with_suffix(".bim").read_text().splitlines()):
        f = line.split()
        if i % 9 == 4:
            continue  # not every variant scored
        w = rng.normal(size=2).round(5)
        lines.append(f"{f[1]}\t{f[4] if rng.random() < 0.5 else f[5]}\t{w[0]}\t{w[1]}")
    score = tmp_path / "s.txt"
    score.write_text("\n".join(lines) + "\n")
    subprocess.run([*PLINK, "--bfile", str(d), "--score", str(score), "1", "2", "header",
                    "cols=+scoresums", "--score-col-nums", "3-4", "--out", str(tmp_path / "o")],
                   check=True, capture_output=True)  # fmt: skip
    sscore = [r.split() for r in (tmp_path / "o.sscore").read_text().splitlines()]
    assert sscore[0][:2] == ["#FID", "IID"]
    write_score_model(d.with_suffix(".bim"), d.with_suffix(".bed"), score,
                      tmp_path / "repo" / "prs", score_cols=[3, 4], max_batch_size=16)  # fmt: skip

    out = tmp_path / "scores"
    command = [*bitserve_command(), "score", "--model-repository", str(tmp_path / "repo"),
               "--model", "prs", str(d.with_suffix(".bed"))]  # fmt: skip
    done = subprocess.run([*command[:-1], "--ray", "--actors", "1", command[-1], str(out)],
                          capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "83 row(s) scored" in done.stdout
    files = sorted((out / "data").glob("*.parquet"))
    assert files, sorted(p.name for p in out.rglob("*"))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    assert table.column_names == ["FID", "IID", "ALLELE_CT", "NAMED_ALLELE_DOSAGE_SUM",
                                  "SCORE_AVG", "SCORE_SUM"]  # fmt: skip
    pairs = list(zip(table.column("FID").to_pylist(), table.column("IID").to_pylist(),
                     strict=True))  # fmt: skip
    assert pairs == [tuple(p) for p in fam]  # every sample once, in .fam order
    assert [r[1] for r in sscore[1:]] == [p[1] for p in pairs]

    def col(name: str) -> np.ndarray:
        return np.stack(table.column(name).to_numpy(zero_copy_only=False)).astype(float)

    got = np.column_stack([col("ALLELE_CT"), col("NAMED_ALLELE_DOSAGE_SUM"), col("SCORE_AVG"),
                           col("SCORE_SUM")])  # fmt: skip
    first = sscore[0].index("ALLELE_CT")  # PHENO1 is there only when phenotypes are
    want = np.array([r[first:] for r in sscore[1:]], float)  # CT DS AVG1 AVG2 SUM1 SUM2
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)

    here = subprocess.run([*command, str(tmp_path / "here")], capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    assert here.returncode == 0, here.stderr[-4000:]
    assert "83 row(s) scored, 0 already there" in here.stdout
    assert "Ray" not in here.stderr, here.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "here" / "data").iterdir()) == [f.name for f in files]
    for f in files:
        mine = tmp_path / "here" / "data" / f.name
        assert pq.ParquetFile(mine).metadata.metadata == pq.ParquetFile(f).metadata.metadata
        a, b = pq.read_table(mine), pq.read_table(f)
        assert a.select(["FID", "IID"]).equals(b.select(["FID", "IID"]))
        for name in a.column_names[2:]:
            np.testing.assert_allclose(np.stack(a.column(name).to_numpy(zero_copy_only=False)),
                                       np.stack(b.column(name).to_numpy(zero_copy_only=False)),
                                       rtol=1e-12)  # fmt: skip
    again = subprocess.run([*command, str(out)], capture_output=True, text=True, timeout=600,
                           check=False)  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    assert "0 row(s) scored, 83 already there" in again.stdout
