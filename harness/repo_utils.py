"""Model-repository helpers shared by the tests: ``config.toml`` text, model folders, and
the built-in demo's float64 reference.

A config is written from Python values, one ``key = value`` line each, so that tests which
edit the text (``GOOD.replace("sigma = 2.0", ...)``) can rely on its spelling::

    model_toml(
        max_batch_size=4,
        inputs=[bits_input(3, 40)],
        operator={"file": "op.safetensors", "response": "gaussian", "sigma": 2.0},
        outputs=[tensor("out", "FP32")],
    )
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


def toml_value(value: Any) -> str:
    """``value`` (a string, number, boolean or list of them) as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


def _table(header: str, keys: Mapping[str, Any]) -> str:
    """A TOML table: its ``header`` line, then one ``key = value`` line a key."""
    return "\n".join([header, *(f"{k} = {toml_value(v)}" for k, v in keys.items())])


def model_toml(
    *,
    inputs: Sequence[Mapping[str, Any]],
    outputs: Sequence[Mapping[str, Any]],
    operator: Mapping[str, Any] | None = None,
    model: Mapping[str, Any] | None = None,
    **settings: Any,
) -> str:
    """A ``config.toml``: the top-level ``settings``, then inputs, operator, model, outputs."""
    parts = ["\n".join(f"{k} = {toml_value(v)}" for k, v in settings.items())]
    parts += [_table("[[inputs]]", t) for t in inputs]
    if operator is not None:
        parts.append(_table("[operator]", operator))
    if model is not None:
        parts.append(_table("[model]", model))
    parts += [_table("[[outputs]]", t) for t in outputs]
    return "\n\n".join(p for p in parts if p) + "\n"


def tensor(
    name: str, datatype: str, shape: Sequence[int] | None = None, **keys: Any
) -> dict[str, Any]:
    """One ``[[inputs]]`` or ``[[outputs]]`` table: name, datatype, shape if given, ``keys``."""
    table: dict[str, Any] = {"name": name, "datatype": datatype}
    if shape is not None:
        table["shape"] = list(shape)
    return table | keys


def bits_input(n: int, b: int, name: str = "bits", **keys: Any) -> dict[str, Any]:
    """The operator's usual input: BOOL ``[n, b]``, bit-packed on the wire."""
    return tensor(name, "BOOL", [n, b], packing="bits", **keys)


def write_model_folder(
    folder: Path,
    config: str,
    tensors: Mapping[str, Any] | None = None,
    operator_file: str = "op.safetensors",
) -> Path:
    """Write ``folder/config.toml`` and, given ``tensors``, the operator file; return ``folder``.

    ``tensors`` are NumPy arrays or torch tensors (all of one kind), saved with safetensors.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(config)
    if tensors is not None:
        import numpy as np

        if all(isinstance(t, np.ndarray) for t in tensors.values()):
            from safetensors.numpy import save_file as save_numpy

            save_numpy(dict(tensors), str(folder / operator_file))
        else:
            from safetensors.torch import save_file as save_torch

            save_torch(dict(tensors), str(folder / operator_file))
    return folder


def torchscript(module: Any) -> Any:
    """``torch.jit.script(module)``, without TorchScript's deprecation warning (torch.export is
    preferred, and TorchScript is still served)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(module)  # type: ignore[no-untyped-call]


def demo_reference(bits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The built-in demo in float64: ``bits`` (M, 20, 50000) -> (M, 20, 500).

    A Gaussian of sigma 125 cut at 4 sigma, summed over each coarse point's window only (the
    dense operator would be 20 x 500 x 50000 float64 = 4 GB).
    """
    from service.models.demo import SIGMA, SUPPORT_SIGMAS, demo_tensors

    t = demo_tensors()
    x, c = t["x"].astype(np.float64), t["c"].astype(np.float64)
    half = int(SIGMA * SUPPORT_SIGMAS) + 1
    lo = np.floor(c).astype(np.int64)[..., None] + np.arange(-half, half + 2)  # (N, A, W)
    idx = np.clip(lo, 0, x.size - 1)
    d = c[..., None] - x[idx]
    w = np.exp(-0.5 * (d / SIGMA) ** 2) * (np.abs(d) <= SUPPORT_SIGMAS * SIGMA) * (lo == idx)
    f = bits.astype(np.float64)  # (M, N, B)
    n = np.arange(c.shape[0])[:, None, None]
    result: np.ndarray[Any, Any] = np.einsum("naw,mnaw->mna", w, f[:, n, idx])
    return result
