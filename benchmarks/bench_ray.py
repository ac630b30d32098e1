"""``bitserve score`` on Ray Data against bitserve's own ``infer_many``, same model, same rows.

The chemist's workload: 2048-bit fingerprints as packed bytes in Parquet (256 B a row, an id
and a weight beside them), scored by an MLP (2048 -> 256 -> 1) exported with torch.export,
``max_batch_size`` 1024. Measured:

- **baseline**: a real ``bitserve serve`` (one worker) and ``Client.infer_many`` over the
  same rows as one in-memory uint8 array (4 requests in flight, batches of 1024);
- **1 node**: ``bitserve score INPUT OUTPUT`` as a process, on the Ray it starts (this
  machine's CPUs), reading the Parquet file and writing the output folder;
- **2 nodes**: the same command joining a ``ray.cluster_utils.Cluster`` of two simulated
  nodes of 1 CPU each (the same 2 logical CPUs as 1 node: on one 2-core machine this shows
  the cost of spreading the work, not a gain);
- the scorer alone (``BatchScorer`` on one thread, batches of 1024, no Ray): the per-row
  compute cost the scale-out model below starts from;
- each scoring actor's peak RSS (``VmHWM``), against the model's device buffers + 500 MiB.

Rows/s of a job is the rows over the time ``bitserve score`` reports (from reading the inputs'
metadata to the last output file, actors' start included, Ray's own start not).

    python -m benchmarks.bench_ray            # 1M rows; writes benchmarks/results/ray.md
    python -m benchmarks.bench_ray --smoke    # 4096 rows, baseline and 1 node; prints only
    python -m benchmarks.bench_ray --scorer-only --device cuda   # the scorer alone on a GPU
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on 127.0.0.1 only
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np

from benchmarks._common import markdown_table, parse_args, report
from harness.fingerprints import MODEL, PACKED, write_fingerprint_repository
from harness.server import bitserve_command, start_server

MAX_BATCH = 1024
CHUNK = 131072


def write_library(path: Path, rows: int) -> np.ndarray:
    """A Parquet file of ``rows`` molecules (id, fp: 256 random bytes, weight), row groups of
    128k rows; returns the packed fingerprints (rows, 256)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (rows, PACKED), dtype=np.uint8)
    with pq.ParquetWriter(path, pa.schema([("id", pa.string()), ("fp", pa.binary()),
                                            ("weight", pa.float64())])) as w:  # fmt: skip
        for lo in range(0, rows, CHUNK):
            part = packed[lo : lo + CHUNK]
            fp = pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(PACKED), len(part), [None, pa.py_buffer(part.tobytes())]
            ).cast(pa.binary())
            ids = pa.array([f"mol-{i}" for i in range(lo, lo + len(part))])
            weight = pa.array(np.arange(lo, lo + len(part), dtype=np.float64))
            w.write_table(pa.table({"id": ids, "fp": fp, "weight": weight}))
    return packed


def baseline(repo: Path, packed: np.ndarray) -> float:
    """Rows/s of ``infer_many`` against a real server (one worker)."""
    from bitserve_client import Client

    with start_server(repo) as server, Client(server.url) as client:
        client.infer_many(MODEL, packed[:4096], concurrency=4, progress=False)  # warm
        t0 = time.perf_counter()
        res = client.infer_many(MODEL, packed, concurrency=4, progress=False)
        seconds = time.perf_counter() - t0
    assert res.rows == len(packed)
    return len(packed) / seconds


class ActorMemory:
    """Polls the peak RSS (``VmHWM``) of every process whose command line names the scorer."""

    def __init__(self) -> None:
        self.peaks: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> ActorMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.25):
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                    if b"BatchScorer" not in cmd:
                        continue
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                m = re.search(r"VmHWM:\s+(\d+) kB", status)
                if m:
                    self.peaks[int(pid)] = max(self.peaks.get(int(pid), 0), int(m.group(1)) << 10)


def run_score(repo: Path, src: Path, out: Path, *args: str) -> tuple[float, float, dict[int, int]]:
    """``bitserve score`` as a process: (job rows/s as it reports it, wall seconds including
    Ray's start, each actor's peak RSS)."""
    cmd = [*bitserve_command(), "score", "--model-repository", str(repo), "--model", MODEL,
           *args, str(src), str(out)]  # fmt: skip
    env = {**os.environ, "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}
    with ActorMemory() as mem:
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"bitserve score failed:\n{done.stderr[-3000:]}")
    m = re.search(r"\(([\d,]+) rows/s\)", done.stdout)
    assert m, done.stdout
    return float(m.group(1).replace(",", "")), wall, mem.peaks


def compute_only(repo: Path, packed: np.ndarray, device: str = "cpu") -> tuple[float, int]:
    """Rows/s of the scorer alone on one thread (no Ray, no I/O), and its device bytes."""
    from service.ray.scorer import BatchScorer

    scorer = BatchScorer(repo, MODEL, device=device, torch_threads=1)
    batch = {"fp": packed[:MAX_BATCH]}
    scorer(batch)
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 3.0:
        scorer(batch)
        n += MAX_BATCH
    return n / (time.perf_counter() - t0), scorer.pipeline.device_memory_bytes


_STEPS = """
import json, re, sys
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10
out = [["python", rss()]]
import numpy, torch, pyarrow, ray.data
out.append(["+ numpy, torch, pyarrow, ray.data", rss()])
import gpu_ops, service.model_files
out.append(["+ gpu_ops, service (gpu_ops imports Triton where installed)", rss()])
from service.ray.scorer import BatchScorer
s = BatchScorer(sys.argv[1], sys.argv[2], device="cpu", torch_threads=1)
out.append(["+ the model loaded (torch.export's loader) and dry-run", rss()])
p = numpy.random.default_rng(0).integers(0, 256, (1024, 256), dtype=numpy.uint8)
for _ in range(3):
    s({"fp": p})
out.append(["+ scoring batches of 1024", rss()])
print(json.dumps(out))
"""


