"""Serving overhead: bitserve vs a hand-written FastAPI V2 endpoint and a raw ASGI floor.

On a GPU host the kernels take microseconds, so what a request costs is the serving layer.
The tiny model (``benchmarks/overhead/tiny.py``: one packed byte in, one float out) makes the
maths free; every server answers the same V2 binary requests from Triton's perf_analyzer (C++,
so the load costs the measured cores little) at concurrency 8 and 32:

- bitserve with its defaults (``--workers auto``), ``--workers 1`` and ``--workers 2``;
- the hand-written FastAPI V2 endpoint (``benchmarks/overhead/fastapi_v2.py``): one route,
  ``await request.body()``, ``json.loads`` of the header, a ``Response``;
- the floor: a raw ASGI app on uvicorn + httptools + uvloop doing the same V2 framing
  (``benchmarks/overhead/asgi_v2.py``).

Every server is started once and measured in interleaved rounds (the median of the rounds is
reported), so drift in a shared machine's load hits all of them alike. ``--before DIR`` adds
one more server: an earlier bitserve checked out in DIR (``git worktree add DIR <rev>``), with
its defaults, so a change is measured before and after in the same run. Each answer's maths is
checked first. Then, in the same run: the demo workload (20 x 50000 bits per request) on
bitserve's defaults, ``--workers 1`` and ``2`` at concurrency 8 and 32 (its tail: p99 / p50), and
the 2048-bit fingerprint MLP through ``infer_many`` on both against a hand-written FastAPI
endpoint on float32 rows (:mod:`benchmarks.bench_mlp`'s rounds). The targets table says
what issue 23 wanted, what was measured and whether it was met.

    python -m benchmarks.bench_overhead            # writes benchmarks/results/overhead.md
    python -m benchmarks.bench_overhead --smoke    # short runs, prints only
    python -m benchmarks.bench_overhead --before /tmp/bitserve-fa22f22
    python -m benchmarks.bench_overhead --only mlp --rounds 7 --mlp-rows 32768 [--before DIR]
    python -m benchmarks.bench_overhead --only tiny --rounds 5 [--before DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

from benchmarks._common import CpuTimes, markdown_table, parse_args, quiet_host, report
from benchmarks.overhead import perf, tiny
from benchmarks.overhead.perf import Load, Running
from harness.server import perf_analyzer

CONCURRENCY = (8, 32)
DEFAULTS = "bitserve (defaults)"
WORKERS_1 = "bitserve --workers 1"
WORKERS_2 = "bitserve --workers 2"
FASTAPI = "hand-written FastAPI V2"
FLOOR = "raw ASGI floor"
BEFORE = "bitserve before"


def _revision(checkout: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or checkout.name


def check_answer(server: Running) -> None:
    """One binary V2 request of three items; the counts of ones must be exact."""
    data = np.array([0, 255, 0b1011], dtype=np.uint8)
    head = (
        b'{"inputs":[{"name":"bits","datatype":"UINT8","shape":[3,1,1],'
        b'"parameters":{"binary_data_size":3}}],'
        b'"outputs":[{"name":"count","parameters":{"binary_data":true}}]}'
    )
    r = httpx.post(
        f"{server.url}/v2/models/{tiny.NAME}/infer",
        content=head + data.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(head))},
        timeout=10,
    )
    r.raise_for_status()
    n = int(r.headers["inference-header-content-length"])
    got = struct.unpack("<3f", r.content[n:])
    if list(got) != [0.0, 8.0, 3.0]:
        raise AssertionError(f"{server.label} answered {got}")


def before_server(checkout: Path, repository: Path) -> list[str]:
    """``bitserve serve`` from an earlier checkout (its ``service`` package, this venv)."""
    return [
        "env", "-C", str(checkout), f"PYTHONPATH={checkout}",
        sys.executable, "-m", "service.cli", "serve", "--model-repository", str(repository),
    ]  # fmt: skip


PROFILE = (Path(__file__).parent / "overhead" / "profile.md").read_text().strip()
"""Where a request's time went: the profile that chose this round's changes (written by hand
from py-spy and cProfile runs; the tables below are measured on every run)."""


def histogram_quantile(before: str, after: str, name: str, q: float) -> float:
    """The ``q`` quantile of a Prometheus histogram's observations between two scrapes,
    interpolated linearly within its bucket (as PromQL's ``histogram_quantile``)."""
    from harness.probes import metric

    pattern = re.compile(rf'^{name}_bucket{{.*le="([^"]+)"')
    bounds = sorted(
        {float(m.group(1)) for line in after.splitlines() if (m := pattern.match(line))}
    )
    counts = [
        metric(after, f"{name}_bucket", 0.0, le=_le(b))
        - metric(before, f"{name}_bucket", 0.0, le=_le(b))
        for b in bounds
    ]
    total = counts[-1] if counts else 0.0
    if not total:
        return float("nan")
    rank, lower, seen = q * total, 0.0, 0.0
    for bound, cumulative in zip(bounds, counts, strict=True):
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - seen) / max(cumulative - seen, 1e-12)
        lower, seen = bound, cumulative
    return lower


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def demo_tail(server: Running, concurrency: int, seconds: float) -> list[list[object]]:
    """The demo at ``concurrency`` from perf_analyzer's run above and from the Python load
    generator now, with the server's own quantiles over the Python run (the tail's witness)."""
    import asyncio

    from harness.loadgen import run_level
    from harness.workload import Pool

    url = f"{server.url}/v2/models/demo/infer"
    before = httpx.get(server.url + "/metrics", timeout=30).text
    level = asyncio.run(run_level(url, "packed", Pool.make(4), concurrency, seconds=seconds))
    after = httpx.get(server.url + "/metrics", timeout=30).text
    if level.errors:
        raise RuntimeError(f"the Python load generator saw errors: {level.first_problem}")
    name = "bitserve_request_latency_seconds"
    own = [histogram_quantile(before, after, name, q) * 1e3 for q in (0.5, 0.99)]
    return [
        ["Python (httpx, e2e load generator)", level.rps, level.p50_ms, level.p99_ms,
         level.p99_ms / level.p50_ms, *own],
    ]  # fmt: skip


