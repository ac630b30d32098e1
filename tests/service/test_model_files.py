"""The one validation path (``service.models.files``): operator tensors, sizes, messages.

Agreement between ``check-repo`` and a server load over many hostile repositories is in
``test_hostile_repos.py``; here, what each check computes is compared with what is built.
"""

from __future__ import annotations

import tomllib
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_ops.resample import BandedResampler, OnTheFlyResampler
from harness.repo_utils import bits_input, model_toml, tensor, write_model_folder
from service.models.builder import check_repository
from service.models.config import ConfigError, parse_config
from service.models.files import buffer_bytes, check_operator, load_version, operator_bytes
from service.models.layout import model_versions
from service.models.pipeline import build_operator

N, B = 3, 40

GAUSS = 'response = "gaussian"\nsigma = 2.0'


def text(response: str = GAUSS, dtype: str = "float32", n: int = N, b: int = B) -> str:
    """The model's config.toml; ``response`` is the operator's response keys as TOML."""
    return model_toml(
        max_batch_size=2,
        device="cpu",
        inputs=[bits_input(n, b)],
        operator={"file": "op.safetensors", **tomllib.loads(response), "dtype": dtype},
        outputs=[tensor("out", "FP32")],
    )


def write(root: Path, tensors: dict[str, torch.Tensor], body: str | None = None) -> Path:
    return write_model_folder(root / "m", body or text(), tensors)


def grid(seed: int = 0, a: int = 5) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = np.cumsum(rng.uniform(0.5, 1.5, B))
    c = np.sort(rng.uniform(x[0] - 3, x[-1] + 3, (N, a)), axis=1)
    return {"x": torch.from_numpy(x).float(), "c": torch.from_numpy(c).float()}


def load(root: Path, limit: int = 1 << 30) -> None:
    load_version(model_versions(root, "m")["1"], max_operator_bytes=limit)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("response", [GAUSS, 'response = "boxcar"\nhalf_width = 3.5',
                                      'response = "lorentzian"\ngamma = 0.7\nsupport = 6',
                                      'response = "tabulated"'])  # fmt: skip
@pytest.mark.parametrize("sorted_rows", [True, False])
def test_predicted_size_is_what_is_built(dtype: str, response: str, sorted_rows: bool) -> None:
    # The check computes W without building the band: it must equal the built operator's.
    rng = np.random.default_rng(zlib.crc32(f"{dtype} {response} {sorted_rows}".encode()))
    t = grid(int(rng.integers(1000)), a=int(rng.integers(1 if sorted_rows else 2, 9)))
    if not sorted_rows:
        t["c"] = t["c"][:, torch.randperm(t["c"].shape[1])]
        t["c"][0, :2] = torch.tensor([30.0, 2.0])
    if response.endswith('"tabulated"'):
        xs = np.sort(rng.uniform(-4, 4, 7))
        t["response_x"] = torch.from_numpy(xs)
        t["response_y"] = torch.from_numpy(rng.uniform(0, 1, 7))
    cfg = parse_config(tomllib.loads(text(response, dtype)), "m/config.toml")
    assert cfg.operator is not None
    check_operator(cfg, t, "m/config.toml", max_operator_bytes=1 << 30)
    op = build_operator(cfg.operator, t, torch.device("cpu"))
    assert isinstance(op, BandedResampler)
    W = op.band_width
    predicted = operator_bytes(cfg, t["c"].shape[1], W, sorted_rows=sorted_rows)
    assert predicted == op.nbytes
    # One byte less than the operator needs is refused, with the size in the message.
    with pytest.raises(ConfigError, match=f"would take {op.nbytes} bytes") as err:
        check_operator(cfg, t, "m/config.toml", max_operator_bytes=op.nbytes - 1)
    assert f"x {W} {dtype} weights" in err.value.problems[0]


@pytest.mark.parametrize("response", [GAUSS, 'response = "tabulated"'])
def test_predicted_on_the_fly_size_is_what_is_built(response: str) -> None:
    t = grid(3, a=6)
    t["response_x"] = torch.tensor([-2.0, 0.0, 1.0, 3.0], dtype=torch.float64)
    t["response_y"] = torch.tensor([0.2, 1.0, 0.5, 0.0], dtype=torch.float64)
    cfg = parse_config(tomllib.loads(text(response + "\non_the_fly = true")), "m/config.toml")
    assert cfg.operator is not None
    check_operator(cfg, t, "m/config.toml", max_operator_bytes=1 << 30)
    op = build_operator(cfg.operator, t, torch.device("cpu"))
    assert isinstance(op, OnTheFlyResampler)
    K = 4 if response.endswith('"tabulated"') else 0
    assert operator_bytes(cfg, 6, 1, sorted_rows=True, table_points=K) == op.nbytes


