"""``numpy.packbits`` / ``numpy.unpackbits`` for torch tensors on any device.

The semantics are NumPy's, with ``dim`` for ``axis``; unpacking goes straight into the
compute dtype (uint8, bool, float16, bfloat16, float32 or float64) in one pass, and can write
into a preallocated ``out`` such as a slice of a batch buffer::

    >>> import torch, gpu_ops
    >>> x = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    >>> packed = gpu_ops.packbits(x, dim=-1)  # tensor([[176, 128]], dtype=torch.uint8)
    >>> gpu_ops.unpackbits(packed, dim=-1, count=9, dtype=torch.float32)
    tensor([[1., 0., 1., 1., 0., 0., 0., 0., 1.]])

The functions check and normalise their arguments, then call the torch operators
``torch.ops.bitserve.packbits`` / ``unpackbits`` / ``unpackbits_into`` (``gpu_ops._bits_ops``),
which the dispatcher sends to a kernel by device: fused Triton kernels on CUDA, a compiled C
unpacker and NumPy's packbits on the CPU, chunked torch lookups elsewhere (and on the CPU
without a C compiler, or with ``BITSERVE_CPU_KERNELS=0``). Being torch operators, they
compile with ``torch.compile(fullgraph=True)`` and export with ``torch.export``.
``gpu_ops._reference`` holds the slow reference the tests compare every kernel with.
"""

from __future__ import annotations

import operator

import torch

from gpu_ops import _bits_ops

__all__ = ["UNPACK_DTYPES", "packbits", "unpackbits"]

#: The dtypes :func:`unpackbits` can produce.
UNPACK_DTYPES: tuple[torch.dtype, ...] = (
    torch.uint8,
    torch.bool,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)

_PACK_INPUT_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {getattr(torch, name) for name in ("uint16", "uint32", "uint64") if hasattr(torch, name)}
)


def _check_bitorder(bitorder: object) -> str:
    if bitorder == "big" or bitorder == "little":
        return bitorder
    raise ValueError(f"bitorder must be 'big' or 'little', got {bitorder!r}")


def _check_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} expects a torch.Tensor, got {type(x).__name__}")
    return x


