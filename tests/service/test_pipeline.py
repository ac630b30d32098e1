"""The device-resident pipeline against a float64 dense reference (no HTTP, no batcher)."""

from __future__ import annotations

import tomllib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harness.repo_utils import bits_input, model_toml, tensor, torchscript, write_model_folder
from service.backends import ModuleModel
from service.models.builder import build_pipeline
from service.models.config import ConfigError, ModelConfig, parse_config
from service.models.files import Artifacts, load_version
from service.models.signature import Bound, WireInput
from tests.common_utils import cpu_and_cuda

N, B, A = 3, 37, 6  # B is not a multiple of 8: the last byte is padded


GAUSS = 'response = "gaussian"\nsigma = 2.5\nsupport = 4'
OUT = tensor("out", "FP32")


def config(
    *,
    max_batch_size: int = 4,
    response: str = GAUSS,
    dtype: str = "float32",
    bitorder: str = "big",
    more_inputs: Sequence[dict[str, Any]] = (),
    model: dict[str, Any] | None = None,
    outputs: Sequence[dict[str, Any]] = (OUT,),
) -> ModelConfig:
    """The bits -> operator [-> model] config; ``response`` is the operator's keys as TOML."""
    text = model_toml(
        max_batch_size=max_batch_size,
        inputs=[bits_input(N, B, bitorder=bitorder), *more_inputs],
        operator={"file": "op.safetensors", **tomllib.loads(response), "dtype": dtype},
        model=model,
        outputs=outputs,
    )
    return parse_config(tomllib.loads(text), "test/config.toml")


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = np.cumsum(rng.uniform(0.5, 1.5, B))  # an uneven fine grid
    # coarse points inside and beyond both ends, so windows are clipped at the edges
    c = np.sort(rng.uniform(x[0] - 3, x[-1] + 3, (N, A)), axis=1)
    return {"x": torch.from_numpy(x).float(), "c": torch.from_numpy(c).float()}


def dense_reference(t: dict[str, torch.Tensor], f: np.ndarray, response: Any) -> np.ndarray:
    """out[m, n, a] = sum_b r(c[n, a] - x[b]) f[m, n, b] in float64 with a dense T."""
    x = t["x"].double()
    c = t["c"].double()
    d = c[:, :, None] - x[None, None, :]  # (N, A, B)
    T = response(d)
    return torch.einsum("nab,mnb->mna", T, torch.from_numpy(f).double()).numpy()


def gaussian(sigma: float, support: float) -> Any:
    return lambda d: torch.exp(-0.5 * (d / sigma) ** 2) * (d.abs() <= support * sigma)