def _targets(rows: list[tuple[str, str, float, bool]]) -> str:
    """The targets table: measure, wanted, measured, met."""
    return markdown_table(
        ["measure", "wanted", "measured", "met"],
        [[name, wanted, value, "yes" if ok else "NO"] for name, wanted, value, ok in rows],
    )


def _mlp_rows(tmp: Path, smoke: bool, rounds: int) -> tuple[dict[str, list[float]], int]:
    """The 2048-bit MLP through ``infer_many`` (bench_mlp's rounds) on bitserve's defaults,
    ``--workers 1`` and ``2``, and the hand-written float32 endpoint; rows/s per round."""
    from benchmarks import bench_mlp
    from benchmarks.overhead import mlp

    rows = 20 * mlp.BATCH if smoke else 256 * mlp.BATCH
    bits = np.random.default_rng(0).random((rows, mlp.BITS)) < 0.5
    program = mlp.write_repository(tmp)
    expected = bench_mlp.reference(program, bits)
    labels = (bench_mlp.DEFAULTS, bench_mlp.WORKERS_1, bench_mlp.WORKERS_2, bench_mlp.FASTAPI)
    with perf.start(bench_mlp.servers(tmp, program, *labels)) as running:
        return bench_mlp.measure_rounds(running, bits, expected, rounds), rows


