"""``bitserve genotypes score-model`` and the ``[score]`` model it writes: plink2's --score
semantics (allele alignment, mean imputation over founders, skipped variants, several score
columns) against a float64 NumPy reference, and against plink2 itself where installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from bitserve_client import plink

from service.cli import main
from service.genotypes import write_score_model
from service.genotypes.plink_files import PlinkError
from service.genotypes.score_file import ScoreFileError
from service.models.builder import build_version, check_repository
from service.models.config import ConfigError, parse_config
from service.models.layout import model_versions
from service.models.signature import Bound, Signature, WireInput
from tests.genotypes.plink_data import Dataset, plink_score, write_dataset

LIMIT = 1 << 30


def _score_file(path: Path, rows: list[tuple[str, str, list[float]]], header: bool = True) -> Path:
    lines = (
        ["ID\tALLELE\t" + "\t".join(f"W{k + 1}" for k in range(len(rows[0][2])))] if header else []
    )
    lines += [f"{v}\t{a}\t" + "\t".join(repr(x) for x in w) for v, a, w in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _rows(data: Dataset, seed: int, S: int) -> list[tuple[str, str, list[float]]]:
    rng = np.random.default_rng(seed)
    rows = []
    for i, vid in enumerate(data.ids):
        if i == 0 or rng.random() < 0.2:
            continue  # not every variant is scored (the first: an allele mismatch below)
        allele = data.a1[i] if rng.random() < 0.5 else data.a2[i]
        rows.append((vid, allele, rng.normal(size=S).round(6).tolist()))
    rows.append(("rs_absent", "A", [1.0] * S))
    rows.append((data.ids[0], "N", [1.0] * S))  # an allele the variant does not have
    return rows


def _run(model_dir: Path, codes: np.ndarray) -> list[np.ndarray]:
    src = model_versions(model_dir.parent, model_dir.name)["1"]
    _, pipe = build_version(model_dir.name, src, default_device="cpu", max_operator_bytes=LIMIT)
    return pipe.run([Bound((WireInput(codes, True),), (0, 1, 2, 3), len(codes))])[0]


@pytest.mark.parametrize(("n", "L", "S"), [(13, 37, 1), (40, 101, 3)])
def test_scores_match_the_reference(tmp_path: Path, n: int, L: int, S: int) -> None:
    data = write_dataset(tmp_path / "d", n, L, seed=n)
    rows = _rows(data, n, S)
    score = _score_file(tmp_path / "s.txt", rows)
    cols = list(range(3, 3 + S))
    report = write_score_model(data.bim, data.bed, score, tmp_path / "repo" / "prs",
                               score_cols=cols, max_batch_size=64)  # fmt: skip
    assert report.missing_ids == ["rs_absent"]
    assert report.allele_mismatch == [data.ids[0]]
    assert report.scored == len(rows) - 2
    assert report.names == [f"W{k + 1}" for k in range(S)]
    ct, ds, avg, sums = _run(tmp_path / "repo" / "prs", plink.read_bed(data.bed))
    want = plink_score(data, rows)  # skips what plink2 skips
    for got, exp in zip((ct[:, 0], ds[:, 0], avg, sums), want, strict=True):
        np.testing.assert_allclose(got, exp, rtol=1e-12, atol=1e-12)


def test_means_over_founders_only(tmp_path: Path) -> None:
    """Samples whose parent is in the data are not counted in the imputation means."""
    pat = ["0"] * 10 + ["S0", "S1", "S2"] + ["0"]
    data = write_dataset(tmp_path / "d", 14, 20, seed=3, missing=0.2, pat=pat)
    rows = [(v, data.a2[i], [0.5 + i]) for i, v in enumerate(data.ids)]
    score = _score_file(tmp_path / "s.txt", rows)
    write_score_model(data.bim, data.bed, score, tmp_path / "repo" / "m")
    out = _run(tmp_path / "repo" / "m", plink.read_bed(data.bed))
    founders = np.array([p == "0" for p in pat])
    np.testing.assert_allclose(out[3], plink_score(data, rows, founders)[3], rtol=1e-12)
    assert not np.allclose(out[3], plink_score(data, rows)[3], rtol=1e-9)


def test_metadata_advertises_the_codes_and_the_variants(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "d", 5, 9, seed=1)
    score = _score_file(tmp_path / "s.txt", [(data.ids[2], data.a1[2], [1.0])])
    write_score_model(data.bim, data.bed, score, tmp_path / "repo" / "m")
    src = model_versions(tmp_path / "repo", "m")["1"]
    cfg, pipe = build_version("m", src, default_device="cpu", max_operator_bytes=LIMIT)
    (entry,) = Signature("m", cfg, pipe.output_shapes).input_metadata()
    assert entry["datatype"] == "UINT8"
    assert entry["shape"] == [-1, 3]
    params = entry["parameters"]
    assert params["packing"] == "codes"
    assert params["code_bits"] == 2
    assert params["bitorder"] == "little"
    assert params["code_values"] == [2.0, None, 1.0, 0.0]
    assert params["ids_sha256"] == plink.ids_sha256(plink.read_bim(data.bim))
    plink.check_variants({"inputs": [entry]}, plink.read_bim(data.bim))
    other = plink.read_bim(data.bim)
    other.ids[0], other.ids[1] = other.ids[1], other.ids[0]
    with pytest.raises(plink.VariantMismatchError, match="not the model's"):
        plink.check_variants({"inputs": [entry]}, other)


def test_score_model_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_dataset(tmp_path / "d", 6, 10, seed=2)
    rows = [(data.ids[1], data.a2[1], [1.0, 2.0]), ("nope", "A", [1.0, 1.0])]
    score = _score_file(tmp_path / "s.txt", rows)
    out = tmp_path / "repo" / "m"
    args = ["genotypes", "score-model", "--bim", str(data.bim), "--bed", str(data.bed),
            "--score", str(score), "--score-cols", "3-4", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "1 variants processed" in text
    assert "1 score file entries skipped: variant id not in the data (nope)" in text
    assert check_repository(tmp_path / "repo", max_operator_bytes=LIMIT) == []
    assert main(args) == 1  # never overwrites a model
    assert "already holds a model" in capsys.readouterr().err


def test_bad_inputs_are_refused(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "d", 4, 8, seed=4)
    unknown = _score_file(tmp_path / "u.txt", [("x1", "A", [1.0]), ("x2", "C", [2.0])])
    with pytest.raises(PlinkError, match="no row matches a variant and allele"):
        write_score_model(data.bim, data.bed, unknown, tmp_path / "m")
    bad = tmp_path / "b.txt"
    bad.write_text(f"ID A W\n{data.ids[0]}\tA\t1.0\n{data.ids[1]}\tC\tabc\n")
    with pytest.raises(ScoreFileError, match=r"line 3: weights \['abc'\] are not finite"):
        write_score_model(data.bim, data.bed, bad, tmp_path / "m", id_col=1)
    twice = _score_file(tmp_path / "t.txt", [(data.ids[0], data.a1[0], [1.0])] * 2)
    with pytest.raises(ScoreFileError, match="again"):
        write_score_model(data.bim, data.bed, twice, tmp_path / "m")
    data.bed.write_bytes(data.bed.read_bytes()[:-1])
    ok = _score_file(tmp_path / "o.txt", [(data.ids[0], data.a1[0], [1.0])])
    with pytest.raises(PlinkError, match="bytes; 8 variants x 4 samples take"):
        write_score_model(data.bim, data.bed, ok, tmp_path / "m")


def _codes_input(**over: Any) -> dict[str, Any]:
    inp = {"name": "g", "datatype": "FP32", "shape": [10], "packing": "codes", "code_bits": 2,
           "bitorder": "little", "code_values": [2.0, float("nan"), 1.0, 0.0]}  # fmt: skip
    inp.update(over)
    return {"inputs": [inp], "model": {"file": "m.pt2"},
            "outputs": [{"name": "y", "datatype": "FP32"}]}  # fmt: skip


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"code_bits": 3}, "inputs[0].code_bits: Input should be 1, 2 or 4"),
        ({"code_values": [1.0, 2.0]}, "code_values needs 4 values for code_bits = 2"),
        ({"code_bits": None}, "needs code_bits"),
        ({"datatype": "INT32"}, "needs a floating-point datatype"),
        ({"missing": "means"}, "missing names a tensor of missing_file"),
        ({"packing": "none"}, "only apply to packing"),
    ],
)
def test_codes_config_errors(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(_codes_input(**over), "config.toml")
    assert message in str(e.value)


def test_codes_input_wire_shape() -> None:
    cfg = parse_config(_codes_input(), "config.toml")
    assert cfg.inputs[0].packed_shape == [3]
    cfg = parse_config(_codes_input(code_bits=4, code_values=[0.0] * 16, shape=[2, 5]), "c")
    assert cfg.inputs[0].packed_shape == [2, 3]


@pytest.mark.skipif(shutil.which("plink2") is None, reason="plink2 is not installed")
def test_matches_plink2(tmp_path: Path) -> None:
    """plink2 --dummy data, 2% missing, scores on both alleles, two columns: every sample's
    columns equal plink2's to 1e-5 relative (plink2 prints 6 significant digits)."""
    run = ["plink2", "--threads", "1", "--memory", "1000"]
    subprocess.run([*run, "--dummy", "60", "150", "0.02", "acgt", "--make-bed", "--out",
                    str(tmp_path / "d")], check=True, capture_output=True)  # fmt: skip
    variants = plink.read_bim(tmp_path / "d.bim")
    rng = np.random.default_rng(0)
    rows = [(v, a1 if rng.random() < 0.5 else a2, rng.normal(size=2).round(5).tolist())
            for v, a1, a2 in zip(variants.ids, variants.a1, variants.a2, strict=True)]  # fmt: skip
    score = _score_file(tmp_path / "s.txt", [*rows[5:], ("rs_absent", "A", [1.0, 1.0])])
    subprocess.run([*run, "--bfile", str(tmp_path / "d"), "--score", str(score), "1", "2",
                    "header", "cols=+scoresums", "--score-col-nums", "3-4", "--out",
                    str(tmp_path / "o")], check=True, capture_output=True)  # fmt: skip
    lines = (tmp_path / "o.sscore").read_text().splitlines()
    assert lines[0].split() == ["#FID", "IID", "PHENO1", "ALLELE_CT", "NAMED_ALLELE_DOSAGE_SUM",
                                "SCORE1_AVG", "SCORE2_AVG", "SCORE1_SUM", "SCORE2_SUM"]  # fmt: skip
    want = np.array([line.split()[3:] for line in lines[1:]], float)
    write_score_model(tmp_path / "d.bim", tmp_path / "d.bed", score, tmp_path / "repo" / "m",
                      score_cols=[3, 4])  # fmt: skip
    ct, ds, avg, sums = _run(tmp_path / "repo" / "m", plink.read_bed(tmp_path / "d.bed"))
    got = np.column_stack([ct, ds, avg, sums])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)


