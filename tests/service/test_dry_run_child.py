"""AOTInductor packages: the loader beside torch's own, and their dry run in a child process
(a kernel that aborts its process is a refusal, not this process's end). End to end, through
``bitserve check-repo`` and a real server: tests/e2e/test_formats_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from harness.model_formats import AbortsInParallel, fingerprint_mlp, write_model
from harness.repo_utils import model_toml, tensor
from service.backends import load_model_file
from service.backends.aoti import CompiledModel
from service.models.builder import build_version, check_repository
from service.models.config import ConfigError
from service.models.layout import model_versions

BITS = 2048  # a sum over this many bits is a reduction inductor runs in parallel
MAX_BATCH = 16


class TwoScores(nn.Module):
    """A program that returns a dict: the pipeline takes outputs by name."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = fingerprint_mlp(hidden=(8,), bits=BITS)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        score = self.mlp(x)
        return {"score": score, "twice": 2 * score}


def config(twice: str = "FP32") -> str:
    return model_toml(
        max_batch_size=MAX_BATCH,
        device="cpu",
        inputs=[tensor("fp", "BOOL", [BITS], packing="bits")],
        model={"file": "model.pt2"},
        outputs=[tensor("score", "FP32", [1]), tensor("twice", twice, [1])],
    )


# AOTInductor packages compiled, child processes: `make test` runs these, `make test-unit` not.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``good`` (a dict of two outputs), ``wrong_output`` (the same package, "twice" declared
    INT32) and ``aborts`` (a kernel that calls std::terminate)."""
    root = tmp_path_factory.mktemp("aoti") / "repo"
    good = write_model(root / "good" / "model.pt2", "aoti", TwoScores().eval(), MAX_BATCH,
                       bits=BITS)  # fmt: skip
    (root / "good" / "config.toml").write_text(config())
    (root / "wrong_output").mkdir()
    (root / "wrong_output" / "model.pt2").write_bytes(good.read_bytes())
    (root / "wrong_output" / "config.toml").write_text(config(twice="INT32"))
    write_model(root / "aborts" / "model.pt2", "aoti", AbortsInParallel().eval(), MAX_BATCH,
                bits=BITS)  # fmt: skip
    (root / "aborts" / "config.toml").write_text(config())
    return root


def test_the_compiled_model_answers_as_torchs_loader_and_the_module(repository: Path) -> None:
    from torch._inductor import aoti_load_package

    path = repository / "good" / "model.pt2"
    ours = load_model_file(path).to(torch.device("cpu"))
    assert isinstance(ours, CompiledModel)
    theirs = aoti_load_package(str(path))
    module = TwoScores().eval()
    for rows in (1, 5, MAX_BATCH):
        x = (torch.rand(rows, BITS) < 0.3).float()
        got = ours(x)
        assert sorted(got) == ["score", "twice"]
        want = theirs(x)
        with torch.no_grad():
            eager = module(x)
        for name in ("score", "twice"):
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
            torch.testing.assert_close(got[name], eager[name], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: no parallel region")
def test_an_aborting_package_is_a_refusal_of_check_repo(repository: Path) -> None:
    problems = check_repository(repository, max_operator_bytes=1 << 20)
    crash = [p for p in problems if p.startswith("repo/aborts/")]
    assert len(crash) == 1, problems
    assert crash[0].startswith(
        "repo/aborts/config.toml: model.file: model.pt2: the compiled model crashed during the "
        "dry run (SIGABRT; it threw c10::Error: index out of bounds: 0 <= "
    ), crash
    assert crash[0].endswith(" < 10L)"), crash
    assert [p for p in problems if not p.startswith("repo/aborts/")] == [
        "repo/wrong_output/config.toml: outputs[1].datatype: INT32 for 'twice', but the model "
        "gives float32 [1, 1]"
    ]


def test_the_childs_refusal_is_the_in_process_one(repository: Path) -> None:
    src = model_versions(repository, "wrong_output")["1"]
    said = []
    for isolate in (True, False):
        with pytest.raises(ConfigError) as info:
            build_version("wrong_output", src, default_device="cpu", max_operator_bytes=1 << 20,
                          isolate=isolate)  # fmt: skip
        said.append(info.value.problems)
    assert said[0] == said[1]
    # and a good package is built here after its child's dry run
    _, pipe = build_version("good", model_versions(repository, "good")["1"],
                            default_device="cpu", max_operator_bytes=1 << 20)  # fmt: skip
    assert pipe.output_shapes == [[1], [1]]


def test_the_child_ends_when_its_parent_does(repository: Path) -> None:
    """Its stdin is the lifeline: closed (the parent gone), the child exits at once, long
    before its build would have finished (it has not imported torch yet)."""
    src = model_versions(repository, "good")["1"]
    request = {
        "name": "good", "version": "1", "folder": str(src.folder),
        "model_folder": str(src.model_folder), "source": src.source,
        "default_device": "cpu", "threads": 1, "max_operator_bytes": 1 << 20,
        "max_batch_bytes": 1 << 30, "patch": None,
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "service.models.builder"],
        input=json.dumps(request).encode() + b"\n",
        capture_output=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (3, b""), done.stderr
    # Held open, it answers.
    with subprocess.Popen(
        [sys.executable, "-m", "service.models.builder"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    ) as proc:
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write(json.dumps(request).encode() + b"\n")
        proc.stdin.flush()
        answer = json.loads(proc.stdout.read())
        proc.stdin.close()
        assert (proc.wait(timeout=120), answer) == (0, {"problems": []})


def test_bits_reach_the_package_as_the_module_gets_them(repository: Path) -> None:
    src = model_versions(repository, "good")["1"]
    _, pipe = build_version("good", src, default_device="cpu", max_operator_bytes=1 << 20)
    from service.models.signature import Bound, WireInput

    bits = np.random.default_rng(1).random((4, BITS)) < 0.3
    score, twice = pipe.run([Bound((WireInput(np.packbits(bits, axis=-1), True),), (0, 1), 4)])[0]
    with torch.no_grad():
        ref = TwoScores().eval()(torch.from_numpy(bits).float())
    np.testing.assert_allclose(score, ref["score"].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(twice, 2 * score, rtol=1e-6)
