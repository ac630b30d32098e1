"""What the client's body compression costs and saves, by level (issue 20).

Run as ``python -m benchmarks.bench_compression [--smoke]``. The body is the demo's request:
20 spike trains of 50,000 fine points at 10% density, packed (125 KB) in one binary V2
request, compressed as the client does it (``gzip.compress`` / ``zlib.compress``), one
thread; the medians of repeated calls.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Sequence

import numpy as np

from benchmarks._common import markdown_table, median_time, parse_args, report

INTRO = """\
The client compresses request bodies at level 1 by default (`compression_level=` changes
it): packed bits are near random at the bit level, so the higher levels buy little size
for their time."""


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    shape = (1, 2, 5000) if args.smoke else (1, 20, 50000)
    bits = np.random.default_rng(0).random(shape) < 0.1
    body = np.packbits(bits, axis=-1).tobytes()
    rows = []
    for name, fn in (
        ("gzip", lambda lvl: gzip.compress(body, compresslevel=lvl)),
        ("deflate", lambda lvl: zlib.compress(body, lvl)),
    ):
        for level in (1, 6, 9):
            seconds = median_time(lambda f=fn, lv=level: f(lv), repeat=3 if args.smoke else 15)
            size = len(fn(level))
            rows.append([name, level, f"{seconds * 1e3:.2f}", size, f"{len(body) / size:.1f}"])
    table = markdown_table(["encoding", "level", "ms", "bytes", "ratio"], rows)
    text = f"{INTRO}\n\nBody: {len(body):,} bytes of packed bits.\n\n{table}"
    report(
        "compression", "Client body compression by level", text, smoke=args.smoke, devices=["cpu"]
    )


if __name__ == "__main__":
    main()
