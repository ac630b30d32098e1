"""``bitserve score`` of a PLINK ``.bed`` without ``--address``: scored in the process, no Ray
(``service.ray.bed_local``), into the files the Ray path writes.

The reference is the Ray path's own pieces run without a cluster: the ``.bed`` as its Parquet
rows (``bed_as_parquet``), scored by the actors' scorer on an Arrow batch (``BatchScorer``,
whose output columns Ray Data's ``batch_to_block`` makes) and written as its writer writes a
run of rows (``pq.write_table``); the files must have the same Arrow schema, byte for byte,
and the same rows (tests/ray/test_bed_e2e.py compares with a real ``bitserve score --ray``).
The scores are also checked against plink2's semantics in NumPy."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from service.cli import main
from service.genotypes import write_score_model
from service.ray.bed_input import bed_as_parquet
from service.ray.outputs import tensor_column, write_run
from service.ray.scorer import BatchScorer, read_config
from tests.genotypes.plink_data import Dataset, plink_score, write_dataset

pytest.importorskip("ray")

N, L = 23, 30
OUTPUTS = ["ALLELE_CT", "NAMED_ALLELE_DOSAGE_SUM", "SCORE_AVG", "SCORE_SUM"]
Rows = list[tuple[str, str, list[float]]]


def _data(tmp_path: Path, scale: float = 1.0, version: str | None = None) -> tuple[Dataset, Rows]:
    """A .bed of N samples (distinct FIDs, to see them passed through) and a two-column
    score model of it in tmp_path/repo/prs (or its folder ``version``)."""
    data = write_dataset(tmp_path / "d", N, L, seed=11)
    fam = data.bed.with_suffix(".fam")
    fam.write_text("".join(f"{_fid(i)}\t{line.split()[1]}\t0\t0\t1\t-9\n"
                           for i, line in enumerate(fam.read_text().splitlines())))  # fmt: skip
    rows = [(v, data.a1[i] if i % 3 else data.a2[i], [scale * (i - 7.5), scale * 0.25 * i])
            for i, v in enumerate(data.ids) if i % 5 != 2]  # fmt: skip
    score = tmp_path / f"s{version or ''}.txt"
    score.write_text("".join(f"{v} {a} {w[0]} {w[1]}\n" for v, a, w in rows))
    folder = tmp_path / "repo" / "prs"
    write_score_model(data.bim, data.bed, score, folder / version if version else folder,
                      score_cols=[3, 4], max_batch_size=8)  # fmt: skip
    return data, rows


def _fid(i: int) -> str:
    return f"fam{i % 5}" + ("-é" if i == 3 else "")  # one not ASCII


def _score(tmp_path: Path, data: Dataset, out: Path, *extra: str) -> int:
    return main(["score", "--model-repository", str(tmp_path / "repo"), "--model", "prs",
                 *extra, str(data.bed), str(out)])  # fmt: skip


def _ray_path_file(tmp_path: Path, data: Dataset, keep_inputs: bool) -> Path:
    """What the Ray path writes for the whole .bed, from its own pieces (no cluster)."""
    _, cfg = read_config(tmp_path / "repo", "prs")
    (tmp_path / "as-parquet").mkdir(exist_ok=True)
    rows = pq.read_table(bed_as_parquet(data.bed, tmp_path / "as-parquet", cfg))
    scored = BatchScorer(tmp_path / "repo", "prs", device="cpu", keep_inputs=keep_inputs)(rows)
    path = tmp_path / f"ray-path-{keep_inputs}.parquet"
    pq.write_table(scored, path)
    return path


def _arrow_schema(path: Path) -> bytes:
    meta = pq.ParquetFile(path).metadata.metadata
    assert meta is not None
    return bytes(meta[b"ARROW:schema"])


def _values(table: pa.Table, name: str) -> np.ndarray:
    return np.stack(table.column(name).to_numpy(zero_copy_only=False)).astype(float)


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("keep_inputs", [False, True])
def test_a_bed_is_scored_here_into_the_ray_paths_files(
    tmp_path: Path, keep_inputs: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    data, rows = _data(tmp_path)
    out = tmp_path / "scores"
    keep = ["--keep-inputs"] if keep_inputs else []
    assert _score(tmp_path, data, out, *keep) == 0
    line = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"{re.escape(str(out))}: {N} row\(s\) scored, 0 already there, "
                        r"1 file\(s\), \d+\.\d s \([\d,]+ rows/s\)", line), line  # fmt: skip
    assert _files(out) == ["d"]
    assert _files(out / "d") == [f"000000000000-{N:012d}.parquet"]
    got_path = out / "d" / _files(out / "d")[0]
    want_path = _ray_path_file(tmp_path, data, keep_inputs)
    assert _arrow_schema(got_path) == _arrow_schema(want_path)  # names, types, metadata
    got, want = pq.read_table(got_path), pq.read_table(want_path)
    assert got.schema == want.schema
    names = ["FID", "IID", *(["genotypes"] if keep_inputs else []), *OUTPUTS]
    assert got.column_names == names
    for name in names[: 3 if keep_inputs else 2]:
        assert got.column(name).equals(want.column(name)), name
    assert got.column("FID").to_pylist() == [_fid(i) for i in range(N)]
    for name in OUTPUTS:
        np.testing.assert_allclose(_values(got, name), _values(want, name), rtol=1e-12)
    ct, ds, avg, sums = plink_score(data, rows)
    np.testing.assert_array_equal(_values(got, "ALLELE_CT")[:, 0], ct)
    np.testing.assert_array_equal(_values(got, "NAMED_ALLELE_DOSAGE_SUM")[:, 0], ds)
    np.testing.assert_allclose(_values(got, "SCORE_AVG"), avg, rtol=1e-12)
    np.testing.assert_allclose(_values(got, "SCORE_SUM"), sums, rtol=1e-12, atol=1e-12)


def test_a_model_the_kernel_cannot_take_is_loaded_as_serve_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No C kernels: the model as the Ray path's actors load it (torch), the same file."""
    import torch

    data, _ = _data(tmp_path)
    assert _score(tmp_path, data, tmp_path / "fast") == 0
    monkeypatch.setenv("BITSERVE_CPU_KERNELS", "0")
    threads = torch.get_num_threads()
    try:
        assert _score(tmp_path, data, tmp_path / "served", "--threads", "1") == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert "the CPU code kernels are unavailable: loading it as serve does" in caplog.text
    name = f"000000000000-{N:012d}.parquet"
    fast, served = tmp_path / "fast" / "d" / name, tmp_path / "served" / "d" / name
    assert _arrow_schema(fast) == _arrow_schema(served)
    got, want = pq.read_table(served), pq.read_table(fast)
    for column in OUTPUTS:
        np.testing.assert_allclose(_values(got, column), _values(want, column), rtol=1e-12)


