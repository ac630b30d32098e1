"""TorchScript modules (``.pt``, ``.ts``): the file states no input dtypes or shapes, so
``[[inputs]] dtype`` says what the model is handed (default: the input's own datatype)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from service.backends.base import FileSignature, ModelFile


class ModuleModel(ModelFile):
    """A ``torch.nn.Module`` already in memory (an embedding program's or a test's), served
    as TorchScript is: no signature, ``[[inputs]] dtype`` says what it is handed.

    Args:
        module: the module (eager or scripted).
        path: the name messages give it.
    """

    format = "module"
    suffixes: ClassVar[tuple[str, ...]] = ()
    dtype_from_file = False

    def __init__(self, module: torch.nn.Module, path: Path = Path("<module>")) -> None:
        super().__init__(path)
        self.module = module

    def signature(self) -> FileSignature:
        return FileSignature()

    def to(self, device: torch.device) -> Callable[..., Any]:
        module: torch.nn.Module = self.module.to(device)
        module.eval()
        return module


class TorchScriptFile(ModuleModel):
    """A TorchScript module read with ``torch.jit.load`` onto the CPU."""

    format = "torchscript"
    suffixes = (".pt", ".ts")

    def __init__(self, path: Path) -> None:
        with warnings.catch_warnings():
            # TorchScript is deprecated in favour of torch.export but still the common format.
            warnings.simplefilter("ignore", DeprecationWarning)
            module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
        super().__init__(module, path)