def random_bits(m: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((m, N, B)) < 0.3


def request(*wires: WireInput) -> Bound:
    """One request of these inputs (config order), answering every output."""
    return Bound(wires, (0,), wires[0].data.shape[0])


def packed(bits: np.ndarray, bitorder: str = "big") -> Bound:
    data = np.packbits(bits, axis=-1, bitorder=bitorder)  # type: ignore[arg-type]
    data.flags.writeable = False  # like a view over a request body
    return request(WireInput(data, packed=True))


def logical(bits: np.ndarray) -> Bound:
    return request(WireInput(np.ascontiguousarray(bits), packed=False))


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_matches_float64_dense_reference(device: str, bitorder: str) -> None:
    t = tensors()
    pipe = build_pipeline("m", config(bitorder=bitorder), Artifacts(t), device, warmup=False)
    bits = random_bits(4)
    ref = dense_reference(t, bits, gaussian(2.5, 4))
    # three requests of 1, 2 and 1 items merged into one batch
    out = pipe.run(
        [packed(bits[:1], bitorder), packed(bits[1:3], bitorder), packed(bits[3:], bitorder)]
    )
    got = np.concatenate([o[0] for o in out])
    assert [o[0].shape for o in out] == [(1, N, A), (2, N, A), (1, N, A)]
    assert all(o[0].dtype == np.float32 and o[0].flags.c_contiguous for o in out)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert pipe.output_shapes == [[N, A]]
    assert pipe.device_memory_bytes >= 4 * N * ((B + 7) // 8)  # at least the packed input buffer


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_packed_and_bool_inputs_give_identical_results(device: str) -> None:
    pipe = build_pipeline("m", config(), Artifacts(tensors()), device, warmup=False)
    bits = random_bits(4, seed=7)
    a = pipe.run([packed(bits)])[0][0]
    b = pipe.run([logical(bits)])[0][0]
    # mixed wire forms in one batch
    mixed = pipe.run([packed(bits[:1]), logical(bits[1:3]), packed(bits[3:])])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.concatenate([m[0] for m in mixed]), a)


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_each_request_unpacked_in_its_own_bit_order(device: str) -> None:
    """A request's ``parameters.bitorder`` overrides the model's (big) for its bytes only:
    requests of both orders merged into one batch give the dense reference."""
    t = tensors()
    pipe = build_pipeline("m", config(bitorder="big"), Artifacts(t), device, warmup=False)
    bits = random_bits(4, seed=11)
    ref = dense_reference(t, bits, gaussian(2.5, 4))

    def little(b: np.ndarray, order: str | None = "little") -> Bound:
        data = np.packbits(b, axis=-1, bitorder="little")
        return request(WireInput(data, packed=True, bitorder=order))

    out = pipe.run([little(bits[:1]), packed(bits[1:3]), little(bits[3:])])
    got = np.concatenate([o[0] for o in out])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # The same little-order bytes read in the model's order are other bits.
    wrong = pipe.run([little(bits, order=None)])[0][0]
    assert not np.allclose(wrong, ref, atol=1e-3)


def test_bool_bytes_other_than_one_count_as_one() -> None:
    # Requests never carry such bytes (the framing refuses them); a direct caller of
    # ``Pipeline.run`` may, and gets what NumPy would give: nonzero is 1.
    pipe = build_pipeline("m", config(), Artifacts(tensors()), "cpu", warmup=False)
    bits = random_bits(2, seed=9)
    scale = np.random.default_rng(9).choice(np.array([1, 2, 7, 255], np.uint8), bits.shape)
    raw = bits.view(np.uint8) * scale
    assert {2, 255} <= set(np.unique(raw).tolist())
    odd = request(WireInput(raw.view(np.bool_), packed=False))
    np.testing.assert_array_equal(pipe.run([odd])[0][0], pipe.run([packed(bits)])[0][0])


def test_results_stay_valid_after_the_next_batch() -> None:
    pipe = build_pipeline("m", config(), Artifacts(tensors()), "cpu", warmup=True)
    first = pipe.run([packed(random_bits(2, seed=3))])[0][0]
    kept = first.copy()
    pipe.run([packed(random_bits(4, seed=4))])
    np.testing.assert_array_equal(first, kept)


def test_no_batching_has_no_batch_dimension() -> None:
    t = tensors()
    pipe = build_pipeline("m", config(max_batch_size=0), Artifacts(t), "cpu", warmup=False)
    bits = random_bits(1)
    out = pipe.run([packed(bits)])
    assert out[0][0].shape == (N, A)
    ref = dense_reference(t, bits, gaussian(2.5, 4))[0]
    np.testing.assert_allclose(out[0][0], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_bfloat16_compute() -> None:
    t = tensors()
    pipe = build_pipeline("m", config(dtype="bfloat16"), Artifacts(t), "cpu", warmup=False)
    bits = random_bits(2)
    got = pipe.run([packed(bits)])[0][0]
    assert got.dtype == np.float32  # the output datatype, whatever the compute dtype
    ref = dense_reference(t, bits, gaussian(2.5, 4))
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@pytest.mark.parametrize("on_the_fly", [False, True])
def test_new_responses_and_options(on_the_fly: bool) -> None:
    """[operator] laplacian by sigma, normalised and scaled, stored or on the fly."""
    t = tensors()
    keys = 'response = "laplacian"\nsigma = 2.0\nnormalize = true\nscale = 3.0'
    keys += f"\non_the_fly = {str(on_the_fly).lower()}"
    pipe = build_pipeline("m", config(response=keys), Artifacts(t), "cpu", warmup=False)
    bits = random_bits(3, seed=12)
    tau = 2.0 / np.sqrt(2.0)  # sigma = sqrt(2) tau

    def laplacian(d: torch.Tensor) -> torch.Tensor:
        return 3.0 * torch.exp(-d.abs() / tau) / (2 * tau) * (d.abs() <= 5 * 2.0)

    ref = dense_reference(t, bits, laplacian)
    got = pipe.run([packed(bits)])[0][0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("on_the_fly", [False, True])
@pytest.mark.parametrize("center", [None, "peak"])
def test_tabulated_asymmetric_response(on_the_fly: bool, center: str | None) -> None:
    """A table as given (the default) or moved so that its peak (x = 0.5) is at 0, stored or
    evaluated in the kernels."""
    t = tensors()
    xs = np.array([-2.0, -0.5, 0.5, 1.0, 4.0])
    ys = np.array([0.1, 0.8, 1.0, 0.5, 0.2])
    t["response_x"] = torch.from_numpy(xs)
    t["response_y"] = torch.from_numpy(ys)
    keys = f'response = "tabulated"\non_the_fly = {str(on_the_fly).lower()}'
    if center is not None:
        keys += f'\ncenter = "{center}"'
    pipe = build_pipeline("m", config(response=keys), Artifacts(t), "cpu", warmup=False)
    bits = random_bits(2, seed=11)
    moved = xs - (0.5 if center == "peak" else 0.0)

    def table(d: torch.Tensor) -> torch.Tensor:
        v = np.interp(d.numpy(), moved, ys, left=0.0, right=0.0)
        return torch.from_numpy(v)

    ref = dense_reference(t, bits, table)
    got = pipe.run([packed(bits)])[0][0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_declared_output_shape_is_checked() -> None:
    bad = [tensor("out", "FP32", [3, 7])]
    with pytest.raises(
        ConfigError,
        match=r"outputs\[0\]\.shape: \[3, 7\] for 'out', but the operator gives \[3, 6\]$",
    ):
        build_pipeline("m", config(outputs=bad), Artifacts(tensors()), "cpu", warmup=False)


# --- models ---------------------------------------------------------------------------------


class Head(torch.nn.Module):
    """A tiny model on the operator's (M, N, A) output: a linear map over A and a sum."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(A, 2, generator=g))

    def forward(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return y @ self.weight, y.sum(dim=(1, 2))


TWO_OUTPUTS = (tensor("proj", "FP32"), tensor("total", "FP64"))


def write_version(folder: Path, cfg_text: str, t: dict[str, torch.Tensor]) -> None:
    write_model_folder(folder, cfg_text, t)


def model_config_text(file: str, outputs: Sequence[dict[str, Any]] = TWO_OUTPUTS) -> str:
    return model_toml(
        max_batch_size=4,
        inputs=[bits_input(N, B)],
        operator={"file": "op.safetensors", "response": "gaussian", "sigma": 2.5},
        model={"file": file},
        outputs=outputs,
    )


_EXPORTED: dict[str, bytes] = {}


def save_export(path: Path) -> None:
    # torch.export takes seconds: export once per session, copy the file after that.
    if "head" not in _EXPORTED:
        batch = torch.export.Dim("batch", min=1, max=1024)
        ep = torch.export.export(Head(), (torch.randn(2, N, A),), dynamic_shapes=({0: batch},))
        torch.export.save(ep, str(path))
        _EXPORTED["head"] = path.read_bytes()
    else:
        path.write_bytes(_EXPORTED["head"])


def save_torchscript(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(Head(), torch.randn(2, N, A))
        traced.save(str(path))


@pytest.mark.parametrize(
    ("file", "save"), [("head.pt2", save_export), ("head.pt", save_torchscript)]
)
def test_model_step(tmp_path: Path, file: str, save: Any) -> None:
    from service.models.layout import model_versions

    t = tensors()
    write_version(tmp_path / "m", model_config_text(file), t)
    save(tmp_path / "m" / file)
    cfg, artifacts = load_version(model_versions(tmp_path, "m")["1"], max_operator_bytes=1 << 30)
    pipe = build_pipeline("m", cfg, artifacts, "cpu", warmup=True)
    assert pipe.output_shapes == [[N, 2], []]
    bits = random_bits(3, seed=5)
    out = pipe.run([packed(bits[:2]), packed(bits[2:])])
    proj = np.concatenate([o[0] for o in out])
    total = np.concatenate([o[1] for o in out])
    assert proj.dtype == np.float32
    assert total.dtype == np.float64
    y = dense_reference(t, bits, gaussian(2.5, 4))
    w = Head().weight.detach().double().numpy()
    np.testing.assert_allclose(proj, y @ w, rtol=1e-4, atol=1e-4 * np.abs(y @ w).max())
    np.testing.assert_allclose(total, y.sum(axis=(1, 2)), rtol=1e-5)


def test_model_output_count_must_match(tmp_path: Path) -> None:
    from service.models.layout import model_versions

    text = model_config_text("head.pt2", outputs=TWO_OUTPUTS[:1])  # no "total"
    write_version(tmp_path / "m", text, tensors())
    save_export(tmp_path / "m" / "head.pt2")
    cfg, artifacts = load_version(model_versions(tmp_path, "m")["1"], max_operator_bytes=1 << 30)
    with pytest.raises(ConfigError, match="outputs: 1 declared, the model returns 2"):
        build_pipeline("m", cfg, artifacts, "cpu", warmup=False)


def test_unreadable_model_names_the_key(tmp_path: Path) -> None:
    from service.models.layout import model_versions

    write_version(tmp_path / "m", model_config_text("head.pt2"), tensors())
    (tmp_path / "m" / "head.pt2").write_bytes(b"not a zip file")
    src = model_versions(tmp_path, "m")["1"]
    with pytest.raises(ConfigError) as info:
        load_version(src, max_operator_bytes=1 << 30)
    # The loader's own message, trimmed, without the server's paths; the traceback is logged.
    (problem,) = info.value.problems
    assert problem == (
        f"{tmp_path.name}/m/config.toml: model.file: head.pt2: cannot load: BadZipFile: "
        "File is not a zip file"
    )
    assert info.value.__cause__ is not None


# --- several inputs -----------------------------------------------------------------------


class Mix(torch.nn.Module):
    """Two inputs: the operator's output (M, N, A) and a per-item scale and flag set.

    Returns a dict keyed by output name, in the opposite order of the config's outputs.
    """

    def forward(
        self, y: torch.Tensor, scale: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        kept = (mask.to(y.dtype) * y.sum(dim=2)).sum(dim=1)  # (M,)
        return {"total": kept, "scaled": y * scale[:, :, None]}


MIX_INPUTS: dict[str, Any] = {
    "more_inputs": [tensor("scale", "FP32", [N]), tensor("mask", "BOOL", [N], packing="bits")],
    "model": {"file": "mix.pt"},
    "outputs": [tensor("scaled", "FP32"), tensor("total", "FP64")],
}


def test_several_inputs_reach_the_model_in_config_order() -> None:
    t = tensors()
    cfg = config(**MIX_INPUTS)
    assert [s.name for s in cfg.inputs] == ["bits", "scale", "mask"]
    model = torchscript(Mix())
    pipe = build_pipeline("m", cfg, Artifacts(t, ModuleModel(model)), "cpu", warmup=False)
    rng = np.random.default_rng(5)
    bits = random_bits(3, seed=5)
    scale = rng.uniform(-2, 2, (3, N)).astype(np.float32)
    mask = rng.random((3, N)) < 0.5
    # Two requests, the second with its mask as one BOOL byte per element (not packed).
    first = Bound(
        (
            WireInput(np.packbits(bits[:2], axis=-1), packed=True),
            WireInput(scale[:2], packed=False),
            WireInput(np.packbits(mask[:2], axis=-1), packed=True),
        ),
        (0, 1),
        2,
    )
    second = Bound(
        (
            WireInput(np.packbits(bits[2:], axis=-1), packed=True),
            WireInput(scale[2:], packed=False),
            WireInput(mask[2:], packed=False),
        ),
        (0, 1),
        1,
    )
    out = pipe.run([first, second])
    y = dense_reference(t, bits, gaussian(2.5, 4))  # (3, N, A) float64
    scaled = np.concatenate([out[0][0], out[1][0]])
    total = np.concatenate([out[0][1], out[1][1]])
    np.testing.assert_allclose(scaled, y * scale[:, :, None], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(total, (mask * y.sum(axis=2)).sum(axis=1), rtol=1e-5, atol=1e-4)
    assert total.dtype == np.float64
    assert pipe.output_shapes == [[N, A], []]


def test_operator_input_by_name_and_a_model_missing_an_output() -> None:
    t = tensors()
    # The operator applies to the second input here; the first goes to the model as is.
    text = model_toml(
        max_batch_size=2,
        inputs=[tensor("scale", "FP32", [N]), bits_input(N, B)],
        operator={"input": "bits", "file": "op.safetensors", **tomllib.loads(GAUSS)},
        model={"file": "m.pt"},
        outputs=[tensor("scaled", "FP32")],
    )

    class Scale(torch.nn.Module):
        def forward(self, scale: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return y * scale[:, :, None]

    cfg = parse_config(tomllib.loads(text), "t/config.toml")
    pipe = build_pipeline(
        "m", cfg, Artifacts(t, ModuleModel(torchscript(Scale()))), "cpu", warmup=False
    )
    bits = random_bits(2, seed=8)
    scale = np.array([[1.0, -1.0, 2.0], [0.5, 0.0, 3.0]], np.float32)
    req = Bound(
        (WireInput(scale, packed=False), WireInput(np.packbits(bits, axis=-1), packed=True)),
        (0,),
        2,
    )
    got = pipe.run([req])[0][0]
    ref = dense_reference(t, bits, gaussian(2.5, 4)) * scale[:, :, None]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)

    class Wrong(torch.nn.Module):
        def forward(self, scale: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"other": y}

    with pytest.raises(ConfigError, match=r"model.file: the model's outputs \['other'\] lack"):
        build_pipeline(
            "m", cfg, Artifacts(t, ModuleModel(torchscript(Wrong()))), "cpu", warmup=False
        )
