"""A ``torch.export`` program that calls gpu_ops, served by a real ``bitserve serve`` (issue 15).

The model unpacks bit-packed bytes and resamples them twice (a stored band and an on-the-fly
response), is exported to ``model.pt2`` in a model repository (``[model] file =
"model.pt2"``, no ``[operator]``), and the server's answers are compared with the same module
in eager mode and with a float64 dense reference. The server loads the program only after
importing gpu_ops, which registers ``torch.ops.bitserve.*``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from torch import nn

import gpu_ops
from gpu_ops import BandedResampler, OnTheFlyResampler
from harness.repo_utils import model_toml, tensor
from harness.server import BitserveServer

pytestmark = pytest.mark.e2e

N, L, A = 3, 203, 11  # L is not a multiple of 8: the last byte of each row is padded
PACKED = (L + 7) // 8


class UnpackResample(nn.Module):
    """packed (M, N, ceil(L / 8)) bytes -> (stored band (M, N, A), on-the-fly (M, N, A))."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        x = torch.sort(torch.rand(L, generator=gen, dtype=torch.float64) * 100).values
        c = torch.rand(N, A, generator=gen, dtype=torch.float64) * 110 - 5  # unsorted
        self.stored = BandedResampler.from_response(x, c, "gaussian", sigma=2.0)
        self.fit = OnTheFlyResampler.from_response(x, c, "triangle", half_width=3.0)

    def forward(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # An input the operator does not take reaches the model as it is: UINT8 bytes.
        bits = gpu_ops.unpackbits(packed, dim=-1, count=L, dtype=torch.float32)
        return self.stored(bits), self.fit(bits)


CONFIG = model_toml(
    max_batch_size=16,
    max_queue_delay_us=2000,
    device="cpu",
    inputs=[tensor("packed", "UINT8", [N, PACKED])],
    model={"file": "model.pt2"},
    outputs=[tensor(name, "FP32", [N, A]) for name in ("stored", "on_the_fly")],
)


@pytest.fixture(scope="module")
def model() -> UnpackResample:
    return UnpackResample().eval()


@pytest.fixture(scope="module")
def repository(model: UnpackResample, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export-repo")
    folder = root / "unpack" / "1"
    folder.mkdir(parents=True)
    batch = torch.export.Dim("batch", min=1, max=16)
    example = torch.zeros(2, N, PACKED, dtype=torch.uint8)  # what the server passes
    ep = torch.export.export(model, (example,), dynamic_shapes={"packed": {0: batch}})
    torch.export.save(ep, str(folder / "model.pt2"))
    (folder / "config.toml").write_text(CONFIG)
    return root


def _packed(m: int, seed: int) -> np.ndarray:
    bits = np.random.default_rng(seed).random((m, N, L)) < 0.4
    return np.packbits(bits, axis=-1)  # (m, N, PACKED) uint8, big bit order


def _infer(server: BitserveServer, packed: np.ndarray) -> dict[str, np.ndarray]:
    json_out = {"binary_data": False}
    body = {
        "inputs": [
            {"name": "packed", "datatype": "UINT8", "shape": list(packed.shape),
             "data": packed.ravel().tolist()},
        ],
        "outputs": [{"name": n, "parameters": json_out} for n in ("stored", "on_the_fly")],
    }  # fmt: skip
    r = httpx.post(server.url + "/v2/models/unpack/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = {o["name"]: np.asarray(o["data"], dtype=np.float32).reshape(o["shape"])
           for o in r.json()["outputs"]}  # fmt: skip
    return out


def _dense(model: UnpackResample, packed: np.ndarray) -> list[np.ndarray]:
    """float64 dense T of each resampler applied to the unpacked bits (NumPy's unpackbits)."""
    bits = np.unpackbits(packed, axis=-1, count=L).astype(np.float64)
    return [
        np.einsum("nab,mnb->mna", op.to_dense().detach().double().numpy(), bits)
        for op in (model.stored, model.fit)
    ]


def test_exported_program_is_served_like_eager(
    server_factory: Callable[..., BitserveServer], repository: Path, model: UnpackResample
) -> None:
    server = server_factory(repository)
    meta = httpx.get(server.url + "/v2/models/unpack", timeout=10).json()
    assert [o["name"] for o in meta["outputs"]] == ["stored", "on_the_fly"]
    for m, seed in ((1, 1), (5, 2)):
        packed = _packed(m, seed)
        got = _infer(server, packed)
        with torch.no_grad():
            eager = [t.numpy() for t in model(torch.from_numpy(packed))]
        ref = _dense(model, packed)
        for name, want, dense in zip(("stored", "on_the_fly"), eager, ref, strict=True):
            assert got[name].shape == (m, N, A)
            np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-5)
            np.testing.assert_allclose(got[name], dense, rtol=1e-5, atol=1e-4)
    # Concurrent requests are batched by the server: the batch dimension of the program is
    # dynamic, and every request still gets its own rows back.
    items = [_packed(1 + i % 3, 10 + i) for i in range(12)]
    with ThreadPoolExecutor(6) as ex:
        answers = list(ex.map(lambda p: _infer(server, p), items))
    for packed, got in zip(items, answers, strict=True):
        with torch.no_grad():
            stored, _ = model(torch.from_numpy(packed))
        np.testing.assert_allclose(got["stored"], stored.numpy(), rtol=1e-6, atol=1e-5)