def test_bulk_score_matches_and_agrees_with_the_client_transpose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.genotypes.plink_files import open_bed, sample_major

    data = write_dataset(tmp_path / "d", 23, 31, seed=9)
    blocks = np.asarray(open_bed(data.bed, 23, 31))
    np.testing.assert_array_equal(sample_major(blocks, 23, block_variants=8),
                                  plink.read_bed(data.bed))  # fmt: skip
    rows = [(v, data.a2[i], [float(i), 1.0]) for i, v in enumerate(data.ids) if i % 3]
    score = _score_file(tmp_path / "s.txt", rows)
    write_score_model(data.bim, data.bed, score, tmp_path / "repo" / "m", score_cols=[3, 4],
                      max_batch_size=8)  # fmt: skip
    out = tmp_path / "o.sscore"
    args = ["genotypes", "score", "--model-repository", str(tmp_path / "repo"), "--model", "m",
            str(data.bed), str(out)]  # fmt: skip
    assert main(args) == 0
    assert "23 samples scored" in capsys.readouterr().out
    lines = out.read_text().splitlines()
    assert lines[0].split("\t")[:4] == ["#FID", "IID", "ALLELE_CT", "NAMED_ALLELE_DOSAGE_SUM"]
    assert lines[1].split("\t")[:2] == ["F", "S0"]
    got = np.array([line.split("\t")[2:] for line in lines[1:]], float)
    want = np.column_stack(plink_score(data, rows))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    other = write_dataset(tmp_path / "x", 23, 30, seed=9)
    assert main([*args[:-2], str(other.bed), str(out)]) == 1
    assert "are not the model's" in capsys.readouterr().err


def test_code_counts_all_samples_and_founders(tmp_path: Path) -> None:
    from service.genotypes.plink_files import code_counts, open_bed

    data = write_dataset(tmp_path / "d", 19, 40, seed=8, missing=0.1)
    bed = open_bed(data.bed, 19, 40)
    want = (data.codes.T[:, :, None] == np.arange(4)).sum(1)
    np.testing.assert_array_equal(code_counts(bed, 19), want)
    keep = np.arange(19) % 3 != 0
    want = (data.codes[keep].T[:, :, None] == np.arange(4)).sum(1)
    np.testing.assert_array_equal(code_counts(bed, 19, keep), want)