def only_mlp(before: Path | None, rounds: int, rows: int) -> None:
    """``--only mlp``: the MLP section alone (and ``--before``'s server beside it), printed."""
    from benchmarks import bench_mlp
    from benchmarks.overhead import mlp

    bits = np.random.default_rng(0).random((rows, mlp.BITS)) < 0.5
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        program = mlp.write_repository(Path(tmp))
        expected = bench_mlp.reference(program, bits)
        labels = (bench_mlp.DEFAULTS, bench_mlp.WORKERS_1, bench_mlp.FASTAPI)
        servers = bench_mlp.servers(Path(tmp), program, *labels)
        if before is not None:
            command = [*before_server(before, Path(tmp)), "--grpc-port", "0"]
            servers.insert(0, (f"{BEFORE} ({_revision(before)})", command))
        with perf.start(servers) as running:
            rps = bench_mlp.measure_rounds(running, bits, expected, rounds, httpx_client=True)
    fastapi = statistics.median(rps[bench_mlp.FASTAPI])
    print(f"\nMLP through infer_many, {rows:,} rows a round, {rounds} interleaved rounds:\n")
    print(
        markdown_table(
            ["server", "rows/s (median)", f"/ {bench_mlp.FASTAPI}", "rounds"],
            [
                [
                    label,
                    statistics.median(xs),
                    statistics.median(xs) / fastapi,
                    ", ".join(f"{x:,.0f}" for x in xs),
                ]
                for label, xs in rps.items()
            ],
        )
    )


def tiny_rounds(
    command: list[str] | None, running: list[Running], rounds: int, interval: int, smoke: bool
) -> dict[tuple[str, int], list[Load]]:
    """Each server's answer checked, then ``rounds`` interleaved rounds of the tiny model at
    every concurrency; each round starts with the next server, so no one is always first.
    Returns each (server label, concurrency)'s loads, one a round."""
    for r in running:
        check_answer(r)
    loads: dict[tuple[str, int], list[Load]] = {}
    for k in range(rounds):
        for c in CONCURRENCY:
            for r in running[k % len(running) :] + running[: k % len(running)]:
                load = perf.measure(command, r, tiny.NAME, c, interval_ms=interval, smoke=smoke)
                loads.setdefault((r.label, c), []).append(load)
                print(f"{r.label} c={c}: {load.rps:.0f} req/s", flush=True)
    return loads


