"""AOTInductor packages (``.pt2`` from ``torch._inductor.aoti_compile_and_package``).

A package holds a shared library compiled for one kind of device (its ``AOTI_DEVICE_KEY``):
it is read and checked on the host, and loaded onto the device (a CPU package runs only on
the CPU, a CUDA one only on CUDA devices) with the C++ loader that
``torch._inductor.aoti_load_package`` uses (:class:`CompiledModel`).

Its signature is read from the package itself. AOTInductor generates, for every input, a
check of its dtype and of each dimension (static sizes, the bounds of dynamic ones) into the
package's C++ wrapper; the compiled library runs those checks only under
``AOTI_RUNTIME_CHECK_INPUTS=1`` (its bound checks also refuse a batch of 1 that the program
serves). Without the checks a tensor of the wrong dtype or shape reads out of bounds, so
bitserve reads the same checks from the wrapper's source at load and holds the config to
them there: a package whose wrapper it cannot read is refused.

The kernels' own checks (an index out of range) do run. One that fails inside an OpenMP
parallel region cannot throw out of it, and the C++ runtime aborts the process: a package's
dry run is therefore made first in a child process (:mod:`service.models.dry_run_child`), where
such a crash is a refusal instead of the server's end.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from service.backends.base import Dim, FileSignature, ModelFile, TensorSpec

_MARK = "/data/aotinductor/"
_CHECK = re.compile(r"static void check_input_(\d+)\(")
_DTYPE = re.compile(r"_expected_dtype = aoti_torch_dtype_(\w+)\(\)")
_STATIC = re.compile(r"if \((\d+) != \w+_size\[(\d+)\]\)")
_LOW = re.compile(r"if \(\w+_size\[(\d+)\] < (\d+)\)")
_HIGH = re.compile(r"if \(\w+_size\[(\d+)\] > (\d+)\)")
_INDEX = re.compile(r"\w+_(?:size|stride)\[(\d+)\]")
_INPUTS = re.compile(r"inputs_info_\[(\d+)\]\.name")


def is_package(path: Path) -> bool:
    """Whether ``path`` is an AOTInductor package (a zip with ``data/aotinductor/``)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(_MARK in n for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


class AOTIPackage(ModelFile):
    """An AOTInductor package, checked on the host and loaded on its device."""

    format = "aoti"
    # a .pt2 that holds data/aotinductor/ (see service.backends.format_of)
    suffixes: ClassVar[tuple[str, ...]] = ()
    dtype_from_file = True
    # A generated kernel's check that fails inside an OpenMP region calls std::terminate.
    dry_run_in_child = True

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            wrappers = [n for n in names if _MARK in n and n.endswith(".wrapper.cpp")]
            metas = [n for n in names if _MARK in n and n.endswith("wrapper_metadata.json")]
            if len(wrappers) != 1:
                raise ValueError(
                    f"holds {len(wrappers)} compiled models' wrappers; bitserve serves a "
                    "package of exactly one (aoti_compile_and_package of one program)"
                )
            source = z.read(wrappers[0]).decode("utf-8", "replace")
            meta = json.loads(z.read(metas[0])) if metas else {}
        self.device_key = str(meta.get("AOTI_DEVICE_KEY", "cpu"))
        self._inputs = _read_checks(source)

    def signature(self) -> FileSignature:
        return FileSignature(self._inputs, None)

    def to(self, device: torch.device) -> Callable[..., Any]:
        if device.type != self.device_key:
            raise ValueError(
                f"the package is compiled for {self.device_key}, not {device.type}; compile "
                f"it with the program and example inputs on {device.type} to serve it there"
            )
        index = device.index if device.index is not None else -1
        return CompiledModel(self.path, index)


class CompiledModel:
    """A package's compiled model on its device, called with one tensor per input
    (positionally); it returns what the program returns (a tensor, a tuple, a dict).

    What ``torch._inductor.aoti_load_package`` returns, less its cost: that function imports
    ``torch._inductor`` and ``torch._dynamo`` (about 1.5 s and 100 MiB in a fresh process,
    paid by every worker, Ray actor and dry-run child that loads a package) and reads the
    package's call spec again at every call. Both use the same C++ loader.

    Args:
        path: the package.
        device_index: the CUDA device's index; -1 for the CPU (or the current device).
    """

    def __init__(self, path: Path, device_index: int) -> None:
        import torch.utils._pytree as pytree

        self._unflatten = pytree.tree_unflatten
        self._loader = torch._C._aoti.AOTIModelPackageLoader(
            str(path), "model", False, 1, device_index
        )
        self._out_spec = pytree.treespec_loads(self._loader.get_call_spec()[1])

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Run the model on ``inputs``, each batch first in the dtype the package checks."""
        return self._unflatten(self._loader.boxed_run(list(inputs)), self._out_spec)


def _read_checks(source: str) -> tuple[TensorSpec, ...]:
    """Each input's dtype and dims from the wrapper's ``check_input_<i>`` functions.

    Raises:
        ValueError: the wrapper has no readable check for some input.
    """
    count = len(set(_INPUTS.findall(source)))
    starts = [(int(m.group(1)), m.end()) for m in _CHECK.finditer(source)]
    bodies: dict[int, str] = {}
    for k, (i, start) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) else source.find("static bool", start)
        bodies[i] = source[start : end if end > 0 else None]
    if count == 0 or sorted(bodies) != list(range(count)):
        raise ValueError(
            "its wrapper has no input checks bitserve can read (a package of another torch "
            f"version?); found checks for {len(bodies)} of {count} inputs"
        )
    specs = []
    for i in range(count):
        body = bodies[i]
        m = _DTYPE.search(body)
        dtype = getattr(torch, m.group(1), None) if m else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"its wrapper states no dtype bitserve knows for input {i}")
        indices = [int(x) for x in _INDEX.findall(body)]
        rank = max(indices) + 1 if indices else 0
        static = {int(d): int(n) for n, d in _STATIC.findall(body)}
        low = {int(d): int(n) for d, n in _LOW.findall(body)}
        high = {int(d): int(n) for d, n in _HIGH.findall(body)}
        dims = tuple(
            Dim(static[d])
            if d in static
            # torch.export specialises sizes 0 and 1, so a dynamic dim declared from 1 is
            # checked from 2; the program serves a size of 1 all the same.
            else Dim(None, 1 if low.get(d, 0) == 2 else low.get(d, 0), high.get(d))
            for d in range(rank)
        )
        specs.append(TensorSpec(f"input {i}", dtype, dims))
    return tuple(specs)
