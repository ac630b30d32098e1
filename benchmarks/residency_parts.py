"""Parts of ``bench_residency`` that measure one thing each: builds alone in process, and
the response cache's load (perf_analyzer with input data that never hits) and its own cost
per missed request in process."""

from __future__ import annotations

import csv
import io
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.overhead import perf, tiny
from benchmarks.residency_load import CLIENTS


def builds_in_process(root: Path, names: list[str], trials: int) -> tuple[float, float, float]:
    """Builds of the models alone (no server): one at a time, and two at once in two threads
    (ms, medians), and the CPU seconds of one build: whether two loads can overlap at all on
    this host, apart from anything the server does around them."""
    import threading

    from service.models.layout import model_versions
    from service.residency.loading import VersionBuilder

    builder = VersionBuilder("cpu", 1 << 40, 1 << 40, True)

    def build(name: str) -> None:
        versions = model_versions(root, name)
        builder.measured(lambda: builder.build_all(name, versions, None))

    build(names[0])
    singles, pairs, cpu = [], [], []
    for t in range(trials):
        a, b, c = (names[(3 * t + i) % len(names)] for i in range(3))
        c0, t0 = time.process_time(), time.perf_counter()
        build(a)
        singles.append((time.perf_counter() - t0) * 1e3)
        cpu.append(time.process_time() - c0)
        threads = [threading.Thread(target=build, args=(n,)) for n in (b, c)]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        pairs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(singles), statistics.median(pairs), statistics.median(cpu)


PA_ITEMS = 8
"""Items of each throughput request (perf_analyzer's ``-b``)."""
PA_DISTINCT = 5000
"""Distinct requests in perf_analyzer's input data (it cycles through them)."""


def pa_input_data(path: Path, seed: int) -> Path:
    """perf_analyzer's ``--input-data``: :data:`PA_DISTINCT` x :data:`PA_ITEMS` steps of one
    random byte each; perf_analyzer makes each request of ``-b`` consecutive steps, so it
    sends :data:`PA_DISTINCT` distinct requests, in a cycle."""
    rng = np.random.default_rng(seed)
    steps = rng.integers(0, 256, PA_DISTINCT * PA_ITEMS)
    data = [{tiny.INPUT: {"content": [int(b)], "shape": [1, 1]}} for b in steps]
    path.write_text(json.dumps({"data": data}))
    return path


def pa_rate(
    command: list[str], server: perf.Running, data: Path, interval_ms: int
) -> tuple[float, float]:
    """One perf_analyzer run at :data:`CLIENTS` concurrent requests of :data:`PA_ITEMS`
    items from ``data``: requests per second, and the server's CPU microseconds per request
    (its process tree's user + system time over the run, divided by the requests served)."""
    from harness.loadgen import tree_cpu_seconds

    with tempfile.TemporaryDirectory() as tmp:
        csv_path = Path(tmp) / "pa.csv"
        args = [
            *command, "-m", "tiny", "-u", f"127.0.0.1:{server.port}", "-i", "http",
            "-b", str(PA_ITEMS), "--concurrency-range", str(CLIENTS),
            "--input-data", str(data), "--measurement-interval", str(interval_ms),
            "--stability-percentage", "1000", "--max-trials", "3", "-f", str(csv_path),
        ]  # fmt: skip
        cpu0, t0 = tree_cpu_seconds(server.process.pid), time.perf_counter()
        done = subprocess.run(args, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        cpu = tree_cpu_seconds(server.process.pid) - cpu0
        if not csv_path.exists():
            raise RuntimeError(f"perf_analyzer failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        row = next(csv.DictReader(io.StringIO(csv_path.read_text())))
    rps = float(row["Inferences/Second"]) / PA_ITEMS
    return rps, cpu / (rps * wall) * 1e6


def cache_cost_us(requests: int = 20_000) -> tuple[float, float]:
    """The response cache's own cost of one missed request, in process (microseconds), for
    a tiny-model request of :data:`PA_ITEMS` random items (its key computed as the data
    plane does for perf_analyzer's requests: all decoded from one kept header, so of one
    ``RequestForm``): in a full cache, the key, the lookup that finds nothing and the
    admission that refuses it (a request seen once); in a cache with room, those and the
    store of its answer (a view of its batch's output)."""
    from types import SimpleNamespace

    from service.batching.queue import BatchInfo
    from service.models.config import load_config
    from service.models.response_cache import ResponseCache, cache_key
    from service.models.signature import Bound, Signature, WireInput
    from service.protocol.types import InferRequest, RequestForm, RequestInput, RequestOutput

    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny.write_repository(Path(tmp)) / tiny.NAME
        cfg = load_config(folder / "config.toml", "tiny")
    signature = Signature(tiny.NAME, cfg, [[1, 1]])
    handle = SimpleNamespace(name=tiny.NAME, version="1", cfg=cfg, signature=signature)
    rng = np.random.default_rng(0)
    form = RequestForm()
    in_params = {"binary_data_size": PA_ITEMS}
    outputs = [RequestOutput(tiny.OUTPUT, True, {"binary_data": True})]
    todo = []
    for _ in range(requests):
        packed = rng.integers(0, 256, (PA_ITEMS, 1, 1), np.uint8)
        req = InferRequest(
            id=None,
            inputs=[RequestInput(tiny.INPUT, "UINT8", packed.shape, packed, in_params)],
            outputs=outputs,
            parameters={},
            form=form,
        )
        todo.append((req, Bound((WireInput(packed, True, None),), (0,), PA_ITEMS)))
    batch = np.zeros((8 * PA_ITEMS, 1, 1), np.float32)
    answers = [[batch[i * PA_ITEMS : (i + 1) * PA_ITEMS]] for i in range(8)]
    info = BatchInfo(8 * PA_ITEMS, 8)
    version = (tiny.NAME, "1")
    full_runs, room_runs = [], []
    for _ in range(5):
        for runs, size in ((full_runs, (256 + 4 * PA_ITEMS) * PA_DISTINCT // 5),
                           (room_runs, 64 << 20)):  # fmt: skip
            cache = ResponseCache(size)
            if runs is full_runs:  # filled with other answers first
                for i in range(PA_DISTINCT):
                    cache.put(i.to_bytes(16, "little"), version, answers[0], info)
            t0 = time.perf_counter_ns()
            for i, (req, bound) in enumerate(todo):
                key = cache_key(handle, req, bound)
                if cache.get(key) is None and cache.admit(key):
                    cache.put(key, version, answers[i % 8], info)
            runs.append((time.perf_counter_ns() - t0) / requests / 1e3)
    return statistics.median(full_runs), statistics.median(room_runs)
