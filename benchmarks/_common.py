"""Shared benchmark plumbing: timing, the memory-copy floor, machine info, result tables.

Every ``benchmarks/bench_*.py`` accepts ``--smoke`` (tiny sizes, prints the table, writes
nothing) so CI can run each one quickly; without it the table goes to
``benchmarks/results/<name>.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the options every benchmark shares: ``--smoke`` and ``--device``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny sizes; print only, write nothing")
    p.add_argument(
        "--device",
        action="append",
        default=None,
        help="device(s) to measure (default: cpu, plus cuda when available)",
    )
    args = p.parse_args(argv)
    if args.device is None:
        args.device = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return args


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_time(
    fn: Callable[[], object],
    *,
    device: torch.device | str = "cpu",
    repeat: int = 15,
    warmup: int = 2,
    min_time: float = 0.0,
) -> float:
    """Median wall time of ``fn()`` in seconds, synchronising ``device`` around each call.

    Runs ``warmup`` untimed calls, then at least ``repeat`` timed ones (more while the total
    stays under ``min_time`` seconds).
    """
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    start_all = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start_all < min_time:
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * repeat:
            break
    return statistics.median(times)


def copy_bandwidth(device: torch.device | str = "cpu", nbytes: int = 256 << 20) -> float:
    """Measured memory copy bandwidth on ``device`` in bytes/s, counting bytes written.

    A ``copy_`` between two preallocated uint8 buffers of ``nbytes``: the floor any op that
    writes that many bytes has to respect.
    """
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), device=device, repeat=10)
    return nbytes / t


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, or platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(devices: Sequence[str] = ("cpu",)) -> str:
    """One line naming the date, CPU, core count, torch version and any CUDA device."""
    parts = [
        _dt.date.today().isoformat(),
        f"{cpu_name()} ({os.cpu_count()} cores)",
        f"torch {torch.__version__}",
    ]
    if any(torch.device(d).type == "cuda" for d in devices) and torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name()}")
    return ", ".join(parts)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table; floats are shown with 3 significant digits."""

    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def report(name: str, title: str, body: str, *, smoke: bool, devices: Sequence[str]) -> None:
    """Print ``body`` and, unless ``smoke``, write it to ``benchmarks/results/<name>.md``."""
    text = f"# {title}\n\nMeasured {machine_info(devices)}.\n\n{body.strip()}\n"
    print(text)
    if not smoke:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{name}.md").write_text(text)
        print(f"wrote {RESULTS / f'{name}.md'}")