def only_tiny(command: list[str] | None, before: Path | None, rounds: int, interval: int,
              smoke: bool) -> None:  # fmt: skip
    """``--only tiny``: bitserve's defaults against the hand-written V2 endpoint (and
    ``--before``'s server) on the tiny model, interleaved rounds, printed."""
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        repo = tiny.write_repository(Path(tmp) / "tiny")
        servers = [(DEFAULTS, perf.bitserve(repo)),
                   (FASTAPI, perf.module("benchmarks.overhead.fastapi_v2"))]  # fmt: skip
        if before is not None:
            servers.insert(0, (f"{BEFORE} ({_revision(before)})", before_server(before, repo)))
        with perf.start(servers) as running:
            loads = tiny_rounds(command, running, rounds, interval, smoke)
    rps = {key: [load.rps for load in xs] for key, xs in loads.items()}
    rows = []
    for (label, c), xs in rps.items():
        base = statistics.median(rps[(FASTAPI, c)])
        rounds_text = ", ".join(f"{x:,.0f}" for x in xs)
        rows.append([label, c, statistics.median(xs), statistics.median(xs) / base, rounds_text])
    print(f"\nThe tiny model, {rounds} interleaved rounds (perf_analyzer):\n")
    print(markdown_table(["server", "concurrency", "req/s", f"/ {FASTAPI}", "rounds"], rows))


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--before", type=Path, default=None)
    pre.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    pre.add_argument(
        "--interval-ms", type=int, default=3000, help="perf_analyzer's window (default 3000)"
    )
    pre.add_argument(
        "--only",
        choices=["mlp", "tiny"],
        default=None,
        help="run one section and print it (writes nothing): mlp (with --rounds, --mlp-rows) "
        "or tiny (bitserve's defaults and the hand-written V2 endpoint)",
    )
    pre.add_argument("--mlp-rows", type=int, default=256 * 64, help="--only mlp: rows a round")
    known, rest = pre.parse_known_args()
    args = parse_args(__doc__.splitlines()[0], rest)
    _, host = quiet_host(wait_s=0 if args.smoke else 180)
    print(host, flush=True)
    if known.only == "tiny":
        before_dir = known.before.resolve() if known.before is not None else None
        command = perf_analyzer()
        only_tiny(command, before_dir, 1 if args.smoke else known.rounds, known.interval_ms,
                  args.smoke)  # fmt: skip
        return
    if known.only == "mlp":
        rows = 20 * 64 if args.smoke else known.mlp_rows
        before_dir = known.before.resolve() if known.before is not None else None
        only_mlp(before_dir, 1 if args.smoke else known.rounds, rows)
        return
    command = perf_analyzer()
    if command is None:
        if not args.smoke:
            raise SystemExit("perf_analyzer not found: set PERF_ANALYZER (benchmarks/overhead)")
        print("perf_analyzer not found: a small Python load stands in for this smoke run")
    rounds = 1 if args.smoke else known.rounds
    interval = known.interval_ms
    cpu_before = CpuTimes.now()
    before = known.before.resolve() if known.before is not None else None
    before_label = f"{BEFORE} ({_revision(before)})" if before is not None else ""
    with tempfile.TemporaryDirectory(prefix="bench-overhead-") as tmp:
        repo = tiny.write_repository(Path(tmp) / "tiny")
        quiet = ["--no-access-log"] if args.smoke else []
        servers = [
            (DEFAULTS, perf.bitserve(repo)),
            (WORKERS_1, perf.bitserve(repo, "--workers", "1", *quiet)),
            (WORKERS_2, perf.bitserve(repo, "--workers", "2", *quiet)),
            (FASTAPI, perf.module("benchmarks.overhead.fastapi_v2")),
            (FLOOR, perf.module("benchmarks.overhead.asgi_v2")),
        ]
        if before is not None:
            servers.insert(0, (before_label, before_server(before, repo)))
        with perf.start(servers) as running:
            loads = tiny_rounds(command, running, rounds, interval, args.smoke)
        from service.models.demo import write_demo_repository

        demo_repo = Path(tmp) / "demo"
        write_demo_repository(demo_repo)
        demo_servers = [
            (DEFAULTS, perf.bitserve(demo_repo)),
            (WORKERS_1, perf.bitserve(demo_repo, "--workers", "1")),
            (WORKERS_2, perf.bitserve(demo_repo, "--workers", "2")),
        ]
        if before is not None:
            demo_servers.insert(0, (before_label, before_server(before, demo_repo)))
        demo: dict[tuple[str, int], Load] = {}
        tail: list[list[object]] = []
        with perf.start(demo_servers) as running:
            for c in CONCURRENCY:
                for r in running:
                    d = perf.measure(command, r, "demo", c, interval_ms=interval, smoke=args.smoke)
                    demo[(r.label, c)] = d
                    print(f"demo {r.label} c={c}: {d.rps:.1f} req/s", flush=True)
            defaults = next(r for r in running if r.label == DEFAULTS)
            tail = demo_tail(defaults, 32, seconds=2.0 if args.smoke else 12.0)
        mlp_dir = Path(tmp) / "mlp"
        mlp_dir.mkdir()
        mlp_rps, mlp_rows = _mlp_rows(mlp_dir, args.smoke, rounds=1 if args.smoke else 3)
    cpu_after = CpuTimes.now()
    stolen = ""
    if cpu_before is not None and cpu_after is not None:
        stolen = f"; {cpu_after.stolen_since(cpu_before):.1%} of the CPU time stolen during it"

    def med(label: str, c: int, field: str) -> float:
        return float(statistics.median(getattr(x, field) for x in loads[(label, c)]))

    labels = [s[0] for s in servers]
    rows = [
        [label, c, med(label, c, "rps"), med(label, c, "p50_us") / 1e3,
         med(label, c, "p99_us") / 1e3, med(label, c, "cpu_us_per_request")]
        for c in CONCURRENCY
        for label in labels
    ]  # fmt: skip
    table = markdown_table(
        ["server", "concurrency", "req/s", "p50 ms", "p99 ms", "server CPU µs/req"], rows
    )

    def ratio(a: str, b: str, c: int) -> float:
        return med(a, c, "rps") / med(b, c, "rps")

    from benchmarks import bench_mlp

    def mlp_med(label: str) -> float:
        return statistics.median(mlp_rps[label])

    d32 = demo[(DEFAULTS, 32)]
    demo_tail_ratio = d32.p99_us / d32.p50_us
    wanted: list[tuple[str, str, float, bool]] = []
    for c in CONCURRENCY:
        x = ratio(DEFAULTS, FASTAPI, c)
        wanted.append((f"tiny c={c}: bitserve (defaults) / {FASTAPI}", ">= 1.0", x, x >= 1.0))
    for c in CONCURRENCY:
        x = ratio(DEFAULTS, WORKERS_1, c)
        wanted.append((f"tiny c={c}: defaults (auto) / --workers 1", ">= 0.95", x, x >= 0.95))
    x = mlp_med(bench_mlp.DEFAULTS) / mlp_med(bench_mlp.WORKERS_1)
    wanted.append(("MLP infer_many: defaults (auto) / --workers 1", ">= 0.95", x, x >= 0.95))
    wanted.append(("demo c=32 (perf_analyzer): p99 / p50", "<= 3", demo_tail_ratio,
                   demo_tail_ratio <= 3.0))  # fmt: skip
    x = mlp_med(bench_mlp.DEFAULTS) / mlp_med(bench_mlp.FASTAPI)
    wanted.append((f"MLP infer_many: defaults / {bench_mlp.FASTAPI}", ">= 1.5", x, x >= 1.5))

    reported: list[list[object]] = []
    for c in CONCURRENCY:
        reported.append([f"tiny c={c}: {WORKERS_1} / {FASTAPI}", ratio(WORKERS_1, FASTAPI, c)])
        reported.append([f"tiny c={c}: {DEFAULTS} / {FLOOR}", ratio(DEFAULTS, FLOOR, c)])
        reported.append([f"tiny c={c}: --workers 2 / --workers 1", ratio(WORKERS_2, WORKERS_1, c)])
    if before is not None:
        for c in CONCURRENCY:
            reported.append([f"tiny c={c}: {before_label} / {FASTAPI}",
                             ratio(before_label, FASTAPI, c)])  # fmt: skip
            reported.append([f"tiny c={c}: {DEFAULTS} / {before_label}",
                             ratio(DEFAULTS, before_label, c)])  # fmt: skip
    reported.append(["MLP infer_many: --workers 2 / --workers 1",
                     mlp_med(bench_mlp.WORKERS_2) / mlp_med(bench_mlp.WORKERS_1)])  # fmt: skip
    for c in CONCURRENCY:
        reported.append([f"demo c={c}: --workers 2 / --workers 1 (req/s)",
                         demo[(WORKERS_2, c)].rps / demo[(WORKERS_1, c)].rps])  # fmt: skip
    for label, _ in demo_servers:
        reported.append([f"demo, {label}: req/s at c=32 / c=8",
                         demo[(label, 32)].rps / demo[(label, 8)].rps])  # fmt: skip
        reported.append([f"demo, {label}: p99 / p50 at c=32",
                         demo[(label, 32)].p99_us / demo[(label, 32)].p50_us])  # fmt: skip
    demo_rows = [
        [label, c, d.rps, d.p50_us / 1e3, d.p99_us / 1e3, d.p99_us / d.p50_us,
         d.cpu_us_per_request]
        for (label, c), d in sorted(demo.items(), key=lambda kv: kv[0][1])
    ]  # fmt: skip
    demo_table = markdown_table(
        ["server", "concurrency", "req/s", "p50 ms", "p99 ms", "p99 / p50", "server CPU µs/req"],
        demo_rows,
    )
    tail_table = markdown_table(
        ["load generator (c=32, bitserve defaults)", "req/s", "p50 ms", "p99 ms", "p99 / p50",
         "server's own p50 ms", "server's own p99 ms"],
        tail,
    )  # fmt: skip
    mlp_table = markdown_table(
        ["server", "rows/s (median)", "rounds"],
        [[label, mlp_med(label), ", ".join(f"{x:,.0f}" for x in xs)]
         for label, xs in mlp_rps.items()],
    )  # fmt: skip
    from service.cluster.supervisor import available_cores, plan_workers

    plan = plan_workers("auto", cores=available_cores(), gpus=0)
    load_avg = " ".join(f"{x:.1f}" for x in os.getloadavg())
    unstable = sum(not x.stable for runs in loads.values() for x in runs)
    unstable += sum(not d.stable for d in demo.values())
    body = f"""
Host: {host}{stolen}; load average {load_avg} when the tables were written (this run's
servers and load generator). The rows of a table are interleaved rounds, so drift in the
machine's load weighs on every server alike, but other work on two cores does not weigh on
servers of different shapes alike: a run that began on a busy host says so above.
perf_analyzer found no stable window (50%) in {unstable} of its runs, which then took the
last of three windows. Every section below is from this one run. bitserve's defaults on this
host: {plan.reason}.

## Targets (issue 23)

{_targets(wanted)}

{markdown_table(["also measured", "value"], reported)}

{PROFILE}

## The tiny model

Tiny model (one packed byte in, one float out: the serving layer is the whole cost), V2 binary
requests from perf_analyzer (`--measurement-interval {interval} --stability-percentage 50`)
over loopback; {rounds} interleaved round(s), medians. The load generator shares the machine's
{os.cpu_count()} cores with the server. "server CPU µs/req" is the server's process tree
(user + system) over the run divided by the requests it served. bitserve's rows log every
request (its default); the baselines log none.

{table}

## The demo workload

Demo workload on bitserve (20 x 50000 bits packed per request, dynamic batching up to 16,
perf_analyzer random data; its operator runs on torch's threads, so this is bound by the two
cores, not by serving), one perf_analyzer run per row:

{demo_table}

The demo's tail at concurrency 32 on the defaults' server from the Python load generator of
the e2e benchmark (httpx, asyncio, every answer checked against a float64 reference, on the
same two cores). "server's own" is the server's latency histogram
(`bitserve_request_latency_seconds`: from a request's arrival to its answer) over the Python
run, read from `/metrics` before and after it and interpolated within its buckets.

{tail_table}

## A light model: the 2048-bit fingerprint MLP through `infer_many`

2048 -> 256 -> 1 (`torch.export`), {mlp_rows:,} random fingerprints a round, 64 rows a
request, {bench_mlp.CONCURRENCY} requests in flight (`Client.infer_many`'s default for this model:
two of its batches), {1 if args.smoke else 3} interleaved rounds. bitserve gets the rows
bit-packed (256 bytes each); the hand-written endpoint (`benchmarks/overhead/fastapi_mlp.py`)
gets them as float32 (8,192 bytes each) from a thread pool of the same size. Every score is
checked against the program run in the benchmark.

{mlp_table}
"""
    report(
        "overhead",
        "Serving overhead: bitserve vs a hand-written FastAPI endpoint and the raw ASGI floor",
        body,
        smoke=args.smoke,
        devices=args.device,
    )


if __name__ == "__main__":
    main()
