"""More models than memory, and the response cache (issue 33's targets).

1. **Residency.** A repository of ``--models`` operator models (CPU) whose resident bytes add
   up to 3x ``--device-memory-budget``; one server under the budget, one holding every model
   (the reference). A load generator in its own process sends Zipf-distributed traffic
   (s = 1.1 over the models, ranked in a random order) from 8 concurrent connections for
   ``--seconds`` (the issue asks for 5 minutes: ``--seconds 300``); then every answer is
   sent again to the reference server and compared byte for byte (the models do not batch,
   so each answer is computed alone on both). The budget server's peak memory (``VmHWM``)
   is compared with the budget plus its process's own footprint (a server of the same build
   with one tiny model), and the bytes it accounts (``bitserve_device_memory_bytes``) are
   sampled every 0.5 s. Then cold loads: a request for a model that is evicted, one at a
   time (p50 / p99), and two evicted models asked for together (the time until both are
   answered, against one cold request's median).
2. **Cache.** The demo model (``[response_cache] enable = true``, ``--cache-config``): a
   request answered from the cache against the same request computed (each new random
   request sent twice, one after the other, medians). Then the tiny model
   (``benchmarks/overhead/tiny.py``) with the cache on against off, where no request is a
   hit: perf_analyzer (``PERF_ANALYZER``, or ``../shared/tools/perf-analyzer.sh``) sends
   requests of 8 items from ``--input-data``, 5,000 distinct requests in a cycle, to a
   server whose cache holds a fifth of them (LRU: a cycle longer than the cache never hits);
   interleaved rounds, medians of requests per second and of the server's CPU per request;
   and the cache's own cost per missed request measured in process (key, lookup, store).
   Without perf_analyzer (CI's smoke run) a raw-socket client sends random requests.

    python -m benchmarks.bench_residency               # writes benchmarks/results/residency.md
    python -m benchmarks.bench_residency --seconds 300 # the issue's full length
    python -m benchmarks.bench_residency --smoke       # short, prints only
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks._common import markdown_table, quiet_host, report
from benchmarks.overhead import perf, tiny
from harness.repo_utils import bits_input, model_toml, tensor, write_model_folder

CLIENTS = 8
ZIPF_S = 1.1
N, B, A = 16, 8192, 1024  # functions, fine bits, coarse points of each model
ONE = ("--workers", "1")


# --- the repository ---------------------------------------------------------------------


def write_models(root: Path, count: int, half_width: float) -> list[str]:
    """``count`` boxcar models, each with its own coarse points (so their answers differ),
    ``max_batch_size = 1`` (each answer computed alone: the reference's bytes are its own)."""
    names = []
    for i in range(count):
        name = f"m{i:02d}"
        config = model_toml(
            max_batch_size=1,
            max_queue_size=1024,
            device="cpu",
            inputs=[bits_input(N, B)],
            operator={"file": "op.safetensors", "response": "boxcar", "half_width": half_width},
            outputs=[tensor("out", "FP32")],
        )
        rng = np.random.default_rng(i)
        c = np.sort(rng.uniform(0, B - 1, (N, A)), axis=1).astype(np.float32)
        write_model_folder(root / name, config, {"x": np.arange(B, dtype=np.float32), "c": c})
        names.append(name)
    return names


NAMES = {"demo": ("spikes", "resampled"), "tiny": (tiny.INPUT, tiny.OUTPUT)}
"""Input and output names of the models that are not ours (ours: ``bits``, ``out``)."""


def infer_bytes(model: str, packed: np.ndarray[Any, Any], rid: str) -> bytes:
    """One binary V2 request for ``model`` (HTTP/1.1, keep-alive)."""
    name, output = NAMES.get(model, ("bits", "out"))
    head = json.dumps(
        {
            "id": rid,
            "inputs": [{"name": name, "datatype": "UINT8", "shape": list(packed.shape),
                        "parameters": {"binary_data_size": packed.nbytes}}],
            "outputs": [{"name": output, "parameters": {"binary_data": True}}],
        }
    ).encode()  # fmt: skip
    body = head + packed.tobytes()
    return (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: b\r\nContent-Length: {len(body)}\r\n"
        f"Inference-Header-Content-Length: {len(head)}\r\n\r\n"
    ).encode() + body


class Conn:
    """One keep-alive HTTP/1.1 connection: a request's bytes in, ``(status, output bytes)``
    out (the body after its JSON header)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port, limit=1 << 20))

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = json_length = 0
        for line in head.split(b"\r\n"):
            key, _, value = line.partition(b":")
            if key.lower() == b"content-length":
                length = int(value)
            elif key.lower() == b"inference-header-content-length":
                json_length = int(value)
        body = await self.reader.readexactly(length)
        return status, body[json_length:] if status == 200 else body

    def close(self) -> None:
        self.writer.close()


# --- the load generator (its own process) -------------------------------------------------


async def zipf_load(port: int, names: list[str], seconds: float, seed: int) -> dict[str, Any]:
    """Zipf traffic from :data:`CLIENTS` connections: each request's model, seed, status,
    latency and the SHA-256 of its output bytes."""
    rng = np.random.default_rng(seed)
    ranked = list(rng.permutation(names))
    weights = 1.0 / np.arange(1, len(ranked) + 1) ** ZIPF_S
    p = weights / weights.sum()
    records: list[tuple[str, int, int, float, str]] = []
    deadline = time.perf_counter() + seconds

    async def client(k: int) -> None:
        r = np.random.default_rng(seed * 100 + k)
        conn = await Conn.open(port)
        try:
            while time.perf_counter() < deadline:
                model = ranked[int(r.choice(len(ranked), p=p))]
                s = int(r.integers(0, 2**31))
                packed = np.random.default_rng(s).integers(0, 256, (1, N, B // 8), np.uint8)
                t0 = time.perf_counter()
                status, body = await conn.send(infer_bytes(model, packed, f"{k}-{s}"))
                ms = (time.perf_counter() - t0) * 1e3
                digest = hashlib.sha256(body).hexdigest() if status == 200 else ""
                records.append((model, s, status, ms, digest))
        finally:
            conn.close()

    await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    return {"records": records, "ranked": ranked, "p": p.tolist()}


async def replay(port: int, records: list[list[Any]]) -> int:
    """Send every recorded request to the reference server; the number whose output bytes
    differ (or failed)."""
    todo = list(records)
    bad = 0

    async def client() -> None:
        nonlocal bad
        conn = await Conn.open(port)
        try:
            while todo:
                model, s, _, _, digest = todo.pop()
                packed = np.random.default_rng(s).integers(0, 256, (1, N, B // 8), np.uint8)
                status, body = await conn.send(infer_bytes(model, packed, "ref"))
                if status != 200 or hashlib.sha256(body).hexdigest() != digest:
                    bad += 1
        finally:
            conn.close()

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return bad


async def rate(port: int, model: str, seconds: float, items: int, seed: int) -> float:
    """Requests per second of random ``items``-item requests to ``model`` (tiny) from
    :data:`CLIENTS` connections."""
    count = 0
    deadline = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal count
        r = np.random.default_rng(seed * 1000 + k)
        conn = await Conn.open(port)
        try:
            while time.perf_counter() < deadline:
                packed = r.integers(0, 256, (items, 1, 1), np.uint8)
                status, _ = await conn.send(infer_bytes(model, packed, "r"))
                assert status == 200
                count += 1
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    return count / (time.perf_counter() - t0)


def in_child(task: str, **kw: Any) -> Any:
    """Run a load task (``zipf``, ``replay``, ``rate``) in a separate Python process."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"task": task, **kw}))
        subprocess.run([sys.executable, "-m", "benchmarks.bench_residency", "--child",
                        str(spec), str(out)], check=True, cwd=perf.ROOT)  # fmt: skip
        return json.loads(out.read_text())


def child_main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    task = spec.pop("task")
    fn = {"zipf": zipf_load, "replay": replay, "rate": rate}[task]
    Path(out_path).write_text(json.dumps(asyncio.run(fn(**spec))))  # type: ignore[operator]


# --- the server side ----------------------------------------------------------------------


def rss(pid: int, field: str = "VmRSS") -> int:
    """The resident memory of ``pid`` now (``VmRSS``) or at its peak (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def accounted(url: str) -> int:
    """The bytes the server says its resident models hold (every model, every device)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("bitserve_device_memory_bytes{")
        )
    )