def rss_steps(repo: Path) -> list[list[Any]]:
    """Where an actor's memory goes: RSS after each import and step, in a fresh process."""
    import json

    done = subprocess.run([sys.executable, "-c", _STEPS, str(repo), MODEL], capture_output=True,
                          text=True, check=True)  # fmt: skip
    steps: list[list[Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return steps


def two_nodes(repo: Path, src: Path, out: Path) -> tuple[float, float, dict[int, int]]:
    """``bitserve score --address`` on a Cluster of two 1-CPU nodes."""
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": 300 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        return run_score(repo, src, out, "--address", cluster.address)
    finally:
        ray.shutdown()
        cluster.shutdown()


def scorer_only(device: str) -> None:
    """``--scorer-only``: the scorer's rows/s on ``device`` (GPU hosts: benchmarks/gpu_check.sh),
    batches of 1024 fingerprints, no Ray and no I/O; prints one line."""
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        repo = write_fingerprint_repository(Path(tmp), max_batch_size=MAX_BATCH)
        packed = np.random.default_rng(0).integers(0, 256, (MAX_BATCH, PACKED), dtype=np.uint8)
        rate, nbytes = compute_only(repo, packed, device)
    print(f"BatchScorer on {device}: {rate:,.0f} rows/s (batches of {MAX_BATCH}; "
          f"{nbytes / 2**20:.1f} MiB on the device)")  # fmt: skip


def main() -> None:
    argv = sys.argv[1:]
    if "--scorer-only" in argv:
        argv.remove("--scorer-only")
        for device in parse_args(__doc__ or "", argv).device:
            scorer_only(device)
        return
    args = parse_args(__doc__ or "", argv)
    rows = 4096 if args.smoke else 1_000_000
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        root = Path(tmp)
        repo = write_fingerprint_repository(root / "models", max_batch_size=MAX_BATCH)
        src = root / "library.parquet"
        packed = write_library(src, rows)
        compute, device_bytes = compute_only(repo, packed)
        steps = rss_steps(repo)
        base = baseline(repo, packed)
        one, one_wall, one_mem = run_score(repo, src, root / "out1")
        results: list[tuple[str, float, float, dict[int, int]]] = [
            ("1 node (embedded Ray, 2 CPUs)", one, one_wall, one_mem)
        ]
        if not args.smoke:
            two, two_wall, two_mem = two_nodes(repo, src, root / "out2")
            results.append(("2 simulated nodes (1 CPU each)", two, two_wall, two_mem))
    body = table(rows, base, compute, device_bytes, results, steps)
    report("ray", "bitserve score on Ray Data", body, smoke=args.smoke, devices=["cpu"])


def table(
    rows: int,
    base: float,
    compute: float,
    device_bytes: int,
    results: list[tuple[str, float, float, dict[int, int]]],
    steps: list[list[Any]],
) -> str:
    limit = device_bytes + (500 << 20)
    lines = [
        markdown_table(
            ["path", "rows/s", "vs infer_many", "wall s (incl. Ray start)", "actor peak RSS MiB"],
            [
                [f"infer_many against bitserve serve ({rows:,} rows)", base, 1.0, rows / base, "-"],
                *[
                    [
                        name,
                        rate,
                        rate / base,
                        wall,
                        ", ".join(f"{v / 2**20:.0f}" for v in mem.values()) or "-",
                    ]
                    for name, rate, wall, mem in results
                ],
                ["BatchScorer alone, 1 thread (no Ray, no I/O)", compute, compute / base, "-", "-"],
            ],
        ),
        "",
    ]
    targets: list[list[Any]] = []
    one = results[0][1]
    targets.append(["bitserve score, 1 node vs infer_many", ">= 0.8x", f"{one / base:.2f}x",
                     "yes" if one >= 0.8 * base else "NO"])  # fmt: skip
    if len(results) > 1:
        two = results[1][1]
        targets.append(["2 simulated nodes vs 1 node", ">= 0.8x", f"{two / one:.2f}x",
                         "yes" if two >= 0.8 * one else "NO"])  # fmt: skip
    peaks = [v for _, _, _, mem in results for v in mem.values()]
    if peaks:
        worst = max(peaks)
        targets.append([
            "peak RSS per actor", f"<= buffers + 500 MiB = {limit / 2**20:.0f} MiB",
            f"{worst / 2**20:.0f} MiB", "yes" if worst <= limit else "NO",
        ])  # fmt: skip
    lines.append(markdown_table(["target", "wanted", "measured", "met"], targets))
    lines.append("")
    lines.append(
        "Where a scoring actor's memory goes (RSS of a fresh process after each step, "
        "without Ray's worker runtime):\n"
    )
    lines.append(
        markdown_table(
            ["step", "RSS MiB", "added MiB"],
            [
                [name, f"{v / 2**20:.0f}", f"{(v - steps[i - 1][1]) / 2**20:+.0f}" if i else "-"]
                for i, (name, v) in enumerate(steps)
            ],
        )
    )
    lines.append("")
    lines.append(
        f"Per-row compute on one CPU thread: {1e6 / compute:.1f} µs ({compute:,.0f} rows/s); "
        f"the model's device buffers: {device_bytes / 2**20:.1f} MiB."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
