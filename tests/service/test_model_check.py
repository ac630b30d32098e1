"""The dtype rule, the signature check, the dry run's sample, the readiness rule and the
cleaning of library messages, in process (the formats end to end: tests/e2e/test_formats_e2e)."""

from __future__ import annotations

import tomllib
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from harness.model_formats import fingerprint_mlp, write_model
from harness.repo_utils import model_toml, tensor
from service.backends import Dim, ModuleModel, format_of, load_model_file
from service.backends.aoti import _read_checks
from service.errors import InvalidInput
from service.models.builder import build_version, check_repository
from service.models.config import ConfigError, parse_config
from service.models.layout import model_versions
from service.models.readiness import readiness_reason
from service.models.signature import Signature, handed_dtypes
from service.protocol.types import InferRequest, RequestInput
from service.residency.resident_versions import LOADING, READY, UNAVAILABLE
from service.text import clean_reason

BITS = 64


def fp_config(fmt_file: str, **keys: object) -> str:
    fp = tensor("fp", "BOOL", [BITS], packing="bits", **keys)
    return model_toml(
        max_batch_size=4, device="cpu", inputs=[fp], model={"file": fmt_file},
        outputs=[tensor("score", "FP32", [1])],
    )  # fmt: skip


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("ep") / "model.pt2"
    return write_model(path, "torch_export", fingerprint_mlp(bits=BITS), 4, bits=BITS).read_bytes()


