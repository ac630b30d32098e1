"""ONNX models (``.onnx``) through ONNX Runtime (the ``onnx`` extra: ``onnxruntime``).

The signature is the graph's: each input's element type and dims (a named or unnamed dim is
dynamic, without bounds). On the CPU the model runs on ONNX Runtime's CPU provider; on a
CUDA device on its CUDA provider (``onnxruntime-gpu``), on torch's current stream of that
device. Either way inputs and outputs stay where they are: each call binds the pipeline's
tensors to the session through DLPack (``OrtValue.from_dlpack``, no copy), lets ONNX Runtime
allocate the outputs on the device, and hands them back to torch through DLPack again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.dlpack import from_dlpack

from service.backends.base import Dim, FileSignature, ModelFile, TensorSpec

# ONNX Runtime's element type names -> torch dtypes.
_DTYPES = {
    "tensor(float)": torch.float32,
    "tensor(double)": torch.float64,
    "tensor(float16)": torch.float16,
    "tensor(bfloat16)": torch.bfloat16,
    "tensor(bool)": torch.bool,
    "tensor(uint8)": torch.uint8,
    "tensor(int8)": torch.int8,
    "tensor(int16)": torch.int16,
    "tensor(int32)": torch.int32,
    "tensor(int64)": torch.int64,
}


def _runtime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise ValueError(
            "serving .onnx models needs onnxruntime: pip install 'bitserve[onnx]'"
        ) from None
    return onnxruntime


class OnnxFile(ModelFile):
    """An ONNX model, opened in an ONNX Runtime session (CPU provider on the host)."""

    format = "onnx"
    suffixes = (".onnx",)
    dtype_from_file = True

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        ort = _runtime()
        self._ort = ort
        self.session = ort.InferenceSession(
            str(path), _options(ort), providers=["CPUExecutionProvider"]
        )

    def signature(self) -> FileSignature:
        read = _read_names(self.path)
        inputs = [_spec(a) for a in self.session.get_inputs()]
        if read is not None:
            inputs = [replace(t, used=t.name in read) for t in inputs]
        return FileSignature(tuple(inputs), tuple(_spec(a) for a in self.session.get_outputs()))

    def to(self, device: torch.device) -> Callable[..., Any]:
        if device.type == "cpu":
            return OrtRunner(self._ort, self.session, "cpu", 0)
        if device.type != "cuda":
            raise ValueError(f"ONNX Runtime here serves cpu and cuda devices, not {device.type}")
        if "CUDAExecutionProvider" not in self._ort.get_available_providers():
            raise ValueError(
                "this onnxruntime has no CUDA provider: install onnxruntime-gpu to serve an "
                "ONNX model on a GPU"
            )
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = torch.cuda.current_stream(index).cuda_stream
        options = {"device_id": index, "user_compute_stream": str(stream)}
        session = self._ort.InferenceSession(
            str(self.path),
            _options(self._ort),
            providers=[("CUDAExecutionProvider", options), "CPUExecutionProvider"],
        )
        return OrtRunner(self._ort, session, "cuda", index)


class OrtRunner:
    """Calls an ONNX Runtime session on torch tensors of one device, with no copies.

    Args:
        ort: the ``onnxruntime`` module.
        session: the session (its provider runs on the tensors' device).
        device_type: ``"cpu"`` or ``"cuda"``, as ONNX Runtime names them.
        device_id: the device's index.
    """

    def __init__(self, ort: Any, session: Any, device_type: str, device_id: int) -> None:
        self._ort = ort
        self.session = session
        self._inputs = [a.name for a in session.get_inputs()]
        self._outputs = [a.name for a in session.get_outputs()]
        self._device = (device_type, device_id)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One tensor per graph input, in the graph's order; its outputs in theirs."""
        binding = self.session.io_binding()
        for name, t in zip(self._inputs, tensors, strict=True):
            binding.bind_ortvalue_input(name, self._ort.OrtValue.from_dlpack(t.contiguous()))
        for name in self._outputs:
            binding.bind_output(name, *self._device)
        self.session.run_with_iobinding(binding)
        # The OrtValue's own DLPack export (the wrapper class does not re-export it).
        return tuple(from_dlpack(v._ortvalue) for v in binding.get_outputs())


def _options(ort: Any) -> Any:
    """Session options: ONNX Runtime's own log quiet but for fatal errors (a failed run is
    raised, and reported with its message, by bitserve; ORT would print it to stderr too),
    and its threads those torch was given.

    By default ONNX Runtime runs one thread per core whatever the process was given, and its
    idle threads spin: a server worker whose torch threads leave a core to its event loop
    (see ``service.cluster.supervisor``) then had both cores taken by ONNX Runtime, which served
    0.60x the rows of the same model as torch.export while it computed as fast alone
    (benchmarks/results/formats.md). Its intra-op threads are torch's, and they sleep when
    idle."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def _read_names(path: Path) -> set[str] | None:
    """Every value name the graph's nodes (subgraphs included) read or it outputs; None when
    the ``onnx`` package is not installed (then whether an input is read is not known)."""
    try:
        import onnx
    except ImportError:
        return None
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # ONNX Runtime opened it; a parse problem here is not a refusal
        return None
    names: set[str] = set()

    def visit(graph: Any) -> None:
        names.update(o.name for o in graph.output)
        for node in graph.node:
            names.update(node.input)
            for attr in node.attribute:
                for sub in [attr.g, *attr.graphs] if attr.HasField("g") else attr.graphs:
                    visit(sub)

    visit(model.graph)
    return names


def _spec(arg: Any) -> TensorSpec:
    shape = arg.shape if isinstance(arg.shape, list) else []
    dims = tuple(
        Dim(d) if isinstance(d, int) and d >= 0 else Dim(None, name=str(d or "")) for d in shape
    )
    return TensorSpec(arg.name, _DTYPES.get(arg.type), dims)
