"""``service.ray.scorer.BatchScorer`` on NumPy batches, without a Ray cluster.

The scorer's answers are checked against a float64 NumPy/torch reference of the same model,
for every column form Ray Data hands it (binary, fixed-size binary, lists of uint8, uint8
tensor columns), and the pass-through, chunking, bit order and error behaviour.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.fingerprints import (
    BITS,
    MODEL,
    PACKED,
    packed_fingerprints,
    reference_scores,
    write_fingerprint_repository,
)
from harness.repo_utils import bits_input, model_toml, tensor, write_model_folder
from service.ray.scorer import BatchScorer, ColumnForm, ScoringError, find_version, read_config

pytest.importorskip("ray")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fingerprint MLP at max_batch_size 64 (batches of more rows are cut)."""
    return write_fingerprint_repository(tmp_path_factory.mktemp("ray-models"), max_batch_size=64)


@pytest.fixture(scope="module")
def scorer(repository: Path) -> BatchScorer:
    return BatchScorer(repository, MODEL, device="cpu")


def _ids(n: int) -> np.ndarray:
    return np.array([f"mol-{i}" for i in range(n)], dtype=object)


def _forms(packed: np.ndarray) -> dict[str, np.ndarray]:
    """One packed matrix in each column form Ray Data's NumPy batches hold."""
    rows = len(packed)
    as_bytes = np.empty(rows, dtype=object)
    as_bytes[:] = [r.tobytes() for r in packed]
    as_arrays = np.empty(rows, dtype=object)
    as_arrays[:] = [r.copy() for r in packed]
    return {"bytes": as_bytes, "arrays": as_arrays, "tensor": packed.copy()}


@pytest.mark.parametrize("form", ["bytes", "arrays", "tensor"])
def test_scores_match_the_reference_in_every_column_form(scorer: BatchScorer, form: str) -> None:
    rows = 150  # more than max_batch_size 64: three pipeline runs, the last one partial
    packed = packed_fingerprints(rows, seed=11)
    weight = np.random.default_rng(1).random(rows)
    out = scorer({"id": _ids(rows), "fp": _forms(packed)[form], "weight": weight})
    assert list(out) == ["id", "weight", "score"]  # pass-through first, the input dropped
    assert out["score"].dtype == np.float32
    assert out["score"].shape == (rows, 1)
    np.testing.assert_allclose(out["score"], reference_scores(packed), rtol=1e-5, atol=1e-5)
    assert list(out["id"]) == list(_ids(rows))
    np.testing.assert_array_equal(out["weight"], weight)


def test_batch_and_rows_give_the_same_answer(scorer: BatchScorer) -> None:
    """A row's score does not depend on the rows around it (the batch it was computed in)."""
    packed = packed_fingerprints(64, seed=3)
    whole = scorer({"fp": packed})["score"]
    one_by_one = np.concatenate([scorer({"fp": packed[i : i + 1]})["score"] for i in range(5)])
    np.testing.assert_allclose(one_by_one, whole[:5], rtol=1e-6, atol=1e-7)


def test_keep_inputs_and_an_empty_batch(repository: Path) -> None:
    s = BatchScorer(repository, MODEL, device="cpu", keep_inputs=True)
    packed = packed_fingerprints(3, seed=4)
    out = s({"fp": packed, "id": _ids(3)})
    assert list(out) == ["fp", "id", "score"]
    np.testing.assert_array_equal(out["fp"], packed)
    empty = s({"fp": np.empty((0, PACKED), np.uint8)})
    assert empty["score"].shape == (0, 1)


def test_bitorder_little_reads_lsb_first_bytes(repository: Path) -> None:
    bits = np.random.default_rng(9).random((20, BITS)) < 0.2
    little = np.packbits(bits, axis=-1, bitorder="little")
    s = BatchScorer(repository, MODEL, device="cpu", bitorder="little")
    out = s({"fp": little})["score"]
    np.testing.assert_allclose(out, reference_scores(np.packbits(bits, axis=-1)), atol=1e-5)


