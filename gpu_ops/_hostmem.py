"""Host-memory helpers shared by the transfer functions and the staging pool."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack as _torch_from_dlpack

DeviceLike = torch.device | str | int


def cuda_available() -> bool:
    return torch.cuda.is_available()


def as_array(obj: Any) -> np.ndarray[Any, Any]:
    """``obj`` (ndarray, NumPy scalar or buffer-protocol object) as an ndarray, without a copy.

    Buffers keep their PEP 3118 format and shape (``memoryview(b).cast("f")`` is float32);
    ``bytes``/``bytearray`` are 1-D uint8.
    """
    if isinstance(obj, np.ndarray):
        return obj
    if isinstance(obj, np.generic):
        return np.asarray(obj)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            "expected a torch.Tensor, a NumPy array, a buffer (bytes, bytearray, memoryview) "
            f"or a DLPack producer, got {type(obj).__name__}"
        ) from None
    try:
        return np.asarray(view)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"buffer format {view.format!r} is not a numeric type: {exc}") from None


def check_dtype(arr: np.ndarray[Any, Any]) -> None:
    """Raise TypeError unless ``arr`` holds numbers torch has a dtype for."""
    if arr.dtype.kind not in "biufc":
        raise TypeError(f"unsupported dtype {arr.dtype}: expected bool, integer, float or complex")


def host_view(arr: np.ndarray[Any, Any], *, share_readonly: bool) -> tuple[torch.Tensor, bool]:
    """A CPU tensor with ``arr``'s values and whether it shares ``arr``'s memory.

    Writable arrays are shared (``torch.from_numpy``). Read-only arrays are shared through
    DLPack, which does not warn, only when ``share_readonly``; callers that merely read the
    result pass ``True``. Negative strides and non-native byte order have no torch equivalent
    and are copied (DLPack would even abort the process on a negative stride).

    Read-only arrays cross DLPack only where both sides speak DLPack 1.0 (its read-only flag:
    NumPy >= 2.1 with a recent torch); elsewhere NumPy raises ``BufferError`` and the array is
    shared through ``torch.from_numpy`` instead, its "not writable" warning silenced: the
    callers only read.
    """
    check_dtype(arr)
    if any(s < 0 for s in arr.strides) or not arr.dtype.isnative:
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
        return torch.from_numpy(arr), False
    if arr.flags.writeable:
        return torch.from_numpy(arr), True
    if share_readonly:
        return _share_readonly(arr), True
    return torch.from_numpy(arr.copy()), False


def _share_readonly(arr: np.ndarray[Any, Any]) -> torch.Tensor:
    try:
        return _torch_from_dlpack(arr)
    except BufferError:  # NumPy < 2.1 or a torch without DLPack 1.0: no read-only flag
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="The given NumPy array is not writable", category=UserWarning
            )
            return torch.from_numpy(arr)
