"""``Content-Encoding`` of request bodies and ``Accept-Encoding`` negotiation for responses.

Decompression is bounded: the output may not exceed ``limit`` bytes, checked while inflating,
so a small gzip bomb is refused with a 413 and never expands in memory.

Response compression is a policy (:func:`worth_compressing`): most HTTP clients (httpx,
requests) send ``Accept-Encoding: gzip, deflate`` by default, yet binary float tensors barely
shrink (about 0.9 of their size at best), so compressing them costs server CPU and latency for
nothing. ``auto`` compresses JSON bodies, and binary bodies only when a trial on a prefix
shrinks well; level 1 because the higher levels cost several times the CPU for a few percent.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Literal

from service.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType

SUPPORTED = ("gzip", "deflate")
_CHUNK = 1 << 20


def _is_zlib_header(data: bytes | bytearray | memoryview) -> bool:
    # RFC 1950: CM = 8 (deflate) and the 16-bit header is a multiple of 31.
    if len(data) < 2:
        return False
    b0, b1 = data[0], data[1]
    return (b0 & 0x0F) == 8 and ((b0 << 8) | b1) % 31 == 0


def decompress(
    body: bytes | bytearray,
    content_encoding: str | None,
    *,
    limit: int,
    reserve: Callable[[int], None] | None = None,
) -> bytes | bytearray:
    """Undo ``Content-Encoding`` (``gzip``, ``deflate`` or ``identity``), at most ``limit`` bytes.

    ``deflate`` accepts the zlib format (RFC 1950, what HTTP means and what tritonclient sends)
    and raw deflate (RFC 1951, what some clients send). Concatenated gzip members are joined.

    Args:
        body: the body as received.
        content_encoding: its ``Content-Encoding`` header (None: identity).
        limit: the most bytes the decompressed body may have.
        reserve: called (in the calling thread) with the output's size after each step of at
            most 1 MiB; raising stops the decompression (the server's in-flight byte budget
            counts the inflated copy this way, at most one step late).

    Raises:
        UnsupportedMediaType: another encoding, or several stacked encodings.
        PayloadTooLarge: the decompressed body would exceed ``limit`` bytes.
        InvalidInput: the compressed data is corrupt or truncated.
    """
    enc = (content_encoding or "identity").strip().lower()
    if enc in ("", "identity"):
        return body
    if enc not in ("gzip", "x-gzip", "deflate"):
        raise UnsupportedMediaType(
            f"unsupported Content-Encoding {content_encoding!r} (supported: gzip, deflate)"
        )
    if enc == "deflate":
        wbits = zlib.MAX_WBITS if _is_zlib_header(body) else -zlib.MAX_WBITS
    else:
        wbits = 16 + zlib.MAX_WBITS
    out = bytearray()
    data: bytes | bytearray | memoryview = body
    try:
        while True:
            d = zlib.decompressobj(wbits)
            while True:
                # max_length bounds each step, so memory never exceeds limit + 1 bytes.
                chunk = d.decompress(data, min(_CHUNK, limit + 1 - len(out)))
                out += chunk
                if reserve is not None:
                    reserve(len(out))
                if len(out) > limit:
                    raise PayloadTooLarge(
                        f"decompressed request body exceeds the limit of {limit} bytes"
                    )
                data = d.unconsumed_tail
                if d.eof or (not chunk and not data):
                    break
            if not d.eof:
                raise InvalidInput(f"{enc} request body is truncated")
            data = d.unused_data
            # Another gzip member may follow (RFC 1952 allows concatenation).
            if not data or enc == "deflate":
                if data:
                    raise InvalidInput(f"{len(data)} trailing bytes after the deflate stream")
                break
    except zlib.error as e:
        raise InvalidInput(f"corrupt {enc} request body: {e}") from None
    return out


def choose_encoding(accept_encoding: str | None) -> str | None:
    """Pick ``gzip`` or ``deflate`` from an ``Accept-Encoding`` header, or None for identity.

    Honours q-values (``gzip;q=0`` refuses gzip); with equal weights gzip wins.
    """
    if not accept_encoding:
        return None
    best: tuple[float, int, str] | None = None
    for part in accept_encoding.split(","):
        token, _, params = part.strip().partition(";")
        name = token.strip().lower()
        q = 1.0
        for p in params.split(";"):
            k, _, v = p.strip().partition("=")
            if k.strip().lower() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        if name == "*":
            name = "gzip"
        if name not in SUPPORTED or q <= 0:
            continue
        rank = (q, 1 if name == "gzip" else 0, name)
        if best is None or rank > best:
            best = rank
    return best[2] if best else None


LEVEL = 1
"""zlib level of compressed responses: the fastest; level 6 costs ~3x the CPU for ~5% less."""
MIN_BYTES = 1024
"""Bodies shorter than this are never compressed: the headers and the CPU outweigh the gain."""
TRIAL_BYTES = 16 << 10
"""How much of a binary payload the ``auto`` policy compresses on trial."""
TRIAL_RATIO = 0.75
"""``auto`` compresses a binary body only when its trial prefix shrinks below this ratio: float
tensors shrink to about 0.85-0.93 (the demo output: 0.87), which saves little on the wire for
the CPU it costs; sparse or small-integer outputs shrink far more."""

CompressionMode = Literal["auto", "always", "never"]


def compress(data: bytes | bytearray | memoryview, encoding: str, level: int = LEVEL) -> bytes:
    """Compress a response body with ``gzip`` or ``deflate`` (zlib format)."""
    if encoding == "gzip":
        c = zlib.compressobj(level, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    elif encoding == "deflate":
        c = zlib.compressobj(level, zlib.DEFLATED, zlib.MAX_WBITS)
    else:  # pragma: no cover - choose_encoding only returns the two above
        raise ValueError(encoding)
    return c.compress(data) + c.flush()


def worth_compressing(
    body: bytes | bytearray | memoryview, binary_from: int | None, mode: CompressionMode
) -> bool:
    """Whether a response body should be compressed (the client already accepts an encoding).

    Args:
        body: the whole response body.
        binary_from: the offset where binary tensor data starts (the JSON header's length),
            or None for a JSON-only body.
        mode: ``never``, ``always`` (every body of at least :data:`MIN_BYTES`), or ``auto``:
            JSON bodies of at least :data:`MIN_BYTES`, and binary bodies whose first
            :data:`TRIAL_BYTES` of tensor data compress below :data:`TRIAL_RATIO`.
    """
    if mode == "never" or len(body) < MIN_BYTES:
        return False
    if mode == "always" or binary_from is None:
        return True
    sample = memoryview(body)[binary_from : binary_from + TRIAL_BYTES]
    if len(sample) < MIN_BYTES:  # almost all JSON header: that compresses
        return True
    c = zlib.compressobj(LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
    packed = len(c.compress(sample)) + len(c.flush())
    return packed < TRIAL_RATIO * len(sample)