def test_a_table_that_cannot_be_centred_is_refused() -> None:
    t = grid()
    t["response_x"] = torch.tensor([-1.0, 0.0, 1.0])
    t["response_y"] = torch.tensor([0.5, 1.0, -0.5])  # a negative value: no one median
    cfg = parse_config(
        tomllib.loads(text('response = "tabulated"\ncenter = "median"')), "m/config.toml"
    )
    with pytest.raises(ConfigError, match=r"m/config\.toml: operator\.file: the table .*negative"):
        check_operator(cfg, t, "m/config.toml", max_operator_bytes=1 << 30)


def test_too_big_names_the_size_and_the_dense_case(tmp_path: Path) -> None:
    t = grid()
    write(tmp_path, t, text('response = "gaussian"\nsigma = 2.0\nsupport = 1e12'))
    with pytest.raises(ConfigError) as err:
        load(tmp_path, limit=1000)
    (msg,) = err.value.problems
    dense = N * 5 * (B * 4 + 4)  # every window spans the whole grid
    assert msg == (
        f"{tmp_path.name}/m/config.toml: operator: would take {dense} bytes: a band of "
        f"{N} x 5 x {B} float32 weights, every window spanning all B = {B} fine points (the "
        "dense operator: check the response's width and support against x); more than "
        "max_operator_bytes = 1000 bytes"
    )
    load(tmp_path, limit=dense)  # exactly at the limit is allowed


def test_too_big_is_refused_from_the_header_alone(tmp_path: Path) -> None:
    # N x A window starts and weights exceed the limit whatever W: no value is read.
    write(tmp_path, grid(a=50))
    with pytest.raises(
        ConfigError, match=r"operator: would take 1200 bytes: at least 3 x 50 window"
    ):
        load(tmp_path, limit=1000)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("key", ["x", "c"])
def test_operator_tensors_must_be_floating_point(
    tmp_path: Path, dtype: torch.dtype, key: str
) -> None:
    t = grid()
    t[key] = t[key].to(dtype)
    write(tmp_path, t)
    with pytest.raises(ConfigError, match=f"tensor '{key}' is .*; needs floating point"):
        load(tmp_path)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda t: t["x"].__setitem__(3, float("nan")), "tensor 'x' has non-finite values"),
        (lambda t: t["c"].__setitem__((1, 2), float("inf")), "tensor 'c' has non-finite values"),
        (lambda t: t["x"].fill_(7.0), "tensor 'x' must be strictly increasing; x[0] = 7"),
        (lambda t: t["x"].__setitem__(5, t["x"][4]), "'x' must be strictly increasing; x[4]"),
        (lambda t: t["x"].__setitem__(slice(None), t["x"].flip(0)), "strictly increasing"),
    ],
)
def test_operator_values(tmp_path: Path, change: object, problem: str) -> None:
    t = grid()
    change(t)  # type: ignore[operator]
    write(tmp_path, t)
    with pytest.raises(ConfigError) as err:
        load(tmp_path)
    assert problem in err.value.problems[0]
    assert err.value.problems[0].startswith(f"{tmp_path.name}/m/config.toml: operator.file: ")


def test_table_must_be_finite_and_increasing(tmp_path: Path) -> None:
    t = grid() | {"response_x": torch.tensor([-1.0, 0.0, 0.0, 1.0]),
                  "response_y": torch.tensor([0.0, 1.0, float("nan"), 0.0])}  # fmt: skip
    write(tmp_path, t, text('response = "tabulated"'))
    with pytest.raises(ConfigError) as err:
        load(tmp_path)
    assert [p.split(": ", 2)[2] for p in err.value.problems] == [
        "tensor 'response_y' has non-finite values",
        "tensor 'response_x' must be strictly increasing; response_x[1] = 0 and response_x[2] = 0",
    ]


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "+inf"])
@pytest.mark.parametrize("key", ["sigma", "support"])
def test_non_finite_parameters(value: str, key: str) -> None:
    body = text('response = "gaussian"\nsigma = 2.0\nsupport = 4.0').replace(
        f"{key} = ", f"{key} = {value} # "
    )
    with pytest.raises(ConfigError) as err:
        parse_config(tomllib.loads(body), "m/config.toml")
    assert f"m/config.toml: operator.{key}: " in err.value.problems[0]


