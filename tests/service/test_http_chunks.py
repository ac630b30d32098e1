"""``service.rest.chunks``: the declared size of the chunk a body is in, read from the bytes
as httptools parses them, against the sizes the test wrote (random chunks, extensions and
reads)."""

from __future__ import annotations

import itertools

import httptools
from hypothesis import given, settings
from hypothesis import strategies as st

from service.rest.chunks import ChunkWatch, chunk_size_before


class Recorder:
    """httptools' callbacks, driving a :class:`ChunkWatch` as the HTTP protocol does."""

    def __init__(self) -> None:
        self.watch = ChunkWatch()

    def on_chunk_header(self) -> None:
        self.watch.header()

    def on_chunk_complete(self) -> None:
        self.watch.complete()

    def on_body(self, body: bytes) -> None:
        self.watch.body(len(body))


chunks = st.lists(
    st.tuples(
        st.integers(1, 300),  # its size
        st.sampled_from(["", ";a=b", ";ext", ";n=" + "x" * 30]),  # its extension
        st.booleans(),  # its size in upper-case hex
    ),
    min_size=1,
    max_size=6,
)


def expected_size(chunks: list[tuple[int, int, int]], a: int, b: int) -> int | None:
    """The plain model: after the read of ``stream[a:b]``, the size of the chunk whose size
    line ended in that read and which is not complete, when that line began within the 64
    bytes kept before it (``chunks``: each one's line start, data start and size)."""
    for line, data, size in chunks:
        if a < data <= b <= data + size:  # its LF read now, its data not all (or just all)
            lo = data - 64 if data - a >= 64 else a - 64
            return size if line - 1 >= max(lo, 0) else None
    return None  # (a read ending inside the CRLF after the data: the data are all in)


@settings(max_examples=300, deadline=None)
@given(chunks=chunks, cuts=st.lists(st.integers(0, 10_000), max_size=10))
def test_each_reported_size_is_the_size_written(
    chunks: list[tuple[int, str, bool]], cuts: list[int]
) -> None:
    stream = b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
    layout = []  # (line start, data start, size) of each chunk, the last (empty) one too
    for size, ext, upper in [*chunks, (0, "", False)]:
        line = len(stream)
        stream += f"{size:X}{ext}\r\n".encode() if upper else f"{size:x}{ext}\r\n".encode()
        layout.append((line, len(stream), size))
        stream += b"z" * size + b"\r\n"
    recorder = Recorder()
    parser = httptools.HttpRequestParser(recorder)
    points = sorted({c % len(stream) for c in cuts} | {0, len(stream)})
    for a, b in itertools.pairwise(points):
        if b > a:
            parser.feed_data(stream[a:b])
            assert recorder.watch.after_read(stream[a:b]) == expected_size(layout, a, b)


def test_a_line_that_is_not_a_chunk_size_reads_as_none() -> None:
    assert chunk_size_before(b"\r\nzz\r\n", 6) is None
    assert chunk_size_before(b"1f\r\n", 4) is None  # no line start in the window
    assert chunk_size_before(b"\n1_0\r\n", 6) is None  # int() would take it; HTTP does not
    assert chunk_size_before(b"\nffffffffffffffff\r\n", 19) == 2**64 - 1
