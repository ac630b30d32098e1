"""Tensor payloads: shape checks, binary views, JSON ``data`` and BYTES elements.

Every function here checks sizes with Python integers (no overflow) *before* allocating
anything, so a declared shape of ``[10**12]`` is refused with a 400 instead of an allocation.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from service.errors import InvalidInput
from service.protocol.types import BF16, BYTES, DATATYPES, WIRE_DTYPES

# A tensor may not declare more elements than this, whatever its payload; it only guards the
# arithmetic, the real limit is the body size.
MAX_ELEMENTS = 1 << 40
_LEN = struct.Struct("<I")


def check_datatype(datatype: object, what: str) -> str:
    """Return ``datatype`` if it is a V2 datatype name, else raise InvalidInput."""
    if not isinstance(datatype, str) or (datatype not in WIRE_DTYPES and datatype != BYTES):
        known = ", ".join([*WIRE_DTYPES, BYTES])
        raise InvalidInput(f"{what}: unknown datatype {datatype!r} (expected one of {known})")
    return datatype


def check_shape(shape: object, what: str) -> tuple[int, ...]:
    """Validate a declared shape: a list of non-negative integers (booleans refused).

    Returns:
        the shape as a tuple.
    """
    if not isinstance(shape, list):
        raise InvalidInput(f"{what}: 'shape' must be a list of non-negative integers")
    dims: list[int] = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int):
            raise InvalidInput(f"{what}: shape {shape} has a non-integer dimension {d!r}")
        if d < 0:
            raise InvalidInput(f"{what}: shape {shape} has a negative dimension {d}")
        if d > MAX_ELEMENTS:
            # Bounded one by one too: with a zero elsewhere the product is 0, but NumPy
            # cannot even describe a dimension past the int64 range.
            raise InvalidInput(f"{what}: shape {shape} has a dimension {d} past {MAX_ELEMENTS}")
        dims.append(d)
    count = math.prod(dims)  # Python int: exact, cannot overflow
    if count > MAX_ELEMENTS:
        raise InvalidInput(f"{what}: shape {shape} declares {count} elements, too many")
    return tuple(dims)


def element_count(shape: Sequence[int]) -> int:
    """The number of elements of ``shape`` (1 for a scalar shape ``[]``)."""
    return math.prod(shape)


def from_binary(
    buf: memoryview, datatype: str, shape: tuple[int, ...], what: str, size_of: str = ""
) -> np.ndarray[Any, Any]:
    """View ``buf`` as a tensor of ``datatype`` and ``shape`` (no copy for fixed-size types).

    This is where every transport's binary data is checked against its declared shape
    (REST's ``binary_data_size`` and raw bodies, gRPC's ``raw_input_contents``, shared
    memory).

    Args:
        buf: exactly the tensor's bytes (little-endian, row-major, no padding).
        datatype: a V2 datatype, BYTES and BF16 included.
        shape: the declared shape, already checked by :func:`check_shape`.
        what: names the tensor in error messages.
        size_of: what declared ``buf``'s size, for the message (``binary_data_size``).

    Returns:
        a read-only array of ``shape`` over ``buf`` (an object array of ``bytes`` for BYTES;
        for BF16 a ``<u2`` array of the raw bfloat16 bits, see :func:`bf16_bits_to_float32`).
    """
    count = element_count(shape)
    if datatype == BYTES:
        return _parse_bytes(buf, shape, count, what)
    dtype = WIRE_DTYPES[datatype]
    expected = count * dtype.itemsize
    if buf.nbytes != expected:
        got = f"{size_of} is {buf.nbytes}" if size_of else f"got {buf.nbytes}"
        raise InvalidInput(
            f"{what}: shape {list(shape)} of {datatype} needs {expected} bytes, {got}"
        )
    if datatype == "BOOL":
        raw = np.frombuffer(buf, dtype=np.uint8)
        # A byte other than 0/1 would make a NumPy bool that is neither True nor False.
        if raw.size and int(raw.max()) > 1:
            raise InvalidInput(f"{what}: BOOL data must be bytes 0 or 1")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    arr.flags.writeable = False
    return arr


def _parse_bytes(
    buf: memoryview, shape: tuple[int, ...], count: int, what: str
) -> np.ndarray[Any, Any]:
    # Each element carries a 4-byte length, so the count is bounded by the bytes we have.
    if count * _LEN.size > buf.nbytes:
        raise InvalidInput(
            f"{what}: shape {list(shape)} of BYTES needs at least {count * _LEN.size} bytes, "
            f"got {buf.nbytes}"
        )
    out = np.empty(count, dtype=object)
    pos = 0
    end = buf.nbytes
    for i in range(count):
        if pos + _LEN.size > end:
            raise InvalidInput(f"{what}: BYTES data ends inside the length of element {i}")
        (n,) = _LEN.unpack_from(buf, pos)
        pos += _LEN.size
        if pos + n > end:
            raise InvalidInput(f"{what}: BYTES element {i} declares {n} bytes past the end")
        out[i] = bytes(buf[pos : pos + n])
        pos += n
    if pos != end:
        raise InvalidInput(f"{what}: {end - pos} bytes left after {count} BYTES elements")
    return out.reshape(shape)


def float_to_bf16_bits(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Round floats to bfloat16, nearest-even, returned as the raw bits (``<u2``, same shape).

    Rounds once to float32 first (float64 input is thus rounded twice, like a client that
    holds float32 data); a float32 past the bfloat16 range rounds to +-inf, NaN stays a
    (quiet) NaN of the same sign.
    """
    f32 = np.asarray(x, dtype=np.float32, order="C")
    # uint64 so that the rounding increment cannot wrap (NaNs with all bits set would).
    u = f32.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet_nan = (u >> 16) | 0x0040  # keep sign and payload top, force the quiet bit
    return np.where(np.isnan(f32), quiet_nan, rounded).astype("<u2")