def test_corrupt_safetensors_says_why_without_server_paths(tmp_path: Path) -> None:
    folder = write(tmp_path, grid())
    (folder / "op.safetensors").write_bytes(b"\xff" * 8 + b"{not json")
    with pytest.raises(ConfigError) as err:
        load(tmp_path)
    (problem,) = err.value.problems
    where = f"{tmp_path.name}/m/config.toml: operator.file: not a readable safetensors file: "
    assert problem.startswith(where + "SafetensorError: "), problem
    assert str(tmp_path.parent) not in problem
    assert err.value.__cause__ is not None  # the server logs its traceback
    assert check_repository(tmp_path, max_operator_bytes=1 << 30) == [problem]


def test_config_symlinked_from_outside_is_refused(tmp_path: Path) -> None:
    outside = write(tmp_path / "elsewhere", grid())
    folder = write(tmp_path / "repo", grid())
    (folder / "config.toml").unlink()
    (folder / "config.toml").symlink_to(outside / "config.toml")
    with pytest.raises(ConfigError, match=r"repo/m/config.toml: resolves outside the model's"):
        load(tmp_path / "repo")
    # A link inside the model is fine.
    (folder / "config.toml").unlink()
    (folder / "real.toml").write_text(text())
    (folder / "config.toml").symlink_to(folder / "real.toml")
    load(tmp_path / "repo")


def test_only_the_needed_tensors_are_read(tmp_path: Path) -> None:
    # Extra tensors in the file are neither checked nor loaded (nor kept resident).
    t = grid() | {"notes": torch.arange(4)}
    write(tmp_path, t)
    cfg, artifacts = load_version(model_versions(tmp_path, "m")["1"], max_operator_bytes=1 << 30)
    assert sorted(artifacts.tensors) == ["c", "x"]
    assert cfg.operator is not None


def test_the_operator_input_is_the_one_named() -> None:
    body = model_toml(
        max_batch_size=2,
        inputs=[tensor("other", "FP32", [7]), tensor("bits", "BOOL", [N, B])],
        operator={"input": "bits", "file": "op.safetensors", **tomllib.loads(GAUSS)},
        model={"file": "m.pt2"},
        outputs=[tensor("out", "FP32")],
    )
    cfg = parse_config(tomllib.loads(body), "m/config.toml")
    t = grid()
    check_operator(cfg, t, "m/config.toml", max_operator_bytes=1 << 30)
    W = responses_width(t)
    assert operator_bytes(cfg, 5, W, sorted_rows=True) == N * 5 * (W * 4 + 4)
    t["x"] = t["x"][:7]
    with pytest.raises(ConfigError, match=r"x has shape \[7\]; inputs\[1\]\.shape needs \[40\]"):
        check_operator(cfg, t, "m/config.toml", max_operator_bytes=1 << 30)


def responses_width(t: dict[str, torch.Tensor]) -> int:
    cfg = parse_config(tomllib.loads(text()), "m/config.toml")
    assert cfg.operator is not None
    op = build_operator(cfg.operator, t, torch.device("cpu"))
    assert isinstance(op, BandedResampler)
    return op.band_width


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_input_buffers_are_bounded(tmp_path: Path, dtype: str) -> None:
    # Each input's device buffer is allocated whole at load: max(max_batch_size, 1) items of
    # its logical shape in the dtype it is computed in. One byte over the limit is refused,
    # naming the input and the size; exactly the limit loads.
    b = 4000
    itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
    body = text(dtype=dtype, b=b).replace("max_batch_size = 2", "max_batch_size = 64")
    cfg = parse_config(tomllib.loads(body), "m")
    x = torch.linspace(0, b - 1, b)
    write(tmp_path, {"x": x, "c": x[::50].repeat(N, 1).contiguous()}, body)
    need = 64 * N * b * itemsize
    assert buffer_bytes(cfg) == [need]
    src = model_versions(tmp_path, "m")["1"]
    load_version(src, max_operator_bytes=1 << 30, max_batch_bytes=need)
    with pytest.raises(ConfigError) as e:
        load_version(src, max_operator_bytes=1 << 30, max_batch_bytes=need - 1)
    said = f"inputs[0] (bits): max_batch_size 64 x shape [{N}, {b}] needs a device buffer of "
    assert f"{said}{need:,} bytes, more than max_batch_bytes ({need - 1:,})" in str(e.value)
    limits = {"max_operator_bytes": 1 << 30, "max_batch_bytes": need - 1}
    assert check_repository(tmp_path, **limits) == e.value.problems
    assert check_repository(tmp_path, max_operator_bytes=1 << 30) == []  # default: 4 GiB