def test_the_highest_version_unless_told(tmp_path: Path) -> None:
    write_fingerprint_repository(tmp_path, max_batch_size=8, seed=0)
    (tmp_path / MODEL / "1").rename(tmp_path / MODEL / "2")
    write_fingerprint_repository(tmp_path, max_batch_size=8, seed=1)  # version 1, seed 1
    assert find_version(tmp_path, MODEL).version == "2"
    assert read_config(tmp_path, MODEL, "1")[0] == "1"
    packed = packed_fingerprints(4, seed=2)
    for version, seed in (("2", 0), ("1", 1)):
        v = None if version == "2" else version
        s = BatchScorer(tmp_path, MODEL, version=v, device="cpu")
        assert s.version == version
        np.testing.assert_allclose(
            s({"fp": packed})["score"], reference_scores(packed, seed), atol=1e-5
        )
    with pytest.raises(ScoringError, match="no version 3"):
        find_version(tmp_path, MODEL, "3")


def test_an_operator_model_and_a_model_without_batching(tmp_path: Path) -> None:
    """The operator path (bits unpacked into the band's dtype, resampled), batched and with
    ``max_batch_size = 0`` (one row a run, no batch dimension), against a dense float64
    reference."""
    n, b, a = 3, 40, 6
    gen = np.random.default_rng(0)
    x = np.sort(gen.random(b) * 40)
    c = gen.random((n, a)) * 40
    op = {"file": "op.safetensors", "response": "gaussian", "sigma": 2.0, "support": 30.0}
    for mbs in (4, 0):
        cfg = model_toml(max_batch_size=mbs, inputs=[bits_input(n, b)], operator=op,
                         outputs=[tensor("out", "FP32")])  # fmt: skip
        write_model_folder(tmp_path / f"op{mbs}", cfg, {"x": x, "c": c})
        s = BatchScorer(tmp_path, f"op{mbs}", device="cpu")
        bits = gen.random((7, n, b)) < 0.3
        out = s({"bits": np.packbits(bits, axis=-1)})["out"]
        dense = np.exp(-0.5 * ((c[:, :, None] - x[None, None, :]) / 2.0) ** 2)
        ref = np.einsum("nab,mnb->mna", dense, bits.astype(np.float64))
        assert out.shape == (7, n, a)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_a_float_input_beside_a_packed_one(tmp_path: Path) -> None:
    """Two inputs: the packed fingerprint and a float32 vector, handed to the model as its
    arguments in config order."""

    class Two(torch.nn.Module):
        def forward(self, fp: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return (fp[:, :4] * w).sum(dim=1, keepdim=True)

    folder = tmp_path / "two"
    folder.mkdir()
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(
        Two(), (torch.zeros(2, BITS), torch.zeros(2, 4)), dynamic_shapes=({0: batch}, {0: batch})
    )
    torch.export.save(ep, str(folder / "model.pt2"))
    (folder / "config.toml").write_text(
        model_toml(
            max_batch_size=8,
            inputs=[tensor("fp", "BOOL", [BITS], packing="bits"), tensor("w", "FP32", [4])],
            model={"file": "model.pt2"},
            outputs=[tensor("y", "FP32", [1])],
        )
    )
    s = BatchScorer(tmp_path, "two", device="cpu")
    packed = packed_fingerprints(10, seed=5)
    w = np.random.default_rng(2).random((10, 4)).astype(np.float32)
    out = s({"fp": packed, "w": w})["y"]
    bits = np.unpackbits(packed, axis=-1)[:, :4].astype(np.float64)
    np.testing.assert_allclose(out[:, 0], (bits * w).sum(axis=1), rtol=1e-6)
    with pytest.raises(ScoringError, match=r"column 'w' holds float64 \[4\] per row"):
        s({"fp": packed, "w": w.astype(np.float64)})


@pytest.mark.parametrize(
    ("column", "message"),
    [
        (lambda p: np.array([r.tobytes() for r in p[:, :-1]] + [b""], dtype=object),
         r"column 'fp', row 0 of the batch: 255 bytes; the model's input 'fp' takes 256 "
         r"packed bytes \(bits of \[2048\], bitorder big\) per row"),
        (lambda p: np.array([p[0].tobytes(), None], dtype=object),
         r"column 'fp', row 1 of the batch: null"),
        (lambda p: p[:2, :128], r"column 'fp' holds uint8 \[128\] per row"),
        (lambda p: p[:2].astype(np.int16), r"column 'fp' holds int16 \[256\] per row"),
    ],
)  # fmt: skip
def test_bad_rows_are_named(scorer: BatchScorer, column: Any, message: str) -> None:
    with pytest.raises(ScoringError, match=message):
        scorer({"fp": column(packed_fingerprints(2, seed=1))})


def test_missing_and_clashing_columns(scorer: BatchScorer) -> None:
    packed = packed_fingerprints(2)
    with pytest.raises(ScoringError, match=r"needs column\(s\) \['fp'\]; the batch has \['x'\]"):
        scorer({"x": packed})
    with pytest.raises(ScoringError, match=r"column\(s\) \['score'\] would be overwritten"):
        scorer({"fp": packed, "score": np.zeros(2)})


def test_unknown_model_and_broken_model(tmp_path: Path) -> None:
    write_fingerprint_repository(tmp_path)
    with pytest.raises(ScoringError, match="nope"):
        BatchScorer(tmp_path, "nope")
    (tmp_path / MODEL / "1" / "model.pt2").write_bytes(b"not a zip")
    with pytest.raises(ScoringError, match=r"model\.file: model\.pt2: cannot load"):
        BatchScorer(tmp_path, MODEL)


def test_column_form_describes_packed_and_plain_inputs(repository: Path) -> None:
    _, cfg = read_config(repository, MODEL)
    form = ColumnForm.of(cfg.inputs[0])
    assert (form.datatype, form.shape, form.row_bytes) == ("UINT8", (PACKED,), PACKED)


# --- Arrow batches (what service.ray.score asks Ray Data for) --------------------------------


def _arrow_forms(packed: np.ndarray) -> dict[str, Any]:
    """One packed matrix in each Arrow column form a Parquet file or Ray Data gives."""
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    rows = [r.tobytes() for r in packed]
    fixed = pa.array(rows, pa.binary(PACKED))
    lists = pa.FixedSizeListArray.from_arrays(pa.array(packed.ravel()), PACKED)
    return {
        "binary": pa.array(rows, pa.binary()),
        "large_binary": pa.array(rows, pa.large_binary()),
        "fixed_size_binary": fixed,
        "fixed_size_list": lists,
        "list": pa.array([r.tolist() for r in packed], pa.list_(pa.uint8())),
        "tensor": ArrowTensorArray.from_numpy(packed),
        # several chunks, and a chunk that is a slice (an offset into its buffers)
        "chunked": pa.chunked_array([pa.array(rows[:7]), pa.array(["x" * 9, *rows[7:]]).slice(1)]),
    }


ARROW_FORMS = ("binary", "large_binary", "fixed_size_binary", "fixed_size_list", "list",
               "tensor", "chunked")  # fmt: skip


@pytest.mark.parametrize("form", ARROW_FORMS)
def test_arrow_batches_score_as_numpy_batches(scorer: BatchScorer, form: str) -> None:
    """Every Arrow form scores as the reference does; the other columns pass through as
    they were (the same Arrow types, no Python objects in between)."""
    import pyarrow as pa

    rows = 150
    packed = packed_fingerprints(rows, seed=21)
    ids = pa.array([f"mol-{i}" for i in range(rows)])
    weight = pa.array(np.random.default_rng(3).random(rows))
    table = pa.table({"id": ids, "fp": _arrow_forms(packed)[form], "weight": weight})
    out = scorer(table)
    assert isinstance(out, pa.Table)
    assert out.column_names == ["id", "weight", "score"]
    assert out.column("id").type == pa.string()
    assert out.column("id").equals(table.column("id"))
    assert out.column("weight").equals(table.column("weight"))
    scores = np.stack(out.column("score").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(scores, reference_scores(packed), rtol=1e-5, atol=1e-5)
    # the same type Ray Data makes of the NumPy path's (rows, 1) float32 column
    from ray.data.block import BlockAccessor

    numpy_out = BlockAccessor.batch_to_block(scorer({"fp": packed}))
    assert out.schema.field("score") == numpy_out.schema.field("score")


def test_arrow_views_are_the_bytes_in_place(scorer: BatchScorer) -> None:
    """The fast path against the plain one, on fresh random bytes: each Arrow form's view
    equals the per-row conversion, and for binary columns it is the Arrow buffer itself."""
    import pyarrow as pa

    form = scorer.forms[0]
    for seed in range(3):
        packed = np.random.default_rng(seed).integers(0, 256, (40, PACKED), dtype=np.uint8)
        for (name, whole), cut in itertools.product(_arrow_forms(packed).items(), (0, 3)):
            column = whole.slice(cut)  # a slice: an offset into the same buffers
            view = form.arrow_view(column)
            if name in ("list", "tensor"):
                assert view is None, name  # Ray's own conversion, then the per-row checks
                continue
            assert view is not None, name
            plain = form.array(column.to_numpy(zero_copy_only=False))
            np.testing.assert_array_equal(view, packed[cut:])
            np.testing.assert_array_equal(view, plain)
        binary = pa.array([r.tobytes() for r in packed]).slice(5)
        view = form.arrow_view(binary)
        assert view is not None
        assert np.shares_memory(view, np.frombuffer(binary.buffers()[2], np.uint8))
        np.testing.assert_array_equal(view, packed[5:])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([b"\x00" * PACKED, b"\x00" * 255], r"column 'fp', row 1 of the batch: 255 bytes"),
        ([b"\x00" * PACKED, None], r"column 'fp', row 1 of the batch: null"),
    ],
)
def test_bad_arrow_rows_are_named_as_numpy_ones(
    scorer: BatchScorer, values: list[bytes | None], message: str
) -> None:
    import pyarrow as pa

    with pytest.raises(ScoringError, match=message):
        scorer(pa.table({"fp": pa.array(values, pa.binary())}))