def _as_int(value: object, what: str) -> int:
    """``operator.index(value)``, refusing bools (NumPy refuses them too)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    try:
        return operator.index(value)
    except TypeError:  # an __index__ that refuses
        raise TypeError(f"{what} must be an int, got {type(value).__name__}") from None


def _resolve_dim(x: torch.Tensor, dim: object) -> tuple[torch.Tensor, int]:
    """The tensor to work on and its non-negative packed axis.

    ``dim=None`` flattens in C order (a view when ``x`` is contiguous); a 0-d tensor acts as
    a 1-element vector for ``dim`` in {None, 0, -1}, as in NumPy.
    """
    if dim is None:
        return x.reshape(-1), 0
    d = _as_int(dim, "dim")
    ndim = max(x.dim(), 1)
    if not -ndim <= d < ndim:
        raise ValueError(
            f"dim {d} is out of range for a tensor with {x.dim()} dimension(s) "
            f"(expected {-ndim} <= dim < {ndim})"
        )
    if x.dim() == 0:
        return x.reshape(1), 0
    return x, d % ndim


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The [first, last) byte addresses of the elements ``t`` spans (strides are >= 0)."""
    start = t.data_ptr()
    last = sum((size - 1) * st for size, st in zip(t.shape, t.stride(), strict=True))
    return start, start + (last + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share storage and their spanned byte ranges intersect.

    Conservative for interleaved views (``buf[0::2]`` / ``buf[1::2]`` count as overlapping).
    """
    if a.numel() == 0 or b.numel() == 0 or a.device.type == "meta":
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, a1 = _byte_span(a)
    b0, b1 = _byte_span(b)
    return a0 < b1 and b0 < a1


def _check_out(
    out: object, shape: list[int], dtype: torch.dtype, device: torch.device, x: torch.Tensor
) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if list(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype}, expected {dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, expected {device} (the input's device)")
    if any(st == 0 and size > 1 for st, size in zip(out.stride(), out.shape, strict=True)):
        raise ValueError("out must not be an expanded tensor (a stride of 0 writes overlap)")
    # Fake tensors (torch.compile, torch.export) have no memory to compare.
    if not torch.compiler.is_compiling() and _overlaps(out, x):
        # The kernels read x while writing out: an overlap would read bits already overwritten.
        raise ValueError("out overlaps the input x (they share memory); pass a separate buffer")
    return out


def packbits(x: torch.Tensor, dim: int | None = None, bitorder: str = "big") -> torch.Tensor:
    """Pack the elements of a bool or integer tensor into the bits of a uint8 tensor.

    ``numpy.packbits`` with ``dim`` for ``axis``: any nonzero element is a 1 bit, eight
    elements make a byte, the last byte along ``dim`` is zero-padded.

    Args:
        x: (...) bool or integer tensor, on any device, any strides.
        dim: the dimension to pack (negative counts from the end). Default None: pack the
            C-order flattening of ``x`` into a 1-D result.
        bitorder: "big" (default): the first element goes to the most significant bit;
            "little": to the least significant bit.

    Returns:
        uint8 tensor on ``x``'s device: ``x``'s shape with ``dim`` of length ceil(n / 8)
        (n = ``x.shape[dim]``), or (ceil(x.numel() / 8),) when ``dim`` is None.

    Raises:
        TypeError: ``x`` is not a bool or integer tensor, or ``dim`` is not an int.
        ValueError: ``dim`` is out of range, or ``bitorder`` is not "big" or "little".
    """
    x = _check_tensor(x, "packbits")
    if x.dtype not in _PACK_INPUT_DTYPES:
        raise TypeError(f"packbits expects a bool or integer tensor, got dtype {x.dtype}")
    order = _check_bitorder(bitorder)
    x, d = _resolve_dim(x, dim)
    out: torch.Tensor = _bits_ops.packbits(x, d, order)
    return out


def unpackbits(
    x: torch.Tensor,
    dim: int | None = None,
    count: int | None = None,
    bitorder: str = "big",
    dtype: torch.dtype = torch.uint8,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Unpack the bits of a uint8 tensor into 0/1 elements of ``dtype``.

    ``numpy.unpackbits`` with ``dim`` for ``axis``, producing ``dtype`` directly (no uint8
    intermediate the size of the output).

    Args:
        x: (...) uint8 tensor, on any device, any strides.
        dim: the dimension to unpack (negative counts from the end). Default None: unpack
            the C-order flattening of ``x`` into a 1-D result.
        count: the number of bits to keep along ``dim``. None (default): all 8n, where n is
            the length of ``dim``. ``count >= 0``: exactly ``count`` bits, truncating (even
            in the middle of a byte) or padding with zeros. ``count < 0``: 8n + count bits.
        bitorder: "big" (default): the most significant bit comes first; "little": the
            least significant bit.
        dtype: uint8 (default), bool, float16, bfloat16, float32 or float64.
        out: optional preallocated result, for example a slice of a batch buffer; any
            strides (it must not be an expanded tensor), the exact result shape, ``dtype``
            and ``x``'s device. It must not overlap ``x``.

    Returns:
        ``out``, or a new tensor: ``x``'s shape with ``dim`` of length ``count`` (8n when
        None), or (count,) when ``dim`` is None.

    Raises:
        TypeError: ``x`` is not a uint8 tensor, or ``dim`` / ``count`` is not an int.
        ValueError: ``dim`` out of range; 8n + ``count`` < 0; a bad ``bitorder``; an
            unsupported ``dtype``; ``out`` of the wrong shape, dtype or device, expanded, or
            overlapping ``x``.
    """
    x = source = _check_tensor(x, "unpackbits")
    if x.dtype != torch.uint8:
        raise TypeError(f"unpackbits expects a uint8 tensor, got dtype {x.dtype}")
    order = _check_bitorder(bitorder)
    if dtype not in UNPACK_DTYPES:
        names = ", ".join(str(t).removeprefix("torch.") for t in UNPACK_DTYPES)
        raise ValueError(f"dtype must be one of {names}; got {dtype}")
    x, d = _resolve_dim(x, dim)
    total = 8 * x.shape[d]
    if count is None:
        n_bits = total
    else:
        n_bits = _as_int(count, "count")
        if n_bits < 0:
            if total + n_bits < 0:
                raise ValueError(
                    f"count={n_bits} asks to drop more bits than the {total} along dim {d}"
                )
            n_bits += total
    if out is None:
        result: torch.Tensor = _bits_ops.unpackbits(x, d, n_bits, order, dtype)
        return result
    shape = list(x.shape)
    shape[d] = n_bits
    out = _check_out(out, shape, dtype, x.device, source)
    _bits_ops.unpackbits_into(x, d, order, out)
    return out