def bf16_bits_to_float32(bits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The float32 values of bfloat16 bits (exact: bfloat16 is float32's upper half)."""
    wide = np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16
    out: np.ndarray[Any, Any] = wide.view(np.float32)
    return out


def as_bf16_bits(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """An output array as bfloat16 bits: ``uint16`` arrays are taken as bits, floats rounded.

    Raises:
        TypeError: ``arr`` is neither (a server bug, not a client error).
    """
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 2:
        return np.asarray(arr, dtype="<u2")
    if arr.dtype.kind == "f":
        return float_to_bf16_bits(arr)
    raise TypeError(f"a BF16 output needs uint16 bits or floats, got {arr.dtype}")


def to_binary_bytes(arr: np.ndarray[Any, Any]) -> bytes:
    """Serialise an object array of ``bytes``/``str`` as length-prefixed BYTES elements."""
    parts: list[bytes] = []
    for item in arr.reshape(-1):
        b = item.encode() if isinstance(item, str) else bytes(item)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def _flatten(data: list[Any], shape: tuple[int, ...], what: str) -> list[Any]:
    """Flatten nested lists that must match ``shape`` exactly, or accept a flat list."""
    count = element_count(shape)
    if not data or not isinstance(data[0], list):
        if any(isinstance(v, list) for v in data):
            raise InvalidInput(f"{what}: 'data' mixes lists and scalars")
        if len(data) != count:
            raise InvalidInput(
                f"{what}: 'data' has {len(data)} elements, shape {list(shape)} needs {count}"
            )
        return data
    # Walk level by level so a mismatch names the level instead of a generic count error.
    level: list[Any] = [data]
    for depth, dim in enumerate(shape):
        nxt: list[Any] = []
        for node in level:
            if not isinstance(node, list) or len(node) != dim:
                got = len(node) if isinstance(node, list) else "a scalar"
                raise InvalidInput(
                    f"{what}: nested 'data' does not match shape {list(shape)}: "
                    f"expected {dim} items at depth {depth}, got {got}"
                )
            nxt.extend(node)
        level = nxt
    for v in level:
        if isinstance(v, list):
            raise InvalidInput(f"{what}: nested 'data' is deeper than shape {list(shape)}")
    return level


def _numeric_probe(
    data: list[Any], shape: tuple[int, ...], what: str
) -> tuple[np.ndarray[Any, Any] | None, list[Any] | None]:
    """One ``np.asarray`` over ``data`` (flat or nested), its layout checked against ``shape``.

    NumPy walks the lists in C; only when its result does not fit ``shape`` (or NumPy refuses
    ragged data) does :func:`_flatten` walk them in Python, to name what is wrong.

    Returns:
        ``(probe, flat)``: the elements as a flat-or-shaped array, or None when there are
        none; ``flat`` is the flattened list when the slow path built it, else None.
    """
    count = element_count(shape)
    try:
        probe = np.asarray(data)
    except (ValueError, TypeError):  # ragged or mixed lists and scalars
        probe = None
    if probe is not None and probe.dtype != object:
        # A flat list is a 1-D array; nested lists must come out exactly as ``shape``.
        if probe.ndim == 1 and probe.size == count and (not data or not isinstance(data[0], list)):
            return (probe if count else None), None
        if probe.shape == shape and probe.ndim > 1:
            return (probe if count else None), None
    flat = _flatten(data, shape, what)  # raises with the exact layout problem
    if not flat:
        return None, flat
    try:
        return np.asarray(flat), flat
    except (ValueError, TypeError) as e:  # ragged or mixed data
        raise InvalidInput(f"{what}: 'data' is not a list of numbers ({e})") from None


def from_json(
    data: object, datatype: str, shape: tuple[int, ...], what: str
) -> np.ndarray[Any, Any]:
    """Convert a JSON ``data`` member to an array of ``shape``, checking every element's type.

    Args:
        data: a flat list (row-major) or nested lists matching ``shape``.
        datatype: a V2 datatype; integers must be JSON integers within the type's range,
            floats accept integers too, BOOL accepts true/false (and 0/1), BYTES strings.
            BF16 accepts numbers, read as float32 (past its range: refused) then rounded to
            nearest-even bfloat16 (finite numbers that round to infinity: refused); the
            result is the ``<u2`` bits, as :func:`from_binary` gives them.
        shape: the declared shape.
        what: names the tensor in error messages.
    """
    if not isinstance(data, list):
        if shape == () and not isinstance(data, dict):
            data = [data]
        else:
            raise InvalidInput(f"{what}: 'data' must be a list")
    if datatype == BYTES:
        strings = _flatten(data, shape, what)
        out = np.empty(len(strings), dtype=object)
        for i, v in enumerate(strings):
            if not isinstance(v, str):
                raise InvalidInput(f"{what}: BYTES data must be strings, got {type(v).__name__}")
            try:
                out[i] = v.encode()
            except UnicodeEncodeError as e:  # a lone surrogate, from a "\ud800" escape
                raise InvalidInput(
                    f"{what}: BYTES element {i} contains a lone surrogate "
                    f"(U+{ord(v[e.start]):04X}) at position {e.start}; it has no UTF-8 form"
                ) from None
        return out.reshape(shape)
    if datatype == BF16:
        f32 = _fixed_from_json(data, datatype, np.dtype("<f4"), shape, what)
        bits = float_to_bf16_bits(f32)
        if bool(np.any(np.isfinite(f32) & ((bits & 0x7FFF) == 0x7F80))):
            raise InvalidInput(f"{what}: BF16 data out of range")
        return bits
    return _fixed_from_json(data, datatype, DATATYPES[datatype], shape, what)


def _fixed_from_json(
    data: list[Any], datatype: str, dtype: np.dtype[Any], shape: tuple[int, ...], what: str
) -> np.ndarray[Any, Any]:
    """:func:`from_json` for a fixed-size ``dtype``; ``datatype`` names it in messages."""
    probe, flat = _numeric_probe(data, shape, what)
    if probe is None:
        return np.empty(shape, dtype=dtype)
    kind = probe.dtype.kind
    if datatype == "BOOL":
        ok = kind == "b" or (kind in "iu" and int(probe.min()) >= 0 and int(probe.max()) <= 1)
        if not ok:
            raise InvalidInput(f"{what}: BOOL data must be true/false (or 0/1)")
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        out_of_range = f"{what}: {datatype} data out of range [{info.min}, {info.max}]"
        if kind not in "biu":
            flat = flat if flat is not None else _flatten(data, shape, what)
        if kind not in "biu" and all(type(v) is int for v in flat or ()):
            # Integers past int64 (UINT64's upper half, or out of range) make an object
            # (or float) array; convert them one by one, exactly.
            try:
                return np.array(flat, dtype=dtype).reshape(shape)
            except OverflowError:
                raise InvalidInput(out_of_range) from None
        if kind not in "biu":
            raise InvalidInput(f"{what}: {datatype} data must be integers")
        if probe.size and (int(probe.min()) < info.min or int(probe.max()) > info.max):
            raise InvalidInput(out_of_range)
    elif kind not in "biuf":
        flat = flat if flat is not None else _flatten(data, shape, what)
        if kind != "O" or not all(type(v) in (int, float, bool) for v in flat or ()):
            raise InvalidInput(f"{what}: {datatype} data must be numbers")
        # Integers past int64 make an object array; for a float datatype they are just large
        # numbers (and those past the float range are refused below).
        try:
            probe = np.array(flat, dtype=np.float64)
        except OverflowError:
            raise InvalidInput(f"{what}: {datatype} data out of range") from None
    try:
        with np.errstate(over="raise", invalid="raise"):
            return probe.astype(dtype, copy=False).reshape(shape)
    except FloatingPointError:
        raise InvalidInput(f"{what}: {datatype} data out of range") from None


def to_json_data(arr: np.ndarray[Any, Any], datatype: str) -> list[Any]:
    """A flat row-major JSON list of ``arr``'s elements (BYTES as UTF-8 strings).

    BF16 elements are written as the numbers they stand for (see :func:`as_bf16_bits`).
    """
    if datatype == BF16:
        arr = bf16_bits_to_float32(as_bf16_bits(arr))
    if datatype == BYTES:
        return [
            v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v)
            for v in arr.reshape(-1)
        ]
    flat: list[Any] = arr.reshape(-1).tolist()
    return flat
