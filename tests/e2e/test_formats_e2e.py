"""Bring your own model (issue 19): every format served as it is, checked before it serves.

One repository holds a fingerprint MLP (float32, 2048 bits -> 1 score) in each format
(torch.export, AOTInductor, TorchScript, ONNX), each once as it should be and once with each
defect a user brings: a static batch, a config shape that does not fit, a dtype the model
does not take, a wrong output declaration, a forward that raises; and an AOTInductor package
whose kernel aborts the process that runs it. ``bitserve check-repo`` and a real ``bitserve
serve`` (``--no-strict-readiness``, so the good models serve beside the bad) must agree on
every one of them, word for word, and both must live through the abort; the good ones answer
as the module does in float64, with bit-packed bytes sent in either bit order (RDKit's own
bytes included).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from harness.model_formats import (
    FORMAT_FILES,
    AbortsInParallel,
    OutOfRange,
    fingerprint_mlp,
    reference,
    write_model,
)
from harness.repo_utils import model_toml, tensor
from harness.server import BitserveServer, bitserve_command, start_server

pytestmark = pytest.mark.e2e

MAX_BATCH = 8
FORMATS = tuple(FORMAT_FILES)
DEFECTS = ("static_batch", "wrong_shape", "wrong_dtype", "wrong_output", "raises")
ABORTS = "aoti_aborts"  # one more model: a package whose kernel calls std::terminate


def config(fmt: str, *, shape: int = 2048, dtype: str | None = None, out: str = "FP32") -> str:
    fp = tensor("fp", "BOOL", [shape], packing="bits")
    if dtype is not None:
        fp["dtype"] = dtype
    elif fmt == "torchscript":  # the file does not say: the config does
        fp["dtype"] = "float32"
    return model_toml(
        max_batch_size=MAX_BATCH,
        device="cpu",
        inputs=[fp],
        model={"file": FORMAT_FILES[fmt]},
        outputs=[tensor("score", out, [1])],
    )


@pytest.fixture(scope="module")
def module() -> torch.nn.Module:
    return fingerprint_mlp(hidden=(16,))


@pytest.fixture(scope="module")
def repository(module: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every format x (good, each defect): the model files are written once each."""
    root = tmp_path_factory.mktemp("formats") / "repo"
    for fmt in FORMATS:
        file = FORMAT_FILES[fmt]
        good = write_model(root / f"{fmt}_good" / file, fmt, module, MAX_BATCH)
        (root / f"{fmt}_good" / "config.toml").write_text(config(fmt))
        for defect in DEFECTS:
            folder = root / f"{fmt}_{defect}"
            folder.mkdir()
            if defect == "static_batch":
                write_model(folder / file, fmt, module, MAX_BATCH, static=True)
            elif defect == "raises":
                write_model(folder / file, fmt, OutOfRange().eval(), MAX_BATCH)
            else:
                (folder / file).write_bytes(good.read_bytes())
            text = {
                "wrong_shape": config(fmt, shape=1024),
                "wrong_dtype": config(fmt, dtype="float64"),
                "wrong_output": config(fmt, out="INT32"),
            }.get(defect, config(fmt))
            (folder / "config.toml").write_text(text)
    write_model(root / ABORTS / "model.pt2", "aoti", AbortsInParallel().eval(), MAX_BATCH)
    (root / ABORTS / "config.toml").write_text(config("aoti"))
    return root


