"""``bitserve genotypes score``'s torch-free path (:mod:`service.genotypes.fast`): the C kernel
reading variant-major ``.bed`` blocks against its NumPy reference on fresh random inputs, the
value tables against the served model's (torch), the command against plink2's semantics in
NumPy (and plink2 itself where installed), and the fall-backs to the served model's load."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from service.cli import main
from service.genotypes import fast, write_score_model
from tests.genotypes.plink_data import Dataset, plink_score, write_dataset


@pytest.mark.parametrize(
    ("n", "V", "C", "threads"),
    [(1, 1, 1, 1), (5, 3, 2, 1), (13, 37, 4, 1), (40, 101, 3, 3), (23, 8, 4, 2), (101, 250, 6, 4)],
)
def test_kernel_matches_the_reference(n: int, V: int, C: int, threads: int) -> None:
    """Samples and variants not multiples of 4 or 8, one to many score columns, threads."""
    rng = np.random.default_rng()
    blocks = rng.integers(0, 256, (V, (n + 3) // 4), dtype=np.uint8)
    values = rng.normal(size=(V, 4, C))
    got = fast.score_bed_blocks(blocks, n, values, threads=threads)
    np.testing.assert_allclose(got, fast.score_bed_reference(blocks, n, values), rtol=1e-12,
                               atol=1e-12)  # fmt: skip


def test_kernel_over_several_blocks_of_a_strided_view(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block of variants per call (progress after each), rows that are a view of wider
    rows (a memory map's slice)."""
    monkeypatch.setattr(fast, "BLOCK_VARIANTS", 16)
    rng = np.random.default_rng()
    n, V = 30, 53
    wide = rng.integers(0, 256, (V, 12), dtype=np.uint8)
    blocks = wide[:, : (n + 3) // 4]
    values = rng.normal(size=(V, 4, 4))
    seen: list[tuple[int, int]] = []
    got = fast.score_bed_blocks(blocks, n, values, progress=lambda a, b: seen.append((a, b)))
    assert seen == [(16, V), (32, V), (48, V), (V, V)]
    np.testing.assert_allclose(got, fast.score_bed_reference(blocks, n, values), rtol=1e-12)


def test_value_tables_equal_the_served_models() -> None:
    import torch

    from service.models.codes import CodeTable
    from service.models.score_model import value_tables

    rng = np.random.default_rng()
    L, S = 29, 3
    w, means = rng.normal(size=(L, S)), rng.uniform(0, 2, L)
    flip, scored = rng.random(L) < 0.5, rng.random(L) < 0.8
    codes = CodeTable(2, L, "little", torch.tensor(fast.PLINK_CODE_VALUES, dtype=torch.float64),
                      torch.from_numpy(means))  # fmt: skip
    want = value_tables(torch.from_numpy(w), torch.from_numpy(flip), torch.from_numpy(scored),
                        codes).numpy()  # fmt: skip
    np.testing.assert_array_equal(fast.value_tables(w, flip, scored, means), want)


def _model(tmp_path: Path, n: int = 27, L: int = 45) -> tuple[Dataset, list, Path]:
    data = write_dataset(tmp_path / "d", n, L, seed=n, missing=0.1)
    rng = np.random.default_rng(n)
    rows = [(v, data.a2[i] if rng.random() < 0.5 else data.a1[i], rng.normal(size=2).tolist())
            for i, v in enumerate(data.ids) if i % 5]  # fmt: skip
    score = tmp_path / "s.txt"
    score.write_text("".join(f"{v} {a} {w[0]!r} {w[1]!r}\n" for v, a, w in rows))
    write_score_model(data.bim, data.bed, score, tmp_path / "repo" / "prs", score_cols=[3, 4])
    return data, rows, tmp_path / "repo"


def _sscore(path: Path) -> np.ndarray:
    lines = path.read_text().splitlines()
    head = ["#FID", "IID", "ALLELE_CT", "NAMED_ALLELE_DOSAGE_SUM", "SCORE1_AVG", "SCORE2_AVG",
            "SCORE1_SUM", "SCORE2_SUM"]  # fmt: skip
    assert lines[0].split("\t") == head
    return np.array([line.split("\t")[2:] for line in lines[1:]], float)


def test_the_command_scores_without_torch(tmp_path: Path) -> None:
    """In a process of its own: the .sscore equals plink2's semantics (NumPy), torch is
    never imported."""
    data, rows, repo = _model(tmp_path)
    out = tmp_path / "o.sscore"
    code = (
        "import sys; from service.cli import main; "
        f"rc = main(['genotypes', 'score', '--threads', '2', '--model-repository', {str(repo)!r}, "
        f"'--model', 'prs', {str(data.bed)!r}, {str(out)!r}]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no fall-back
    assert "27 samples scored" in done.stdout
    np.testing.assert_allclose(_sscore(out), np.column_stack(plink_score(data, rows)),
                               rtol=1e-12, atol=1e-12)  # fmt: skip


def test_other_models_and_no_kernels_fall_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config that is not score-model's form, or no C kernels: loaded as serve loads it,
    the same scores."""
    data, rows, repo = _model(tmp_path)
    want = np.column_stack(plink_score(data, rows))
    args = ["genotypes", "score", "--model-repository", str(repo), "--model", "prs",
            str(data.bed), str(tmp_path / "o.sscore")]  # fmt: skip
    config = repo / "prs" / "config.toml"
    config.write_text(config.read_text().replace('device = "auto"', 'device = "cpu"\n'
                                                 "max_queue_delay_us = 1"))  # fmt: skip
    why = "repo/prs/config.toml: keys beyond those score-model writes"
    assert fast.load_fast_model(repo, "prs") == why
    assert main(args) == 0
    assert "loading it as serve does" in capsys.readouterr().err
    np.testing.assert_allclose(_sscore(tmp_path / "o.sscore"), want, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("BITSERVE_CPU_KERNELS", "0")
    assert fast.load_fast_model(repo, "prs") == "the CPU code kernels are unavailable"


def test_other_variants_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, _, repo = _model(tmp_path)
    other = write_dataset(tmp_path / "x", 27, 44, seed=3)
    assert main(["genotypes", "score", "--model-repository", str(repo), "--model", "prs",
                 str(other.bed), str(tmp_path / "o.sscore")]) == 1  # fmt: skip
    assert "are not the model's 'prs'" in capsys.readouterr().err
    assert main(["genotypes", "score", "--threads", "0", "--model-repository", str(repo),
                 "--model", "prs", str(other.bed), str(tmp_path / "o.sscore")]) == 2  # fmt: skip
    assert "--threads must be at least 1" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("plink2") is None, reason="plink2 is not installed")
def test_matches_plink2(tmp_path: Path) -> None:
    """plink2 --dummy data, 2% missing, both alleles, two columns: plink2's .sscore to 1e-5
    relative (plink2 prints 6 significant digits)."""
    run = ["plink2", "--threads", "1", "--memory", "1000"]
    d = tmp_path / "d"
    subprocess.run([*run, "--dummy", "61", "157", "0.02", "acgt", "--make-bed", "--out", str(d)],
                   check=True, capture_output=True)  # fmt: skip
    rng = np.random.default_rng()
    lines = ["ID\tA\tW1\tW2"]
    for line in d.with_suffix(".bim").read_text().splitlines():
        f = line.split()
        w = rng.normal(size=2).round(5)
        lines.append(f"{f[1]}\t{f[4] if rng.random() < 0.5 else f[5]}\t{w[0]}\t{w[1]}")
    (tmp_path / "s.txt").write_text("\n".join(lines) + "\n")
    subprocess.run([*run, "--bfile", str(d), "--score", str(tmp_path / "s.txt"), "1", "2",
                    "header", "cols=+scoresums", "--score-col-nums", "3-4", "--out",
                    str(tmp_path / "o")], check=True, capture_output=True)  # fmt: skip
    want = np.array([r.split()[3:] for r in (tmp_path / "o.sscore").read_text().splitlines()[1:]],
                    float)  # fmt: skip
    write_score_model(d.with_suffix(".bim"), d.with_suffix(".bed"), tmp_path / "s.txt",
                      tmp_path / "repo" / "prs", score_cols=[3, 4])  # fmt: skip
    out = tmp_path / "b.sscore"
    assert main(["genotypes", "score", "--model-repository", str(tmp_path / "repo"), "--model",
                 "prs", str(d.with_suffix(".bed")), str(out)]) == 0  # fmt: skip
    np.testing.assert_allclose(_sscore(out), want, rtol=1e-5, atol=1e-12)
