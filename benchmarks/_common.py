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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class CpuTimes:
    """The machine's CPU time so far, all cores together, in clock ticks (``/proc/stat``)."""

    busy: int
    """user, nice, system, irq and softirq."""
    steal: int
    """Time the hypervisor gave this VM's CPUs to another guest."""
    total: int

    @classmethod
    def parse(cls, stat: str) -> CpuTimes:
        """From the text of ``/proc/stat`` (its ``cpu`` line)."""
        fields = [int(x) for x in stat.splitlines()[0].split()[1:]]
        fields += [0] * (8 - len(fields))
        user, nice, system, idle, iowait, irq, softirq, steal = fields[:8]
        busy = user + nice + system + irq + softirq
        return cls(busy, steal, busy + idle + iowait + steal)

    @classmethod
    def now(cls) -> CpuTimes | None:
        """The times now, or None where there is no ``/proc/stat``."""
        try:
            return cls.parse(Path("/proc/stat").read_text())
        except (OSError, ValueError, IndexError):
            return None

    def stolen_since(self, before: CpuTimes) -> float:
        """The share of the CPU time from ``before`` to this one that was stolen."""
        total = self.total - before.total
        return (self.steal - before.steal) / total if total > 0 else 0.0


def quiet_host(
    *,
    max_load: float = 0.5,
    wait_s: float = 180.0,
    poll_s: float = 5.0,
    load: Callable[[], float] = lambda: os.getloadavg()[0],
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[bool, str]:
    """Wait up to ``wait_s`` for the 1-minute load average to fall to ``max_load``.

    Other work on a small machine weighs on the servers a benchmark compares unevenly (a
    server whose threads are preempted more often loses more than one that is not), so a
    ratio taken on a busy host is not the one a user would see; a run that began busy says
    so in its results. Returns whether the host was quiet and a sentence saying how it was.
    """
    waited = 0.0
    now = load()
    while now > max_load and waited < wait_s:
        sleep(poll_s)
        waited += poll_s
        now = load()
    after = f" after {waited:.0f} s of waiting" if waited else ""
    if now <= max_load:
        return True, f"load average {now:.2f} when the run began{after} (quiet: at most {max_load})"
    return False, (
        f"BUSY HOST: load average {now:.2f} when the run began{after} (wanted at most "
        f"{max_load}): other work shared the cores, and the ratios below are not the quiet "
        "host's"
    )
