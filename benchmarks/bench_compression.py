"""What the client's body compression costs and saves, by level (issue 20).

Run as ``python -m benchmarks.bench_compression [--smoke]``. The bodies: 20 rows of 50,000
fine points packed (125 KB), as spike trains at 5-50 Hz sampled at 10 kHz (0.05-0.5% of the
bits set) and as the demo's 10% density, compressed as the client does it
(``gzip.compress`` / ``zlib.compress``), one thread; the medians of repeated calls.
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
    N, B = (2, 5000) if args.smoke else (20, 50000)
    rng = np.random.default_rng(0)
    spikes = rng.random((N, B)) < np.linspace(5, 50, N)[:, None] / 10000
    bodies = {
        "spikes 5-50 Hz": np.packbits(spikes, axis=-1).tobytes(),
        "demo 10%": np.packbits(rng.random((N, B)) < 0.1, axis=-1).tobytes(),
    }
    rows = []
    for what, body in bodies.items():
        for name, fn in (
            ("gzip", lambda b, lvl: gzip.compress(b, compresslevel=lvl)),
            ("deflate", lambda b, lvl: zlib.compress(b, lvl)),
        ):
            for level in (1, 6, 9):
                seconds = median_time(
                    lambda f=fn, b=body, lv=level: f(b, lv), repeat=3 if args.smoke else 15
                )
                size = len(fn(body, level))
                rows.append(
                    [what, name, level, f"{seconds * 1e3:.2f}", size, f"{len(body) / size:.1f}"]
                )
    table = markdown_table(["body", "encoding", "level", "ms", "bytes", "ratio"], rows)
    size = len(bodies["demo 10%"])
    text = f"{INTRO}\n\nBodies: {size:,} bytes of packed bits each.\n\n{table}"
    report(
        "compression", "Client body compression by level", text, smoke=args.smoke, devices=["cpu"]
    )


if __name__ == "__main__":
    main()