@pytest.fixture(scope="module")
def check_lines(repository: Path) -> list[str]:
    """``bitserve check-repo`` on the repository (a real process, on the CPU)."""
    done = subprocess.run(
        [*bitserve_command(), "check-repo", str(repository)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr
    # Only the problem lines: ONNX Runtime and AOTInductor write their own to stderr too.
    lines = [line for line in done.stderr.splitlines() if line.startswith("repo/")]
    assert f"{len(lines)} problem(s) in {repository}" in done.stderr.splitlines()
    assert not any("Traceback" in line for line in lines)
    return lines


@pytest.fixture(scope="module")
def server(repository: Path) -> Iterator[BitserveServer]:
    with start_server(repository, args=["--no-strict-readiness", "--workers", "1"]) as s:
        yield s


def _index(server: BitserveServer) -> dict[str, tuple[str, str]]:
    r = httpx.post(server.url + "/v2/repository/index", json={}, timeout=30)
    r.raise_for_status()
    return {e["name"]: (e["state"], e["reason"]) for e in r.json()}


def test_check_repo_and_serve_agree_on_every_format_and_defect(
    check_lines: list[str], server: BitserveServer
) -> None:
    index = _index(server)
    assert set(index) == {f"{f}_{d}" for f in FORMATS for d in ("good", *DEFECTS)} | {ABORTS}
    for fmt in FORMATS:
        assert index[f"{fmt}_good"] == ("READY", ""), fmt
        assert not any(f"/{fmt}_good/" in line for line in check_lines)
        for defect in DEFECTS:
            name = f"{fmt}_{defect}"
            state, reason = index[name]
            mine = [line for line in check_lines if line.startswith(f"repo/{name}/")]
            assert state == "UNAVAILABLE", (name, reason)
            assert mine, f"check-repo found nothing wrong with {name}; serve said: {reason}"
            assert reason == "; ".join(mine), name
            assert "Traceback" not in reason
            assert str(server.log_path.parent) not in reason
            assert not any(path in reason for path in ("/tmp", "site-packages")), reason
    # Everything check-repo printed is about a model that serve refused.
    assert all(index[line.split("/")[1]][0] == "UNAVAILABLE" for line in check_lines)


def test_a_package_that_aborts_is_refused_and_the_server_lives(
    check_lines: list[str], server: BitserveServer, module: torch.nn.Module
) -> None:
    """Its dry run runs in a child process first: the abort is that process's end only."""
    expected = (
        f"repo/{ABORTS}/config.toml: model.file: model.pt2: the compiled model crashed during "
        "the dry run (SIGABRT; it threw c10::Error: index out of bounds: 0 <= "
    )
    mine = [line for line in check_lines if line.startswith(f"repo/{ABORTS}/")]
    assert len(mine) == 1, check_lines
    assert mine[0].startswith(expected), mine[0]
    state, reason = _index(server)[ABORTS]
    assert (state, reason) == ("UNAVAILABLE", mine[0])
    r = httpx.post(f"{server.url}/v2/repository/models/{ABORTS}/load", timeout=120)
    assert r.status_code == 400
    assert r.json()["error"] == f"failed to load '{ABORTS}': {mine[0]}"
    assert server.process.poll() is None  # a load and a reload later, still serving
    from bitserve_client import Client

    bits = np.random.default_rng(7).random((3, 2048)) < 0.1
    with Client(server.url) as client:
        got = client.infer("aoti_good", {"fp": bits})["score"]
    np.testing.assert_allclose(got, reference(module, bits), rtol=1e-5, atol=1e-5)


# The refusals as a user reads them (torch.export and ONNX state their signatures).
EXPECTED = {
    "torch_export_static_batch": (
        "repo/torch_export_static_batch/config.toml: model.file: model.pt2: input 'input' "
        "(inputs[0] 'fp') expects float32 [4, 2048]; the config gives BOOL [batch <= 8, 2048] "
        "(bit-packed) (a static batch of 4: export with a dynamic batch dimension, e.g. "
        "torch.export.Dim('batch', max=8))"
    ),
    "torch_export_wrong_shape": (
        "repo/torch_export_wrong_shape/config.toml: model.file: model.pt2: input 'input' "
        "(inputs[0] 'fp') expects float32 [batch <= 8, 2048]; the config gives "
        "BOOL [batch <= 8, 1024] (bit-packed)"
    ),
    "torch_export_wrong_dtype": (
        "repo/torch_export_wrong_dtype/config.toml: model.file: model.pt2: input 'input' "
        "(inputs[0] 'fp') expects float32 [batch <= 8, 2048]; the config gives "
        "BOOL [batch <= 8, 2048] (bit-packed) as float64 ([[inputs]] dtype is float64)"
    ),
    "torch_export_wrong_output": (
        "repo/torch_export_wrong_output/config.toml: outputs[0].datatype: INT32 for 'score', "
        "but the model gives float32 [1, 1]"
    ),
    "onnx_static_batch": (
        "repo/onnx_static_batch/config.toml: model.file: model.onnx: input 'fp' "
        "(inputs[0] 'fp') expects float32 [4, 2048]; the config gives BOOL [batch <= 8, 2048] "
        "(bit-packed) (a static batch of 4: export with a dynamic batch dimension, e.g. "
        "torch.export.Dim('batch', max=8))"
    ),
    "torchscript_wrong_dtype": (
        "repo/torchscript_wrong_dtype/config.toml: model.file: model.pt: the dry run at "
        "batch 1 failed: RuntimeError: mat1 and mat2 must have the same dtype, but got "
        "Double and Float"
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_refusals_say_why(name: str, server: BitserveServer) -> None:
    state, reason = _index(server)[name]
    assert (state, reason) == ("UNAVAILABLE", EXPECTED[name])
    # The model's own endpoints give the same reason.
    for path in ("/ready", ""):
        r = httpx.get(f"{server.url}/v2/models/{name}{path}", timeout=30)
        assert r.status_code == 503
        assert EXPECTED[name] in r.json()["error"]
    r = httpx.post(f"{server.url}/v2/repository/models/{name}/load", timeout=120)
    assert r.status_code == 400
    assert r.json()["error"] == f"failed to load '{name}': {EXPECTED[name]}"


def test_a_forward_that_raises_says_what_it_raised(server: BitserveServer) -> None:
    index = _index(server)
    for fmt, words in {
        "torch_export": "IndexError: index 100 is out of bounds",
        "torchscript": "index 100 is out of bounds",
        "aoti": "RuntimeError: index out of bounds",
        "onnx": "invalid index found, index = 100",
    }.items():
        reason = index[f"{fmt}_raises"][1]
        assert reason.startswith(
            f"repo/{fmt}_raises/config.toml: model.file: {FORMAT_FILES[fmt]}: the dry run at "
            "batch 1 failed: "
        ), reason
        assert words in reason, reason
        assert "Exception raised from" not in reason
        assert "frame #" not in reason


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_serves_like_the_module(
    fmt: str, server: BitserveServer, module: torch.nn.Module
) -> None:
    from bitserve_client import Client

    bits = np.random.default_rng(len(fmt)).random((5, 2048)) < 0.1
    expected = reference(module, bits)
    with Client(server.url) as client:
        meta = client.model_metadata(f"{fmt}_good")
        assert meta["inputs"][0]["parameters"]["bitorder"] == "big"  # the model's default
        big = client.infer(f"{fmt}_good", {"fp": bits})["score"]
        little = np.packbits(bits, axis=-1, bitorder="little")
        sent = client.infer(f"{fmt}_good", {"fp": little}, bitorder="little")["score"]
    np.testing.assert_allclose(big, expected, rtol=1e-5, atol=1e-5)
    # The same items either way, to float32 rounding: two calls of one program may round
    # differently (a full `make test` saw one value 1 ULP apart under TorchScript, whose
    # executor re-plans a graph after its first runs, and a batch may run on the event loop
    # or on the device thread); the other bit order, below, is off by far more.
    np.testing.assert_allclose(sent, big, rtol=1e-6, atol=0)
    # Bytes in the other order without saying so give other answers: the parameter matters.
    assert not np.allclose(client_infer(server, fmt, little), expected, atol=1e-4)


def client_infer(server: BitserveServer, fmt: str, packed: np.ndarray) -> np.ndarray:
    from bitserve_client import Client

    with Client(server.url) as client:
        return client.infer(f"{fmt}_good", {"fp": packed})["score"]


def test_rdkit_bytes_are_sent_as_they_are(server: BitserveServer, module: torch.nn.Module) -> None:
    """RDKit's ``BitVectToBinaryText`` bytes are ``np.packbits(bits, bitorder="little")``."""
    from bitserve_client import Client
    from rdkit import Chem
    from rdkit.Chem import rdFingerprintGenerator
    from rdkit.DataStructs import BitVectToBinaryText

    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    smiles = ["CCO", "c1ccccc1O", "CC(=O)Oc1ccccc1C(=O)O"]
    fps = [gen.GetFingerprint(Chem.MolFromSmiles(s)) for s in smiles]
    raw = np.stack([np.frombuffer(BitVectToBinaryText(fp), np.uint8) for fp in fps])
    bits = np.stack([np.array(list(fp), dtype=bool) for fp in fps])
    np.testing.assert_array_equal(raw, np.packbits(bits, axis=-1, bitorder="little"))
    with Client(server.url) as client:
        got = client.infer("torch_export_good", {"fp": raw}, bitorder="little")["score"]
    np.testing.assert_allclose(got, reference(module, bits), rtol=1e-5, atol=1e-5)


def test_bitorder_per_request_over_grpc(server: BitserveServer, module: torch.nn.Module) -> None:
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    bits = np.random.default_rng(3).random((3, 2048)) < 0.2
    little = np.packbits(bits, axis=-1, bitorder="little")
    expected = reference(module, bits)
    with grpcclient.InferenceServerClient(server.grpc_target) as client:
        stub: service_pb2_grpc.GRPCInferenceServiceStub = client._client_stub
        for order, data in (("little", little), (None, np.packbits(bits, axis=-1))):
            request = service_pb2.ModelInferRequest(model_name="onnx_good")
            tensor_in = request.inputs.add(name="fp", datatype="UINT8", shape=[3, 256])
            if order is not None:
                tensor_in.parameters["bitorder"].string_param = order
            request.raw_input_contents.append(data.tobytes())
            reply = stub.ModelInfer(request)
            got = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(3, 1)
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        request.inputs[0].parameters["bitorder"].string_param = "middle"
        with pytest.raises(Exception, match=r'bitorder must be "big" or "little"'):
            stub.ModelInfer(request)


def test_bitorder_on_an_input_that_is_not_packed_is_refused(server: BitserveServer) -> None:
    body = {
        "inputs": [{"name": "fp", "datatype": "BOOL", "shape": [1, 2048],
                    "data": [False] * 2048, "parameters": {"bitorder": "sideways"}}]
    }  # fmt: skip
    r = httpx.post(f"{server.url}/v2/models/onnx_good/infer", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"] == (
        "model 'onnx_good': input 'fp': parameters.bitorder must be \"big\" or \"little\", "
        "not 'sideways'"
    )


def test_strict_readiness_is_off_here(server: BitserveServer) -> None:
    r = httpx.get(server.url + "/v2/health/ready", timeout=10)
    assert r.status_code == 200


def test_check_repo_alone(repository: Path, tmp_path: Path) -> None:
    """check-repo on one good model of each format says OK (the dry run passes)."""
    root = tmp_path / "good"
    root.mkdir()
    for fmt in FORMATS:
        shutil.copytree(repository / f"{fmt}_good", root / fmt)
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "check-repo", str(root)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, f"{root}: OK"), done.stderr
