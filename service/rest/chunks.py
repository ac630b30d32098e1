"""The declared size of the chunk a chunked request body is in, so that a chunk larger than
the body limit is refused (413) when its size line arrives, not after its bytes have
trickled in for the body timeout.

httptools (llhttp) validates the chunk framing and says when a chunk's size line ends
(``on_chunk_header``), but not the size it read. The size is read here from the bytes of the
read in which that line ended: a chunk not complete at the end of a read runs to the end of
it, so its size line ends ``bytes of the chunk so far`` before the end of the read (the last
64 bytes received before it are kept, for a line split between reads).
"""

from __future__ import annotations

from service.errors import PayloadTooLarge

_TAIL = 64
"""Bytes of the previous read kept for a size line split between reads (a size past any
body limit has at most 16 hex digits; chunk extensions longer than this are not read)."""


def chunk_size_before(window: bytes, end: int) -> int | None:
    """The size declared by the chunk size line that ends (with its CRLF) at ``end`` in
    ``window``, or None when the line does not start within ``window`` or is not one.

    >>> chunk_size_before(b"\\r\\n1f;x=y\\r\\nabc", 11)
    31
    """
    if end < 3 or window[end - 2 : end] != b"\r\n":
        return None
    start = window.rfind(b"\n", 0, end - 2)
    if start < 0:
        return None
    digits = window[start + 1 : end - 2].split(b";", 1)[0].strip(b" \t")
    try:
        return int(digits, 16) if digits.isalnum() and digits.isascii() else None
    except ValueError:
        return None


class ChunkWatch:
    """One chunked request body's framing as httptools reports it, and the size of the chunk
    it is in (see the module docstring)."""

    __slots__ = ("fresh_header", "in_chunk", "open", "received", "tail")

    def __init__(self) -> None:
        self.open = False
        """Inside a chunk's data."""
        self.fresh_header = False
        """A chunk's size line ended in the current read."""
        self.in_chunk = 0
        """Bytes of the current chunk received."""
        self.received = 0
        """Body bytes received, the current chunk's included."""
        self.tail = b""

    def header(self) -> None:
        """A chunk size line ended (``on_chunk_header``)."""
        self.open = self.fresh_header = True
        self.in_chunk = 0

    def body(self, nbytes: int) -> None:
        """Body bytes received (``on_body``)."""
        self.in_chunk += nbytes
        self.received += nbytes

    def complete(self) -> None:
        """The chunk's data and its CRLF have come (``on_chunk_complete``)."""
        self.open = False

    def after_read(self, data: bytes) -> int | None:
        """After ``data`` was parsed: the declared size of the chunk being received when its
        size line ended in ``data`` and the chunk did not; else None."""
        size = None
        if self.open and self.fresh_header:
            end = len(data) - self.in_chunk  # where the size line ended in ``data``
            start = max(0, end - _TAIL)
            window = (self.tail if start == 0 else b"") + data[start:end]
            size = chunk_size_before(window, len(window))
        self.fresh_header = False
        self.tail = (self.tail + data[-_TAIL:])[-_TAIL:]
        return size

    def too_large(self, data: bytes, limit: int) -> PayloadTooLarge | None:
        """After ``data`` was parsed (:meth:`after_read`): the 413 of a chunk whose declared
        size would take the body past ``limit`` bytes, else None."""
        size = self.after_read(data)
        if size is not None and self.received - self.in_chunk + size > limit:
            return PayloadTooLarge(
                f"a chunk of {size} bytes would pass the request body limit of {limit} bytes "
                "(max_body_bytes)"
            )
        return None
