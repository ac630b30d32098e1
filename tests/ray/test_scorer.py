"""``service.ray.scorer.BatchScorer`` on NumPy batches, without a Ray cluster.

The scorer's answers are checked against a float64 NumPy/torch reference of the same model,
for every column form Ray Data hands it (binary, fixed-size binary, lists of uint8, uint8
tensor columns), and the pass-through, chunking, bit order and error behaviour.
"""

from __future__ import annotations

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
