"""Genotype models served by a real ``bitserve serve``: a ``[score]`` model written by
``bitserve genotypes score-model`` and scored from a ``.bed`` through the client
(``bitserve_client.plink.score_bed``) and over gRPC (tritonclient); a torch.export model
handed a ``packing = "codes"`` input decoded into float32 with mean imputation."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from bitserve_client import Client, InvalidInputError, plink
from safetensors.numpy import save_file
from tritonclient.utils import InferenceServerException

from service.genotypes import write_score_model
from tests.genotypes.plink_data import DOSAGE, Dataset, plink_score, write_dataset

pytestmark = pytest.mark.e2e
N, L = 37, 53


class Weighted(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("w", w)

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return g @ self.w  # type: ignore[no-any-return]


@pytest.fixture
def data(tmp_path: Path) -> Dataset:
    return write_dataset(tmp_path / "d", N, L, seed=11, missing=0.05)


def _repo(tmp_path: Path, data: Dataset) -> tuple[Path, list[tuple[str, str, list[float]]],
                                                  np.ndarray, np.ndarray]:  # fmt: skip
    rng = np.random.default_rng(1)
    rows = [(v, data.a1[i] if i % 2 else data.a2[i], rng.normal(size=2).round(6).tolist())
            for i, v in enumerate(data.ids)]  # fmt: skip
    score = tmp_path / "s.txt"
    score.write_text("".join(f"{v} {a} {w[0]!r} {w[1]!r}\n" for v, a, w in rows))
    repo = tmp_path / "repo"
    write_score_model(data.bim, data.bed, score, repo / "prs", score_cols=[3, 4],
                      max_batch_size=16)  # fmt: skip
    # A generic model of the same codes: decoded first-allele dosages, means for missing.
    folder = repo / "dosage"
    folder.mkdir()
    means = rng.uniform(0, 2, L)
    save_file({"means": means}, str(folder / "means.safetensors"))
    w = rng.normal(size=(L, 3)).astype(np.float32)
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(Weighted(torch.from_numpy(w)), (torch.zeros(2, L),),
                             dynamic_shapes={"g": {0: batch}})  # fmt: skip
    torch.export.save(ep, str(folder / "model.pt2"))
    (folder / "config.toml").write_text(f"""max_batch_size = 8
[[inputs]]
name = "g"
datatype = "FP32"
shape = [{L}]
packing = "codes"
code_bits = 2
bitorder = "little"
code_values = [2.0, nan, 1.0, 0.0]
missing = "means"
missing_file = "means.safetensors"
[model]
file = "model.pt2"
[[outputs]]
name = "y"
datatype = "FP32"
""")
    return repo, rows, means, w


def test_codes_over_rest_and_grpc(server_factory: Any, tmp_path: Path, data: Dataset) -> None:
    repo, rows, means, w = _repo(tmp_path, data)
    server = server_factory(repo)
    want = plink_score(data, rows)
    codes = plink.read_bed(data.bed)
    with Client(server.url) as client:
        meta = client.model_metadata("prs")
        assert meta["inputs"][0]["datatype"] == "UINT8"
        assert meta["inputs"][0]["shape"] == [-1, math.ceil(L / 4)]
        got = plink.score_bed(client, "prs", data.bed, batch_size=8, progress=False)
        assert got.rows == N
        for name, exp in zip(("ALLELE_CT", "NAMED_ALLELE_DOSAGE_SUM", "SCORE_AVG", "SCORE_SUM"),
                             want, strict=True):  # fmt: skip
            np.testing.assert_allclose(np.asarray(got[name]).reshape(exp.shape), exp,
                                       rtol=1e-12, atol=1e-12)  # fmt: skip
        # the generic model: decoded values with the model's means, then its weights
        y = client.infer("dosage", codes[:5])["y"]
        dosage = DOSAGE[data.codes[:5]]
        dense = np.where(np.isnan(dosage), means[None, :], dosage).astype(np.float32)
        np.testing.assert_allclose(y, dense @ w, rtol=1e-5, atol=1e-5)
        # a wrong length is refused with the wire shape (here by the client, below the server)
        with pytest.raises(InvalidInputError, match=r"expects shape \[batch, 14\]"):
            client.infer("prs", codes[:2, :-1])
    g = grpcclient.InferenceServerClient(server.grpc_target)
    inp = grpcclient.InferInput("genotypes", list(codes[:4].shape), "UINT8")
    inp.set_data_from_numpy(np.ascontiguousarray(codes[:4]))
    res = g.infer("prs", [inp])
    np.testing.assert_allclose(res.as_numpy("SCORE_SUM"), want[3][:4], rtol=1e-12, atol=1e-12)
    meta = g.get_model_metadata("prs", as_json=True)
    assert meta["inputs"][0]["datatype"] == "UINT8"
    short = grpcclient.InferInput("genotypes", [2, 13], "UINT8")
    short.set_data_from_numpy(np.ascontiguousarray(codes[:2, :13]))
    with pytest.raises(
        InferenceServerException, match=r"has shape \[2, 13\]; expected \[batch, 14\] for UINT8"
    ):
        g.infer("prs", [short])


def test_score_bed_refuses_other_variants(server_factory: Any, tmp_path: Path,
                                          data: Dataset) -> None:  # fmt: skip
    repo, *_ = _repo(tmp_path, data)
    server = server_factory(repo)
    other = write_dataset(tmp_path / "other", N, L, seed=12)
    lines = other.bim.read_text().splitlines()
    other.bim.write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    with Client(server.url) as client, pytest.raises(plink.VariantMismatchError):
        plink.score_bed(client, "prs", other.bed, progress=False)
