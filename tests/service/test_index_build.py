"""``bitserve index build`` from .npy, Parquet and SMILES, and ``bitserve check-repo`` on what
it writes (the folders then serve, as the pipeline tests search them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file

from service.cli import main
from service.models.config import load_config
from tests.service.index_cases import random_bits


def built(folder: Path) -> tuple[Any, dict[str, np.ndarray[Any, Any]]]:
    return load_config(folder / "config.toml"), load_file(str(folder / "corpus.safetensors"))


def check_repo(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["check-repo", str(root)])
    out = capsys.readouterr()
    return code, out.out + out.err


def test_build_from_npy_packed_and_bool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(0)
    bits = random_bits(rng, 30, 100)
    np.save(tmp_path / "bits.npy", bits)
    np.save(tmp_path / "packed.npy", np.packbits(bits, axis=1, bitorder="little"))
    root = tmp_path / "repo"
    assert main(["index", "build", str(tmp_path / "bits.npy"), str(root / "a"), "--metric",
                 "hamming", "--bitorder", "little", "--k", "4"]) == 0  # fmt: skip
    assert main(["index", "build", str(tmp_path / "packed.npy"), str(root / "b"), "--metric",
                 "tanimoto", "--bitorder", "little", "--nbits", "100"]) == 0  # fmt: skip
    cfg_a, tensors_a = built(root / "a")
    cfg_b, tensors_b = built(root / "b")
    assert cfg_a.inputs[0].shape == [100]  # the bool rows' own length
    assert (cfg_a.inputs[0].bitorder, cfg_a.index.metric, cfg_a.index.k) == ("little", "hamming", 4)
    assert cfg_b.index.metric == "tanimoto"
    np.testing.assert_array_equal(tensors_a["corpus"], np.packbits(bits, axis=1, bitorder="little"))
    np.testing.assert_array_equal(tensors_b["corpus"], tensors_a["corpus"])
    assert "ids" not in tensors_a
    assert check_repo(root, capsys)[0] == 0


@pytest.mark.parametrize("kind", ["binary", "fixed", "list"])
def test_build_from_parquet(tmp_path: Path, kind: str) -> None:
    rng = np.random.default_rng(1)
    rows = np.packbits(random_bits(rng, 12, 64), axis=1)
    values: Any = [r.tobytes() for r in rows]
    column = {
        "binary": pa.array(values, pa.binary()),
        "fixed": pa.array(values, pa.binary(8)),
        "list": pa.array([r.tolist() for r in rows], pa.list_(pa.uint8())),
    }[kind]
    ids = np.arange(12, dtype=np.int64) * 7 + 1
    table = pa.table({"fp": column, "mol_id": pa.array(ids), "name": [f"m{i}" for i in range(12)]})
    pq.write_table(table.slice(2), tmp_path / "fps.parquet")  # a slice: offsets not at 0
    out = tmp_path / "repo" / "fps"
    args = ["index", "build", str(tmp_path / "fps.parquet"), str(out), "--metric", "tanimoto",
            "--column", "fp", "--id-column", "mol_id", "--k", "3"]  # fmt: skip
    assert main(args) == 0
    cfg, tensors = built(out)
    np.testing.assert_array_equal(tensors["corpus"], rows[2:])
    np.testing.assert_array_equal(tensors["ids"], ids[2:])
    assert (cfg.inputs[0].shape, cfg.inputs[0].bitorder) == ([64], "big")


def test_build_from_smiles_with_rdkit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rdkit import Chem, DataStructs
    from rdkit.Chem import rdFingerprintGenerator

    smiles = ["CCO", "c1ccccc1", "not-a-molecule", "CC(=O)O", "CCN"]
    (tmp_path / "a.smi").write_text("".join(f"{s} {50 + i}\n" for i, s in enumerate(smiles)))
    (tmp_path / "b.smi").write_text("".join(f"{s}\n" for s in smiles))
    root = tmp_path / "repo"
    for name, extra in (("a", []), ("b", ["--radius", "3", "--nbits", "1024"])):
        args = ["index", "build", str(tmp_path / f"{name}.smi"), str(root / name), "--metric",
                "tanimoto", "--k", "2", *extra]  # fmt: skip
        assert main(args) == 0
        assert "1 molecules RDKit could not read skipped" in capsys.readouterr().out
    cfg, tensors = built(root / "a")
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    want = [DataStructs.BitVectToBinaryText(gen.GetFingerprint(Chem.MolFromSmiles(s)))
            for s in smiles if s != "not-a-molecule"]  # fmt: skip
    assert [r.tobytes() for r in tensors["corpus"]] == want
    assert tensors["ids"].tolist() == [50, 51, 53, 54]  # the file's ids
    assert (cfg.inputs[0].shape, cfg.inputs[0].bitorder) == ([2048], "little")
    cfg_b, tensors_b = built(root / "b")
    assert tensors_b["ids"].tolist() == [0, 1, 3, 4]  # record numbers: still into the file
    assert tensors_b["corpus"].shape == (4, 128)
    assert cfg_b.inputs[0].shape == [1024]
    assert check_repo(root, capsys)[0] == 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--metric", "tanimoto"], "a Parquet input needs --column"),
        (["--metric", "tanimoto", "--column", "nope"], "nope"),
        (["--metric", "tanimoto", "--column", "fp", "--k", "99"], "12 rows, fewer than --k 99"),
        (["--metric", "tanimoto", "--column", "fp", "--id-column", "dup"], "ids are not unique"),
        (["--metric", "tanimoto", "--column", "fp", "--nbits", "70"], "--nbits 70 needs 9 bytes"),
    ],
)
def test_build_refuses_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    rows = np.zeros((12, 8), np.uint8)
    table = pa.table({"fp": pa.array([r.tobytes() for r in rows]), "dup": pa.array([1] * 12)})
    pq.write_table(table, tmp_path / "fps.parquet")
    assert main(["index", "build", str(tmp_path / "fps.parquet"), str(tmp_path / "m"), *args]) == 1
    assert needle in capsys.readouterr().err


def test_build_never_overwrites_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.save(tmp_path / "rows.npy", np.zeros((20, 8), np.uint8))
    args = [
        "index",
        "build",
        str(tmp_path / "rows.npy"),
        str(tmp_path / "m"),
        "--metric",
        "hamming",
    ]
    assert main(args) == 0
    assert main(args) == 1
    assert "exists; not overwritten" in capsys.readouterr().err


def test_check_repo_cli_reports_a_bad_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "rows.npy", np.zeros((20, 8), np.uint8))
    folder = tmp_path / "repo" / "m"
    assert (
        main(["index", "build", str(tmp_path / "rows.npy"), str(folder), "--metric", "hamming"])
        == 0
    )
    text = (folder / "config.toml").read_text().replace("k = 10", "k = 30")
    (folder / "config.toml").write_text(text)
    code, out = check_repo(tmp_path / "repo", capsys)
    assert code == 1
    assert "repo/m/config.toml: index.k: k = 30 is more than the corpus's 20 rows" in out