def test_resumed_from_the_rows_already_there(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run again: nothing scored. Rows 0-9 and 15-22 already there (as a Ray job that
    stopped would leave them, a first sample within a byte of the .bed): only 10-14 scored."""
    data, _ = _data(tmp_path)
    out = tmp_path / "scores"
    assert _score(tmp_path, data, out) == 0
    whole_path = out / "d" / f"000000000000-{N:012d}.parquet"
    whole = pq.read_table(whole_path)
    capsys.readouterr()
    assert _score(tmp_path, data, out) == 0
    assert f": 0 row(s) scored, {N} already there, 1 file(s)" in capsys.readouterr().out
    assert _files(out / "d") == [whole_path.name]

    whole_schema = _arrow_schema(whole_path)
    whole_path.unlink()
    fs = pafs.LocalFileSystem()
    write_run(fs, str(out / "d"), 0, 10, whole.slice(0, 10))
    write_run(fs, str(out / "d"), 15, N, whole.slice(15))
    (out / "d" / ".000000000010-000000000015.parquet.tmp-dead").write_bytes(b"half")
    assert _score(tmp_path, data, out) == 0
    assert f": 5 row(s) scored, {N - 5} already there, 1 file(s)" in capsys.readouterr().out
    assert _files(out / "d") == ["000000000000-000000000010.parquet",
                                 "000000000010-000000000015.parquet",
                                 f"000000000015-{N:012d}.parquet"]  # fmt: skip
    middle = out / "d" / "000000000010-000000000015.parquet"
    # (the files around it were written here from a table read back, whose list columns
    # Parquet names "element" unless Ray's tensor type is registered: compare with the run's)
    assert _arrow_schema(middle) == whole_schema
    again = pa.concat_tables([pq.read_table(out / "d" / f) for f in _files(out / "d")])
    assert again.column("IID").equals(whole.column("IID"))
    for column in OUTPUTS:
        np.testing.assert_allclose(_values(again, column), _values(whole, column), rtol=1e-12)


def test_other_variants_are_refused_and_nothing_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _data(tmp_path)
    other = write_dataset(tmp_path / "o", N, L + 1, seed=11)
    out = tmp_path / "scores"
    assert _score(tmp_path, other, out) == 1
    err = capsys.readouterr().err
    assert "o.bim: its variants (ids and alleles, in order) are not the model's 'prs'" in err
    assert not out.exists()
    reordered = write_dataset(tmp_path / "r", N, L, seed=11)
    lines = reordered.bim.read_text().splitlines()
    reordered.bim.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    assert _score(tmp_path, reordered, out) == 1
    assert "are not the model's 'prs'" in capsys.readouterr().err
    assert not out.exists()


def test_the_model_version_is_honoured_and_a_missing_one_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = _data(tmp_path, 1.0, "1")
    _data(tmp_path, 2.0, "2")
    name = f"000000000000-{N:012d}.parquet"
    assert _score(tmp_path, data, tmp_path / "v2") == 0  # the highest by default
    assert _score(tmp_path, data, tmp_path / "v1", "--model-version", "1") == 0
    v1 = _values(pq.read_table(tmp_path / "v1" / "d" / name), "SCORE_SUM")
    v2 = _values(pq.read_table(tmp_path / "v2" / "d" / name), "SCORE_SUM")
    np.testing.assert_allclose(v2, 2 * v1, rtol=1e-12)
    capsys.readouterr()
    assert _score(tmp_path, data, tmp_path / "v7", "--model-version", "7") == 1
    assert "no version 7" in capsys.readouterr().err
    assert main(["score", "--model-repository", str(tmp_path / "repo"), "--model", "nope",
                 str(data.bed), str(tmp_path / "nope")]) == 1  # fmt: skip
    assert "bitserve score: repo/nope: no such model folder" in capsys.readouterr().err
    assert not (tmp_path / "v7").exists()
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize(
    "option",
    [["--actors", "2"], ["--num-gpus", "1"], ["--num-cpus", "1"], ["--rows-per-task", "8"],
     ["--resources", '{"scorer": 1}'], ["--bitorder", "little"], ["--k", "3"],
     ["--threshold", "0.5"]],
)  # fmt: skip
def test_options_for_ray_or_other_inputs_are_refused(
    tmp_path: Path, option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = _data(tmp_path)
    assert _score(tmp_path, data, tmp_path / "scores", *option) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"bitserve score: {option[0]} ")
    assert "add --ray to score it on Ray" in err
    assert not (tmp_path / "scores").exists()


def test_bitorder_is_refused_for_a_bed_on_ray_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A .bed's codes are in PLINK's order: --bitorder big would misread them (refused before
    Ray starts)."""
    data, _ = _data(tmp_path)
    assert _score(tmp_path, data, tmp_path / "scores", "--ray", "--bitorder", "big") == 2
    assert "--bitorder does not apply to a .bed's codes" in capsys.readouterr().err
    assert not (tmp_path / "scores").exists()


def test_the_command_imports_neither_torch_nor_ray_nor_pandas(tmp_path: Path) -> None:
    data, rows = _data(tmp_path)
    out = tmp_path / "scores"
    code = (
        "import sys; from service.cli import main; "
        f"rc = main(['score', '--threads', '1', '--model-repository', {str(tmp_path / 'repo')!r}, "
        f"'--model', 'prs', {str(data.bed)!r}, {str(out)!r}]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; "
        "assert 'ray' not in sys.modules, 'ray was imported'; "
        "assert 'pandas' not in sys.modules, 'pandas was imported (0.2 s)'; sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # the C kernel: no fall-back
    assert f"{N} row(s) scored" in done.stdout
    table = pq.read_table(out / "d" / f"000000000000-{N:012d}.parquet")
    np.testing.assert_allclose(_values(table, "SCORE_SUM"), plink_score(data, rows)[3],
                               rtol=1e-12, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize(
    "values",
    [np.arange(5.0), np.arange(5.0).reshape(5, 1), np.arange(15, dtype=np.float32).reshape(5, 3),
     np.arange(30, dtype=np.int32).reshape(5, 2, 3), np.arange(10.0).reshape(2, 5)[:, ::2],
     np.array([[True, False], [False, True], [True, True]])],
    ids=["1d", "5x1", "5x3-f32", "5x2x3-i32", "strided", "bool"],
)  # fmt: skip
def test_tensor_columns_are_ray_datas(tmp_path: Path, values: np.ndarray) -> None:
    """An output column as Ray Data's batch_to_block makes it, written and read back the same."""
    from ray.data.block import BlockAccessor

    field, column = tensor_column("x", values)
    ours = pa.Table.from_arrays([column], schema=pa.schema([field]))
    rays = BlockAccessor.batch_to_block({"x": values})
    pq.write_table(ours, tmp_path / "ours.parquet")
    pq.write_table(rays, tmp_path / "rays.parquet")
    assert _arrow_schema(tmp_path / "ours.parquet") == _arrow_schema(tmp_path / "rays.parquet")
    assert pq.read_table(tmp_path / "ours.parquet").equals(pq.read_table(tmp_path / "rays.parquet"))
