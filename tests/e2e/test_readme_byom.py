"""docs/models.md's "Bring your own model" section is true: its blocks run as written, in order
(they are marked ``<!-- run by tests/e2e/test_readme_byom.py -->`` there).

The Python blocks run in one namespace in a temporary folder (training is the untrained
module), the TOML block is the model's ``config.toml``, ``bitserve check-repo`` runs on the
three model folders it makes (torch.export, AOTInductor, ONNX), and the RDKit client block
runs against a real ``bitserve serve`` of them, its scores compared with the module's.
"""

from __future__ import annotations

import os
import re
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.server import bitserve_command, start_server

pytestmark = pytest.mark.e2e

PAGE = Path(__file__).resolve().parents[2] / "docs" / "models.md"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def section_blocks() -> list[tuple[str, str]]:
    text = PAGE.read_text()
    start = text.index("\n## Bring your own model\n")
    end = text.find("\n## ", start + 1)
    end = len(text) if end < 0 else end
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer(text[start:end])]


def test_the_section_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = section_blocks()
    kinds = [k for k, _ in blocks]
    assert kinds == ["bash", "python", "toml", "bash", "python", "python"], kinds
    install, train, config, commands, variants, client = (code for _, code in blocks)
    assert all(line.startswith("pip install") for line in install.splitlines())
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(train, "docs/models.md: training", "exec"), namespace)
    Path("models/fp_mlp/config.toml").write_text(config)
    with warnings.catch_warnings():  # torch's own, from the modules inductor imports
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(compile(variants, "docs/models.md: variants", "exec"), namespace)
    assert sorted(p.name for p in Path("models").iterdir()) == [
        "fp_mlp", "fp_mlp_aoti", "fp_mlp_onnx"
    ]  # fmt: skip
    check, serve = commands.splitlines()
    assert check.split("#")[0].split() == ["bitserve", "check-repo", "models/"]
    assert serve.split() == ["bitserve", "serve", "--model-repository", "models/"]
    done = subprocess.run(
        [*bitserve_command(), *check.split("#")[0].split()[1:]],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert (done.returncode, done.stdout.strip()) == (0, "models: OK"), done.stderr
    model = namespace["model"]
    assert isinstance(model, torch.nn.Module)
    with start_server(Path("models")) as server:
        for name in ("fp_mlp", "fp_mlp_aoti", "fp_mlp_onnx"):
            code = client.replace("http://127.0.0.1:8000", server.url).replace(
                '"fp_mlp"', f'"{name}"'
            )
            run: dict[str, object] = {}
            exec(compile(code, "docs/models.md: client", "exec"), run)
            packed = run["packed"]
            assert isinstance(packed, np.ndarray)
            bits = np.unpackbits(packed, axis=-1, bitorder="little").astype(np.float32)
            with torch.no_grad():
                expected = model(torch.from_numpy(bits)).numpy()
            np.testing.assert_allclose(run["scores"], expected, rtol=1e-5, atol=1e-5)
    assert os.getcwd() == str(tmp_path)
