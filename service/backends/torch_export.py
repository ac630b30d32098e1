"""``torch.export`` programs (``.pt2`` from ``torch.export.save``): the signature is the
program's own (each user input's dtype and dims, dynamic dims with their ranges)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.export.graph_signature import OutputKind

from service.backends.base import FileSignature, ModelFile, TensorSpec, dims_of

# torch.export.load keeps its deserializer in a module global (torch._export.serde's
# _CURRENT_DESERIALIZER) and fails with "already set" when two threads load at once: the
# repository builds versions in parallel (loads at start, loads on demand), so loads take turns.
_LOAD_LOCK = threading.Lock()


class ExportedProgramFile(ModelFile):
    """A ``torch.export.ExportedProgram`` read with ``torch.export.load`` (no pickle)."""

    format = "torch_export"
    suffixes = (".pt2",)
    dtype_from_file = True

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        import gpu_ops  # noqa: F401 - registers torch.ops.bitserve.*, which programs may call

        with _LOAD_LOCK:
            self.program: torch.export.ExportedProgram = torch.export.load(str(path))

    def signature(self) -> FileSignature:
        ep = self.program
        nodes = {n.name: n for n in ep.graph.nodes}
        ranges = ep.range_constraints
        inputs: list[TensorSpec] = []
        for name in ep.graph_signature.user_inputs:
            val = nodes[name].meta.get("val") if name in nodes else None
            if isinstance(val, torch.Tensor):
                used = bool(nodes[name].users)  # a placeholder nothing reads
                inputs.append(TensorSpec(name, val.dtype, dims_of(val.shape, ranges), used))
            else:  # a non-tensor user input: the pipeline passes tensors only
                inputs.append(TensorSpec(name, None, None))
        outputs: list[TensorSpec] = []
        out_node = next(n for n in ep.graph.nodes if n.op == "output")
        specs = ep.graph_signature.output_specs
        for spec, arg in zip(specs, _flat(out_node.args[0]), strict=False):
            if spec.kind != OutputKind.USER_OUTPUT:
                continue  # a buffer the program mutates
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            dtype = val.dtype if isinstance(val, torch.Tensor) else None
            dims = dims_of(val.shape, ranges) if isinstance(val, torch.Tensor) else None
            outputs.append(TensorSpec(f"output {len(outputs)}", dtype, dims))
        return FileSignature(tuple(inputs), tuple(outputs))

    def to(self, device: torch.device) -> Callable[..., Any]:
        from torch.export.passes import move_to_device_pass

        return move_to_device_pass(self.program, device).module()


def _flat(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [x for v in value for x in _flat(v)]
    return [value]