def test_an_exported_float32_model_gets_float32_bits_with_no_wrapper(
    tmp_path: Path, exported: bytes
) -> None:
    """The issue's chemist: a packed BOOL input, no [operator], a float32 nn.Module."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.pt2").write_bytes(exported)
    (folder / "config.toml").write_text(fp_config("model.pt2"))
    src = model_versions(tmp_path, "m")["1"]
    _, pipe = build_version("m", src, default_device="cpu", max_operator_bytes=1 << 20)
    assert pipe._dtypes == [torch.float32]  # unpacked straight into the model's dtype
    bits = np.random.default_rng(0).random((3, BITS)) < 0.3
    from service.models.signature import Bound, WireInput

    out = pipe.run([Bound((WireInput(np.packbits(bits, axis=-1), True),), (0,), 3)])[0][0]
    module = fingerprint_mlp(bits=BITS)
    with torch.no_grad():
        ref = module(torch.from_numpy(bits).float()).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_the_dtype_rule() -> None:
    def cfg(**keys: object):  # type: ignore[no-untyped-def]
        return parse_config(tomllib.loads(fp_config("m.pt", **keys)), "c")

    scripted = ModuleModel(torch.nn.Identity())
    # No signature (TorchScript): [[inputs]] dtype, else the datatype's own.
    assert handed_dtypes(cfg(), scripted) == [torch.bool]
    assert handed_dtypes(cfg(dtype="bfloat16"), scripted) == [torch.bfloat16]
    with pytest.raises(ConfigError, match=r"dtype 'int64' is not one BOOL bits can be handed"):
        cfg(dtype="int64")  # bits unpack into the unpack dtypes only
    text = model_toml(
        inputs=[tensor("x", "FP32", [3], dtype="float16")], model={"file": "m.pt"},
        outputs=[tensor("y", "FP32")],
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"dtype 'float16' is not one FP32 can be handed in"):
        parse_config(tomllib.loads(text), "c")


def test_model_format_by_suffix_contents_or_key(tmp_path: Path, exported: bytes) -> None:
    (tmp_path / "a.pt2").write_bytes(exported)
    assert format_of(tmp_path / "a.pt2") == "torch_export"
    with zipfile.ZipFile(tmp_path / "b.pt2", "w") as z:
        z.writestr("b/data/aotinductor/model/x.wrapper.cpp", "")
    assert format_of(tmp_path / "b.pt2") == "aoti"
    assert format_of(tmp_path / "c.bin", "onnx") == "onnx"
    with pytest.raises(ValueError, match="has no input checks bitserve can read"):
        load_model_file(tmp_path / "b.pt2")
    bad = model_toml(
        inputs=[tensor("x", "FP32", [3])], model={"file": "m.pkl"}, outputs=[tensor("y", "FP32")]
    )
    with pytest.raises(ConfigError, match=r"model\.file: must end in one of .pt2, .pt, .ts, .onnx"):
        parse_config(tomllib.loads(bad), "c")
    parse_config(
        tomllib.loads(bad.replace('file = "m.pkl"', 'format = "onnx"\nfile = "m.pkl"')), "c"
    )


AOTI_CHECKS = """
inputs_info_[0].name = "arg4_1";
AOTI_NOINLINE static void check_input_0(AtenTensorHandle* input_handles) {
    int32_t arg4_1_expected_dtype = aoti_torch_dtype_float32();
    if (arg4_1_size[0] < 2) {
    if (arg4_1_size[0] > 32) {
    if (2048 != arg4_1_size[1]) {
    if (2048 != arg4_1_stride[0]) {
    if (1 != arg4_1_stride[1]) {
}
static bool _check_aoti_runtime_check_inputs_env() {
"""


def test_aoti_signature_from_its_input_checks() -> None:
    (spec,) = _read_checks(AOTI_CHECKS)
    assert spec.dtype == torch.float32
    # torch.export's 0/1 specialisation checks a batch from 2; the program serves 1.
    assert spec.dims == (Dim(None, 1, 32), Dim(2048))
    assert [d.shown("batch") for d in spec.dims] == ["batch <= 32", "2048"]


def test_the_dry_run_uses_the_warmup_sample(tmp_path: Path) -> None:
    class NoOnes(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.one_hot(x.sum(dim=1).long(), 3).float()

    folder = tmp_path / "m"
    write_model(folder / "model.pt", "torchscript", NoOnes(), 4, bits=BITS)
    text = fp_config("model.pt", dtype="float32").replace('"FP32", ', '"FP32", ')
    text = text.replace("shape = [1]", "shape = [3]")
    (folder / "config.toml").write_text(text)
    assert check_repository(tmp_path, max_operator_bytes=1 << 20) == []  # zeros: fine
    ones = np.packbits(np.ones((2, BITS), bool), axis=-1)
    save_file({"fp": ones}, str(folder / "sample.safetensors"))
    (folder / "config.toml").write_text('warmup_file = "sample.safetensors"\n' + text)
    (problem,) = check_repository(tmp_path, max_operator_bytes=1 << 20)
    assert problem.startswith(
        f"{tmp_path.name}/m/config.toml: model.file: model.pt: the dry run at batch 1 failed: "
        "RuntimeError: "
    ), problem
    assert "Class values must be smaller than num_classes" in problem
    save_file({"other": ones}, str(folder / "sample.safetensors"))
    assert check_repository(tmp_path, max_operator_bytes=1 << 20) == [
        f"{tmp_path.name}/m/config.toml: warmup_file: input 'fp' needs UINT8 [items, 8] or "
        "BOOL [items, 64]; has nothing"
    ]


def test_readiness_rule() -> None:
    good = ("a", "1", READY, "")
    bad = ("b", "1", UNAVAILABLE, "b/config.toml: operator.file: missing")
    rule = {"started": True, "closing": False}
    assert readiness_reason([good], strict=True, **rule) is None
    assert readiness_reason([good, bad], strict=False, **rule) is None
    assert readiness_reason([good, bad], strict=True, **rule) == (
        "server is not ready: model 'b' version 1 failed to load; serve with "
        "--no-strict-readiness to be ready without it: b/config.toml: operator.file: missing"
    )
    loading = ("c", "1", LOADING, "")
    assert readiness_reason([good, bad, loading], strict=False, **rule) == (
        "server is not ready: loading models ('c')"
    )
    assert readiness_reason([], strict=False, started=False, closing=False) == (
        "server is not ready: loading models"
    )
    assert readiness_reason([good], strict=False, started=True, closing=True) == (
        "server is not ready: shutting down"
    )


def test_library_messages_are_cleaned(tmp_path: Path) -> None:
    folder = tmp_path / "repo" / "m"
    exc = RuntimeError(
        f"cannot open {folder}/model.pt2 (from /usr/lib/python3/site-packages/torch/x.py)\n"
        "Exception raised from load at /pytorch/c10/x.cpp:12 (most recent call first):\n"
        "frame #0: c10::Error::Error()"
    )
    assert clean_reason(exc, folder, "repo/m") == (
        "RuntimeError: cannot open repo/m/model.pt2 (from <server path>)"
    )
    script = RuntimeError(
        "The following operation failed in the TorchScript interpreter.\n"
        "Traceback of TorchScript (most recent call last):\n"
        '  File "code/__torch__.py", line 8, in forward\n'
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x8 and 64x16)\n"
    )
    assert clean_reason(script) == (
        "RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x8 and 64x16)"
    )
    assert clean_reason(ValueError("x" * 1000)).endswith("x...")
    assert len(clean_reason(ValueError("x" * 1000))) < 320


def test_bitorder_parameter_is_checked() -> None:
    cfg = parse_config(tomllib.loads(fp_config("m.pt")), "c")
    sig = Signature("m", cfg, [[1]])

    def bind(params: dict[str, object]):  # type: ignore[no-untyped-def]
        data = np.zeros((1, 8), np.uint8)
        t = RequestInput("fp", "UINT8", (1, 8), data, params)
        return sig.bind(InferRequest(id=None, inputs=[t]))

    assert bind({"bitorder": "little"}).inputs[0].bitorder == "little"
    assert bind({}).inputs[0].bitorder is None
    with pytest.raises(
        InvalidInput, match=r'parameters.bitorder must be "big" or "little", not int'
    ):
        bind({"bitorder": 3})


@pytest.mark.needs_cuda
def test_onnx_on_cuda_binds_the_device_tensors(tmp_path: Path) -> None:
    """On a GPU host ONNX Runtime's CUDA provider takes and gives device tensors (DLPack),
    and answers as its CPU provider does."""
    ort = pytest.importorskip("onnxruntime")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA provider (onnxruntime-gpu)")
    path = write_model(tmp_path / "m.onnx", "onnx", fingerprint_mlp(bits=BITS), 4, bits=BITS)
    model = load_model_file(path)
    x = (torch.rand(3, BITS, device="cuda") < 0.3).float()
    (out,) = model.to(torch.device("cuda:0"))(x)
    assert out.device == x.device
    (ref,) = model.to(torch.device("cpu"))(x.cpu())
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


def test_onnx_runs_on_torchs_threads_that_sleep_when_idle(tmp_path: Path) -> None:
    """ONNX Runtime's defaults (a thread per core, spinning when idle) would take the core a
    server worker leaves to its event loop."""
    pytest.importorskip("onnxruntime")
    path = write_model(tmp_path / "m.onnx", "onnx", fingerprint_mlp(bits=BITS), 4, bits=BITS)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            model = load_model_file(path)
            opts = model.session.get_session_options()  # type: ignore[attr-defined]
            assert (opts.intra_op_num_threads, opts.inter_op_num_threads) == (threads, 1)
            assert opts.get_session_config_entry("session.intra_op.allow_spinning") == "0"
            x = (torch.rand(3, BITS) < 0.3).float()
            (out,) = model.to(torch.device("cpu"))(x)
            with torch.no_grad():
                ref = fingerprint_mlp(bits=BITS)(x)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_the_config_names_every_format_and_unpack_dtype() -> None:
    """config.py keeps the names (it imports no torch); the registries are the truth."""
    import typing

    from gpu_ops.bits import UNPACK_DTYPES
    from service.backends import FORMATS, SUFFIXES
    from service.models.config import MODEL_SUFFIXES, UNPACK_DTYPE_NAMES, ModelFormat

    assert set(typing.get_args(ModelFormat)) == set(FORMATS) - {"module"}
    assert set(MODEL_SUFFIXES) == set(SUFFIXES)
    assert {getattr(torch, n) for n in UNPACK_DTYPE_NAMES} == set(UNPACK_DTYPES)


class _ReadsFirstTwice(torch.nn.Module):
    """Reads ``a`` where it should read ``b`` (the issue's slip at export)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + a


class _ReadsBoth(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


@pytest.mark.parametrize(
    ("module", "same_example", "unused"),
    [
        (_ReadsFirstTwice(), False, "b"),
        (_ReadsBoth(), True, "a"),  # one example tensor for both: export reads it once
        (_ReadsBoth(), False, None),
    ],
)
def test_an_input_the_program_never_reads_is_refused(
    tmp_path: Path, module: torch.nn.Module, same_example: bool, unused: str | None
) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    x = torch.zeros(2, 3)
    y = x if same_example else torch.ones(2, 3)
    batch = torch.export.Dim("batch", min=1, max=4)
    ep = torch.export.export(module, (x, y), dynamic_shapes={"a": {0: batch}, "b": {0: batch}})
    torch.export.save(ep, str(folder / "model.pt2"))
    (folder / "config.toml").write_text(model_toml(
        max_batch_size=4, device="cpu", inputs=[tensor("a", "FP32", [3]), tensor("b", "FP32", [3])],
        model={"file": "model.pt2"}, outputs=[tensor("y", "FP32", [3])],
    ))  # fmt: skip
    problems = check_repository(tmp_path, max_operator_bytes=1 << 20)
    if unused is None:
        assert problems == []
    else:
        (line,) = problems
        k = "ab".index(unused)
        assert f"model.pt2: input '{unused}' (inputs[{k}] '{unused}') is never read" in line


def test_an_onnx_input_the_graph_never_reads_is_refused(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    folder = tmp_path / "m"
    folder.mkdir()
    dims = ["batch", 3]
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "a"], ["y"])], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, dims) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(folder / "model.onnx"))
    (folder / "config.toml").write_text(model_toml(
        max_batch_size=4, device="cpu", inputs=[tensor("a", "FP32", [3]), tensor("b", "FP32", [3])],
        model={"file": "model.onnx"}, outputs=[tensor("y", "FP32", [3])],
    ))  # fmt: skip
    (line,) = check_repository(tmp_path, max_operator_bytes=1 << 20)
    assert "model.onnx: input 'b' (inputs[1] 'b') is never read by the program" in line
