"""Model formats, one module each behind one interface (:class:`ModelFile`).

A format is chosen by ``[model] format`` when the config gives it, else by the file's suffix
(a ``.pt2`` that holds ``data/aotinductor/`` is an AOTInductor package, any other ``.pt2`` a
``torch.export`` program). Adding a format is adding a module here and a line to
:data:`FORMATS`.

| format | suffix | module | the model's input dtypes |
|---|---|---|---|
| ``torch_export`` | ``.pt2`` | :mod:`.torch_export` | the program's signature |
| ``aoti`` | ``.pt2`` (an AOTInductor package) | :mod:`.aoti` | the package's input checks |
| ``torchscript`` | ``.pt``, ``.ts`` | :mod:`.torchscript` | ``[[inputs]] dtype`` |
| ``onnx`` | ``.onnx`` | :mod:`.onnx` | the graph's input types |
"""

from __future__ import annotations

from pathlib import Path

from service.backends.aoti import AOTIPackage, is_package
from service.backends.base import Dim, FileSignature, ModelFile, TensorSpec
from service.backends.onnx import OnnxFile
from service.backends.torch_export import ExportedProgramFile
from service.backends.torchscript import ModuleModel, TorchScriptFile

FORMATS: dict[str, type[ModelFile]] = {
    cls.format: cls for cls in (ExportedProgramFile, AOTIPackage, TorchScriptFile, OnnxFile)
}
"""Every format by its ``[model] format`` name."""

SUFFIXES: dict[str, str] = {s: cls.format for cls in FORMATS.values() for s in cls.suffixes}
"""File suffix -> the format it selects when ``[model] format`` is not given."""


def format_of(path: Path, declared: str | None = None) -> str:
    """The format of a model file: ``declared`` (``[model] format``) if given, else by its
    suffix and, for ``.pt2``, its contents."""
    if declared is not None:
        return declared
    fmt = SUFFIXES[path.suffix]
    if fmt == ExportedProgramFile.format and is_package(path):
        return AOTIPackage.format
    return fmt


def load_model_file(path: Path, declared: str | None = None) -> ModelFile:
    """Load a model file on the host in its format (see :func:`format_of`)."""
    return FORMATS[format_of(path, declared)](path)


__all__ = [
    "FORMATS",
    "SUFFIXES",
    "Dim",
    "FileSignature",
    "ModelFile",
    "ModuleModel",
    "TensorSpec",
    "format_of",
    "load_model_file",
]