def index(url: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = httpx.post(url + "/v2/repository/index", timeout=30).json()
    return rows


async def one_tiny(port: int) -> None:
    conn = await Conn.open(port)
    for k in range(20):
        await conn.send(infer_bytes("tiny", np.full((1, 1, 1), k, np.uint8), "f"))
    conn.close()


async def one(port: int, model: str, seed: int) -> float:
    conn = await Conn.open(port)
    packed = np.random.default_rng(seed).integers(0, 256, (1, N, B // 8), np.uint8)
    t0 = time.perf_counter()
    status, _ = await conn.send(infer_bytes(model, packed, "cold"))
    ms = (time.perf_counter() - t0) * 1e3
    conn.close()
    assert status == 200
    return ms


def cold_loads(
    url: str, port: int, pid: int, names: list[str], trials: int
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Cold requests one at a time, and pairs of cold requests together: each one's wall ms
    and the server's CPU ms over it (its process tree's user + system time)."""
    from harness.loadgen import tree_cpu_seconds

    rng = np.random.default_rng(5)
    singles, pairs = [], []
    for t in range(2 * trials):
        evicted = [r["name"] for r in index(url) if not r["resident"]]
        cpu0 = tree_cpu_seconds(pid)
        if t % 2 == 0:
            ms = asyncio.run(one(port, str(rng.choice(evicted)), t))
            singles.append((ms, (tree_cpu_seconds(pid) - cpu0) * 1e3))
        else:
            a, b = rng.choice(evicted, 2, replace=False)

            async def both(a: str = str(a), b: str = str(b), t: int = t) -> float:
                t0 = time.perf_counter()
                await asyncio.gather(one(port, a, t), one(port, b, t + 1))
                return (time.perf_counter() - t0) * 1e3

            ms = asyncio.run(both())
            pairs.append((ms, (tree_cpu_seconds(pid) - cpu0) * 1e3))
    return singles, pairs


def builds_in_process(root: Path, names: list[str], trials: int) -> tuple[float, float, float]:
    """Builds of the models alone (no server): one at a time, and two at once in two threads
    (ms, medians), and the CPU seconds of one build: whether two loads can overlap at all on
    this host, apart from anything the server does around them."""
    import threading

    from service.layout import model_versions
    from service.loading import VersionBuilder

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


def residency(args: argparse.Namespace, out: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-residency-"))
    names = write_models(root / "repo", args.models, args.half_width)
    tiny_root = tiny.write_repository(root / "tiny")
    servers = [
        ("reference", perf.bitserve(root / "repo", *ONE)),
        ("footprint", perf.bitserve(tiny_root, *ONE)),
    ]
    with perf.start(servers, timeout_s=600) as (ref, foot):
        model_bytes = accounted(ref.url)
        asyncio.run(one_tiny(foot.port))
        footprint = rss(foot.process.pid)
        ref_rss = rss(ref.process.pid)
    budget = model_bytes // 3
    flags = ("--device-memory-budget", str(budget), "--log-level", "warning")
    with perf.start([("budget", perf.bitserve(root / "repo", *ONE, *flags))], timeout_s=600) as (
        srv,
    ):
        resident_at_start = sum(1 for r in index(srv.url) if r["resident"])
        built_at_start = sum(
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines()
            if line.startswith("bitserve_model_loads_total{")
        )
        samples: list[int] = []
        rss_samples: list[int] = []
        done = False

        async def sample() -> None:
            async with httpx.AsyncClient(timeout=10) as client:
                while not done:
                    text = (await client.get(srv.url + "/metrics")).text
                    samples.append(int(sum(
                        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("bitserve_device_memory_bytes{"))))  # fmt: skip
                    rss_samples.append(rss(srv.process.pid))
                    await asyncio.sleep(0.5)

        async def sampled_load() -> dict[str, Any]:
            nonlocal done
            sampler = asyncio.create_task(sample())
            try:
                return await asyncio.to_thread(in_child, "zipf", port=srv.port, names=names,
                                               seconds=args.seconds, seed=1)  # fmt: skip
            finally:
                done = True
                await sampler

        load = asyncio.run(sampled_load())
        records = load["records"]
        peak = max(rss_samples)
        text = httpx.get(srv.url + "/metrics", timeout=10).text
        evictions = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("bitserve_model_evictions_total{")
        )
        waited = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("bitserve_requests_waited_for_load_total{")
        )
        cold, cold_pairs = cold_loads(srv.url, srv.port, srv.process.pid, names, args.cold_trials)
    with perf.start([("reference", perf.bitserve(root / "repo", *ONE))], timeout_s=600) as (ref,):
        mismatched = in_child("replay", port=ref.port, records=records)
    one_build, two_builds, build_cpu = builds_in_process(root / "repo", names, args.cold_trials)
    failed = sum(1 for r in records if r[2] != 200)
    statuses = sorted({r[2] for r in records if r[2] != 200})
    ms = [r[3] for r in records if r[2] == 200]
    singles, pairs = [ms for ms, _ in cold], [ms for ms, _ in cold_pairs]
    one_cold = statistics.median(singles)
    pair = statistics.median(pairs)
    p50, p99 = np.percentile(singles, [50, 99])
    cores_one = statistics.median(cpu / ms for ms, cpu in cold)
    cores_two = statistics.median(cpu / ms for ms, cpu in cold_pairs)
    cpu_ratio = statistics.median(cpu for _, cpu in cold_pairs) / statistics.median(
        cpu for _, cpu in cold
    )
    rows: list[list[object]] = [
        ["models; their resident bytes; budget", f"{len(names)}; {model_bytes / 2**20:.1f} MiB; "
         f"{budget / 2**20:.1f} MiB (1/3)", ""],
        ["requests (8 clients, Zipf s=1.1, " f"{args.seconds:g} s)", len(records), ""],
        ["failed requests", failed, f"target 0 {statuses or ''}"],
        ["answers differing from the server holding every model", mismatched, "target 0"],
        ["request latency p50 / p99 (ms)",
         f"{np.percentile(ms, 50):.1f} / {np.percentile(ms, 99):.1f}", ""],
        ["evictions; requests that waited for a load", f"{evictions:.0f}; {waited:.0f}", ""],
        ["resident at start; built at start (models)", f"{resident_at_start}; "
         f"{built_at_start:.0f}", f"of {len(names)}: the others listed, built on demand"],
        ["accounted resident bytes, max of samples (MiB)", f"{max(samples) / 2**20:.2f}",
         f"<= budget {budget / 2**20:.2f}"],
        ["RSS during the traffic, max of samples, less the footprint (MiB)",
         f"{(peak - footprint) / 2**20:.1f}",
         f"budget {budget / 2**20:.1f} + overhead {(peak - footprint - budget) / 2**20:.1f}"],
        ["RSS of the server holding every model, less the footprint (MiB)",
         f"{(ref_rss - footprint) / 2**20:.1f}", f"its models {model_bytes / 2**20:.1f}"],
        ["cold request p50 / p99 (ms)", f"{p50:.0f} / {p99:.0f}", f"{len(singles)} cold loads"],
        ["two cold models together / one cold (median)", f"{pair / one_cold:.2f}",
         "target <= 1.3"],
        ["server CPU: two cold / one cold; cores the server had, one / two",
         f"{cpu_ratio:.2f}; {cores_one:.2f} / {cores_two:.2f}",
         "of the host's 2: what two loads at once could use, they did not get"],
        ["builds alone, in process: two in two threads / one (median)",
         f"{two_builds / one_build:.2f}", f"one {one_build:.0f} ms ({build_cpu * 1e3:.0f} ms "
         f"of CPU), two {two_builds:.0f} ms"],
    ]  # fmt: skip
    out.append("## More models than memory\n")
    out.append(markdown_table(["", "measured", "note"], rows))
    out.append(
        f"\nThe footprint is the RSS of the same server build serving only the tiny model "
        f"({footprint / 2**20:.0f} MiB); the budget server's RSS was sampled every 0.5 s "
        "during the traffic. Beyond the footprint it holds its resident models plus the "
        "overhead: up to two loads' temporaries at once (a boxcar band is found in float64 "
        "before it is stored in float32) and the allocator's slack. p99 of the cold requests "
        f"is of {len(singles)} samples. Two cold loads run at once (two builds in two threads, "
        "no lock between them), but a load is CPU-bound: two take twice one's CPU, and their "
        "time together is that CPU over the cores the server gets. On a quiet 2-core host "
        "that is two; on a host shared with other work, Linux shares the CPU by session "
        "(autogroup), so a server with two busy threads gets no more than with one, and two "
        "loads take twice one's time (the cores row says how much the server had).\n"
    )


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


def cache_cost_us(requests: int = 20_000) -> float:
    """The response cache's own cost of one missed request, in process (microseconds): the
    key of a tiny-model request of :data:`PA_ITEMS` random items (as the data plane computes
    it), the lookup that finds nothing, and the store of its answer."""
    from types import SimpleNamespace

    from service.batch_queue import BatchInfo
    from service.config import load_config
    from service.protocol.types import InferRequest, RequestInput, RequestOutput
    from service.response_cache import ResponseCache, cache_key
    from service.signature import Bound, WireInput

    with tempfile.TemporaryDirectory() as tmp:
        folder = tiny.write_repository(Path(tmp)) / tiny.NAME
        cfg = load_config(folder / "config.toml", "tiny")
    handle = SimpleNamespace(name=tiny.NAME, version="1", cfg=cfg)
    rng = np.random.default_rng(0)
    todo = []
    for _ in range(requests):
        packed = rng.integers(0, 256, (PA_ITEMS, 1, 1), np.uint8)
        req = InferRequest(
            id="r",
            inputs=[RequestInput(tiny.INPUT, "UINT8", packed.shape, packed,
                                 {"binary_data_size": PA_ITEMS})],
            outputs=[RequestOutput(tiny.OUTPUT, True, {"binary_data": True})],
            parameters={},
        )  # fmt: skip
        todo.append((req, Bound((WireInput(packed, True, None),), (0,), PA_ITEMS)))
    answer, info = [np.zeros((PA_ITEMS, 1, 1), np.float32)], BatchInfo(PA_ITEMS, 1)
    runs = []
    for _ in range(5):
        cache = ResponseCache(64 << 20)
        t0 = time.perf_counter_ns()
        for req, bound in todo:
            key = cache_key(handle, req, bound)  # type: ignore[arg-type]
            if cache.get(key) is None:
                cache.put(key, (tiny.NAME, "1"), answer, info)
        runs.append((time.perf_counter_ns() - t0) / requests / 1e3)
    return statistics.median(runs)


def cache(args: argparse.Namespace, out: list[str]) -> None:
    from harness.server import perf_analyzer
    from service.demo import write_demo_repository

    root = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    write_demo_repository(root / "demo")
    cached = "\n[response_cache]\nenable = true\n"
    with (root / "demo" / "demo" / "1" / "config.toml").open("a") as f:
        f.write(cached)
    tiny_root = tiny.write_repository(root / "tiny")
    with (tiny_root / "tiny" / "config.toml").open("a") as f:
        f.write(cached)
    size = ("--cache-config", "local,size=64MiB", "--log-level", "warning")
    servers = [
        ("demo", perf.bitserve(root / "demo", *ONE, *size)),
    ]
    with perf.start(servers, timeout_s=600) as (demo,):

        async def pairs() -> tuple[list[float], list[float]]:
            miss: list[float] = []
            hit: list[float] = []
            conn = await Conn.open(demo.port)
            rng = np.random.default_rng(3)
            for k in range(args.cache_trials):
                packed = rng.random((1, 20, 50_000)) < 0.1
                raw = infer_bytes("demo", np.packbits(packed, axis=-1), f"c{k}")
                for into in (miss, hit):
                    t0 = time.perf_counter()
                    status, _ = await conn.send(raw)
                    into.append((time.perf_counter() - t0) * 1e3)
                    assert status == 200
            conn.close()
            return miss, hit

        miss, hit = asyncio.run(pairs())
        stats = httpx.get(demo.url + "/v2/models/demo/stats", timeout=10).json()
        cstats = stats["model_stats"][0]["inference_stats"]
    # Every request misses: perf_analyzer cycles through PA_DISTINCT distinct requests, and
    # the cache holds a fifth of them (least recently used out: a cycle longer than the
    # cache never hits). Without perf_analyzer (a smoke run), the raw-socket client's
    # random requests stand in.
    entry = 256 + 4 * PA_ITEMS
    small = ("--cache-config", f"local,size={entry * PA_DISTINCT // 5}", "--log-level", "warning")
    command = perf_analyzer()
    servers = [
        ("off", perf.bitserve(tiny_root, *ONE, "--log-level", "warning")),
        ("on", perf.bitserve(tiny_root, *ONE, *small)),
    ]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    with perf.start(servers, timeout_s=600) as running:
        for r in range(args.rounds):
            for srv in running if r % 2 == 0 else running[::-1]:
                if command is not None:  # each run its own requests: none seen before
                    data = pa_input_data(root / "pa.json", seed=2 * r + (srv.label == "on"))
                    rps, us = pa_rate(command, srv, data, int(args.round_seconds * 1000))
                else:
                    rps = in_child("rate", port=srv.port, model="tiny",
                                   seconds=args.round_seconds, items=PA_ITEMS, seed=r)  # fmt: skip
                    us = float("nan")
                rates[srv.label].append(rps)
                cpu[srv.label].append(us)
        hits = httpx.get(running[1].url + "/v2/models/tiny/stats", timeout=10).json()
        tiny_stats = hits["model_stats"][0]["inference_stats"]
        tiny_hits, tiny_misses = tiny_stats["cache_hit"]["count"], tiny_stats["cache_miss"]["count"]
    cost = cache_cost_us()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    cpu_off, cpu_on = statistics.median(cpu["off"]), statistics.median(cpu["on"])
    pairs_ratio = statistics.median(b / a for a, b in zip(rates["off"], rates["on"], strict=True))
    load = "perf_analyzer" if command is not None else "raw-socket client (no perf_analyzer)"
    rows = [
        ["demo: computed (miss), median ms", f"{statistics.median(miss):.2f}", ""],
        ["demo: answered from the cache (hit), median ms", f"{statistics.median(hit):.2f}", ""],
        ["demo: miss / hit", f"{statistics.median(miss) / statistics.median(hit):.1f}x",
         "target >= 5x"],
        ["demo: statistics cache_hit / cache_miss count",
         f"{cstats['cache_hit']['count']} / {cstats['cache_miss']['count']}", ""],
        ["tiny, no hits: cache off, requests/s (median of rounds)", f"{off:,.0f}",
         f"{len(rates['off'])} rounds of {args.round_seconds:g} s, {load}"],
        ["tiny, no hits: cache on, requests/s (median of rounds)", f"{on:,.0f}",
         f"hits {tiny_hits}, misses {tiny_misses}"],
        ["cache on / off (ratio of the medians)", f"{on / off:.3f}", "target >= 0.97"],
        ["cache on / off (median of the rounds' ratios, each pair adjacent)",
         f"{pairs_ratio:.3f}", ""],
        ["server CPU per request, off / on (us, medians)", f"{cpu_off:.0f} / {cpu_on:.0f}",
         "the process's user + system time over a round"],
        ["the cache's own cost per missed request, in process (us)", f"{cost:.1f}",
         f"key + lookup + store: {cost / cpu_off:.1%} of a request's CPU"
         if cpu_off == cpu_off else "key + lookup + store"],
        ["rounds off; on (requests/s)", "; ".join(
            ", ".join(f"{x:.0f}" for x in rates[k]) for k in ("off", "on")), ""],
    ]  # fmt: skip
    out.append("## Response cache\n")
    out.append(markdown_table(["", "measured", "note"], rows))
    out.append(
        "\nLatencies are one client's, sequential, over a keep-alive connection (a demo "
        "request is 125 KB packed). The throughput rows: perf_analyzer at concurrency 8, "
        f"requests of {PA_ITEMS} items from `--input-data` holding {PA_DISTINCT:,} distinct "
        "requests (new ones for every run), which it sends in a cycle; the cache holds a fifth "
        "of them, so with LRU eviction every request misses (the hits row says so). Rounds "
        "of off and on interleaved; the in-process cost is the median of 5 passes over "
        "20,000 requests.\n"
    )


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="short; print only, write nothing")
    p.add_argument("--seconds", type=float, default=60.0, help="Zipf traffic (issue: 300)")
    p.add_argument("--models", type=int, default=12)
    p.add_argument("--half-width", type=float, default=48.0)
    p.add_argument("--cold-trials", type=int, default=20)
    p.add_argument("--cache-trials", type=int, default=40)
    p.add_argument("--rounds", type=int, default=12, help="interleaved throughput rounds")
    p.add_argument("--round-seconds", type=float, default=2.0, help="perf_analyzer's window")
    p.add_argument("--part", choices=["all", "residency", "cache"], default="all")
    args = p.parse_args(argv)
    if args.smoke:
        args.seconds, args.models, args.half_width = 3.0, 6, 8.0
        args.cold_trials, args.cache_trials, args.rounds, args.round_seconds = 4, 4, 2, 1.0
    _, host = quiet_host(wait_s=0 if args.smoke else 60)
    out = [f"Host: {host}.\n"]
    if args.part in ("all", "residency"):
        residency(args, out)
    if args.part in ("all", "cache"):
        cache(args, out)
    report("residency", "More models than memory; response cache", "\n".join(out),
           smoke=args.smoke, devices=["cpu"])  # fmt: skip


if __name__ == "__main__":
    main()
