"""The built-in demo model, served when no repository is given, and its repository form.

``demo``: 20 functions of 50000 bits each (input ``spikes``, BOOL [20, 50000] packed big-endian,
UINT8 [batch, 20, 6250] on the wire), convolved with a Gaussian of sigma = 125 fine points cut
at 4 sigma and resampled at 500 sorted random coarse points per function (fixed seed); output
``resampled`` FP32 [20, 500]. The same workload as the end-to-end benchmark.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from service.models.config import CONFIG_FILE, ModelConfig, parse_config, patched

DEMO_NAME = "demo"
DEMO_SEED = 20240607
N_FUNCTIONS = 20
N_FINE = 50_000
N_COARSE = 500
SIGMA = 125.0
SUPPORT_SIGMAS = 4.0
OPERATOR_FILE = "operator.safetensors"

DEMO_CONFIG_TOML = f"""\
# bitserve demo model: written by `bitserve demo-repo`; see README "Model repository".
max_batch_size = 16          # 0 = no batching (and no batch dimension)
max_queue_delay_us = 1000    # the first request of a batch waits at most this long for others
max_queue_size = 128         # beyond this many waiting requests: 503 with Retry-After
device = "auto"              # "auto" = cuda if available, else cpu; or "cuda:1", "cpu"

[[inputs]]
name = "spikes"
datatype = "BOOL"
shape = [{N_FUNCTIONS}, {N_FINE}]   # logical shape of one item, without the batch dimension
packing = "bits"             # on the wire: UINT8 [batch, {N_FUNCTIONS}, {(N_FINE + 7) // 8}]
bitorder = "big"

[operator]
file = "{OPERATOR_FILE}"   # tensors "x" ({N_FINE},) and "c" ({N_FUNCTIONS}, {N_COARSE})
response = "gaussian"
sigma = {SIGMA}              # in units of x (here: fine points)
support = {SUPPORT_SIGMAS}             # cut-off, in sigmas
dtype = "float32"

[[outputs]]
name = "resampled"
datatype = "FP32"
shape = [{N_FUNCTIONS}, {N_COARSE}]
"""


def demo_config(patch: Mapping[str, Any] | None = None) -> ModelConfig:
    """The demo's configuration (parsed from the same text ``write_demo_repository`` writes),
    with ``patch``'s keys in place of its own (a load's config override)."""
    source = f"<built-in {DEMO_NAME}>/{CONFIG_FILE}"
    return parse_config(*patched(tomllib.loads(DEMO_CONFIG_TOML), source, patch))


def demo_tensors(seed: int = DEMO_SEED) -> dict[str, np.ndarray]:
    """The demo operator's tensors.

    Returns:
        ``{"x": (B,) float32 fine grid 0..B-1, "c": (N, A) float32 sorted coarse points}``;
        coarse points are uniform in ``[0, B - 1]`` from a fixed seed.
    """
    rng = np.random.default_rng(seed)
    x = np.arange(N_FINE, dtype=np.float32)
    c = np.sort(rng.uniform(0.0, N_FINE - 1, size=(N_FUNCTIONS, N_COARSE)), axis=1)
    return {"x": x, "c": c.astype(np.float32)}


def write_demo_repository(root: Path) -> Path:
    """Write the demo model as a repository: ``root/demo/1/{config.toml, operator.safetensors}``.

    Args:
        root: the repository folder (created if missing). An existing ``demo`` model in it
            is an error, so nothing a user wrote is overwritten.

    Returns:
        The model's folder, ``root / "demo"``.

    Raises:
        FileExistsError: ``root / "demo"`` exists already.
    """
    from safetensors.numpy import save

    model = root / DEMO_NAME
    if model.exists():
        raise FileExistsError(f"{model} exists already; choose an empty folder")
    version = model / "1"
    version.mkdir(parents=True)
    (version / CONFIG_FILE).write_text(DEMO_CONFIG_TOML)
    # Written like the config, with the umask's permissions: safetensors' save_file makes
    # its files 0600, which a container's user (another uid) could not read from a mount.
    (version / OPERATOR_FILE).write_bytes(save(demo_tensors()))
    return model
