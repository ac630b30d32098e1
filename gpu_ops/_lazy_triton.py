"""Triton kernel modules, imported when a CUDA tensor first needs one.

Importing Triton costs about 0.4 s and 90 MiB of resident memory (measured here: ``python
-c "import gpu_ops"``), paid by every process that imports ``gpu_ops``: server workers, Ray
actors, ``check-repo`` and its dry-run children, most of which never launch a Triton kernel
(a CPU host, a CPU model). So the op modules (:mod:`gpu_ops._bits_ops`, ...) register their
CUDA kernels when Triton is installed (found without importing it), and a kernel module of
:mod:`gpu_ops._triton` is imported at its first call on a CUDA tensor. Tests import the
kernel modules themselves (``TRITON_INTERPRET=1`` on the CPU).

An installed Triton that fails to import then fails that first call with its own error,
where an eager import would have left CUDA tensors to the torch kernels without a word.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Any


class TritonKernels:
    """A kernel module of :mod:`gpu_ops._triton`, imported at the first attribute read.

    Args:
        name: the module's name in :mod:`gpu_ops._triton` (``"bits"``).
    """

    def __init__(self, name: str) -> None:
        self._name = f"gpu_ops._triton.{name}"
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        state = "imported" if self._module is not None else "not imported yet"
        return f"TritonKernels({self._name}, {state})"


def triton_kernels(name: str) -> Any:
    """:class:`TritonKernels` for ``gpu_ops._triton.<name>`` where Triton is installed, else
    None (CUDA tensors then take the torch kernels)."""
    if importlib.util.find_spec("triton") is None:
        return None
    return TritonKernels(name)