def test_arrow_keep_inputs_missing_and_clashing_columns(repository: Path) -> None:
    import pyarrow as pa

    packed = packed_fingerprints(3, seed=4)
    fp = pa.array([r.tobytes() for r in packed])
    kept = BatchScorer(repository, MODEL, device="cpu", keep_inputs=True)(pa.table({"fp": fp}))
    assert kept.column_names == ["fp", "score"]
    assert kept.column("fp").equals(pa.chunked_array([fp]))
    s = BatchScorer(repository, MODEL, device="cpu")
    with pytest.raises(ScoringError, match=r"needs column\(s\) \['fp'\]; the batch has \['x'\]"):
        s(pa.table({"x": fp}))
    with pytest.raises(ScoringError, match=r"column\(s\) \['score'\] would be overwritten"):
        s(pa.table({"fp": fp, "score": pa.array([1, 2, 3])}))
    empty = s(pa.table({"fp": pa.array([], pa.binary())}))
    assert (empty.num_rows, empty.column_names) == (0, ["score"])


def test_ray_batches_are_whole_model_batches(tmp_path: Path) -> None:
    from service.ray.data import BATCH_BYTES, BATCH_ROWS, batch_rows

    for mbs, want in ((1024, 8192), (64, 8192), (1000, 8000), (10000, 10000), (0, 8192)):
        cfg = parse_fp_config(mbs, [BITS])
        assert batch_rows(cfg) == want, mbs
        assert batch_rows(cfg) % max(mbs, 1) == 0
    wide = parse_fp_config(4, [8 * (BATCH_BYTES // 1000)])  # 1000 rows fill BATCH_BYTES
    assert batch_rows(wide) == 1000
    # a job of small blocks: a batch is at most a block, and at least one model batch
    assert batch_rows(parse_fp_config(64, [BITS]), most=250) == 192
    assert batch_rows(parse_fp_config(64, [BITS]), most=10) == 64
    assert BATCH_ROWS == 8192


def parse_fp_config(mbs: int, shape: list[int]) -> Any:
    import tomllib

    from service.models.config import parse_config

    text = model_toml(max_batch_size=mbs, inputs=[tensor("fp", "BOOL", shape, packing="bits")],
                      model={"file": "m.pt2"}, outputs=[tensor("score", "FP32", [1])])  # fmt: skip
    return parse_config(tomllib.loads(text), "config.toml")


def test_scorer_runs_the_threads_it_is_given(repository: Path) -> None:
    """``torch_threads`` (what ``plan_actors`` chose) becomes torch's intra-op thread count."""
    import torch

    before = torch.get_num_threads()
    try:
        BatchScorer(repository, MODEL, device="cpu", torch_threads=before + 1)
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)


def test_score_cli_refuses_zero_threads(
    repository: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    argv = ["score", "--model-repository", str(repository), "--model", MODEL, "--threads", "0"]
    assert main([*argv, str(tmp_path / "in.parquet"), str(tmp_path / "out")]) == 2
    assert "--threads must be at least 1" in capsys.readouterr().err
