"""Runs every peer at every concurrency level and turns the measurements into the report.

For each server: install its venv if needed, start it on a loopback port, and for each of its
wire formats and each concurrency run the load generator in a separate process
(``python -m harness.loadgen``), then stop the server. The pool of items and their
float64 references is built once and shared through an ``.npz`` file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import markdown_table
from benchmarks.e2e import servers
from benchmarks.e2e.servers import Peer
from harness.loadgen import SUCCESS, save_pool
from harness.workload import Pool

TARGETS_AT = 8
"""The issue's targets are stated at this concurrency."""


@dataclass
class Row:
    """One (peer, concurrency) measurement."""

    peer: Peer
    concurrency: int
    data: dict[str, Any]
    """The load generator's :class:`~harness.loadgen.LevelResult` as JSON."""


def run_all(
    peers: Sequence[Peer],
    levels: Sequence[int],
    *,
    seconds: float,
    pool_size: int,
    workdir: Path | None = None,
) -> list[Row]:
    """Measure every peer at every level; a peer that fails to start is reported and skipped."""
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bitserve-e2e-") as tmp:
        work = workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        pool_file = work / "pool.npz"
        print(f"building {pool_size} items and their float64 references", flush=True)
        save_pool(Pool.make(pool_size), pool_file)
        programs: list[servers.Server] = []
        for p in peers:
            if p.server not in programs:
                programs.append(p.server)
        for server in programs:
            servers.ensure_venv(server, work / f"install-{server.name}.log")
            try:
                with servers.running(server, work / server.name) as run:
                    for p in (q for q in peers if q.server == server):
                        for c in levels:
                            data = _loadgen(run, p, c, seconds, pool_file)
                            rows.append(Row(p, c, data))
                            print(_progress(rows[-1]), flush=True)
            except RuntimeError as e:
                print(f"{server.name}: {e}", file=sys.stderr, flush=True)
    return rows


def _loadgen(
    run: servers.Running, peer: Peer, concurrency: int, seconds: float, pool_file: Path
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "harness.loadgen",
        "--url",
        run.grpc_target if peer.fmt == "grpc" else run.infer_url,
        "--format",
        peer.fmt,
        "--concurrency",
        str(concurrency),
        "--seconds",
        str(seconds),
        "--warmup",
        str(min(concurrency, 8)),
        "--pool-file",
        str(pool_file),
        "--server-pid",
        str(run.proc.pid),
    ]
    out = subprocess.run(cmd, cwd=servers.ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed for {peer.label}: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _progress(row: Row) -> str:
    d = row.data
    return (
        f"  {row.peer.label:34s} c={row.concurrency:<3d} {d['rps']:8.1f} req/s "
        f"p50 {d['p50_ms']:8.1f} ms  p99 {d['p99_ms']:8.1f} ms  errors {_errors(d)}"
    )


def _errors(d: dict[str, Any]) -> int:
    bad = sum(n for s, n in d["statuses"].items() if s not in SUCCESS)
    return int(bad + d["wrong"])


def table(rows: Sequence[Row]) -> str:
    """The markdown table of every measurement."""
    headers = [
        "peer",
        "conc.",
        "req/s",
        "p50 ms",
        "p99 ms",
        "p99/p50",
        "request bytes",
        "response bytes",
        "server CPU ms/req",
        "answers checked",
        "errors",
    ]
    body = []
    for r in rows:
        d = r.data
        body.append(
            [
                r.peer.label,
                r.concurrency,
                float(d["rps"]),
                float(d["p50_ms"]),
                float(d["p99_ms"]),
                float(d["p99_ms"] / d["p50_ms"]) if d["ok"] else float("nan"),
                f"{d['request_bytes']:,}",
                f"{int(d['response_bytes']):,}",
                float(d["server_cpu_s_per_req"] * 1e3),
                d["ok"],
                _errors(d),
            ]
        )
    return markdown_table(headers, body)


def _at(rows: Sequence[Row], label_start: str, c: int) -> dict[str, Any] | None:
    for r in rows:
        if r.peer.label.startswith(label_start) and r.concurrency == c:
            return r.data
    return None


def targets(rows: Sequence[Row], c: int = TARGETS_AT) -> str:
    """The issue's targets at concurrency ``c``: measured ratio, target, met or not."""
    ours = _at(rows, "bitserve packed", c)
    if ours is None or not ours["ok"]:
        return "_bitserve packed was not measured at this concurrency._"
    lines = []

    def add(what: str, value: float | None, goal: float) -> None:
        if value is None:
            lines.append([what, "not measured", f">= {goal:g}x", "-"])
        else:
            met = "yes" if value >= goal else "NO"
            lines.append([what, f"{value:.2f}x", f">= {goal:g}x", met])

    def speedup(label: str) -> float | None:
        other = _at(rows, label, c)
        return ours["rps"] / other["rps"] if other and other["rps"] > 0 else None

    def smaller(label: str, mine: dict[str, Any] | None = ours) -> float | None:
        other = _at(rows, label, c)
        if other is None or mine is None:
            return None
        return float(other["request_bytes"] / mine["request_bytes"])

    add("req/s vs hand-written FastAPI", speedup("hand-written"), 3)
    add("req/s vs MLServer (JSON)", speedup("MLServer"), 10)
    add("req/s vs KServe (binary BOOL)", speedup("KServe BOOL (binary)"), 30)
    add("request bytes vs binary BOOL", smaller("bitserve BOOL (binary)"), 8)
    raw = _at(rows, "bitserve packed UINT8 (raw", c)
    add(
        "request bytes vs binary BOOL (raw binary form)",
        smaller("bitserve BOOL (binary)", raw),
        8,
    )
    add("request bytes vs JSON", smaller("bitserve BOOL (JSON)"), 40)
    ratio = ours["p99_ms"] / ours["p50_ms"]
    lines.append(
        ["p99 / p50 (bitserve packed)", f"{ratio:.2f}", "< 3", "yes" if ratio < 3 else "NO"]
    )
    return markdown_table(["at concurrency 8", "measured", "target", "met"], lines)


def _pair(a: dict[str, Any], b: dict[str, Any], key: str, scale: float = 1.0) -> str:
    return f"{a[key] * scale:.1f} / {b[key] * scale:.1f}"


def grpc_vs_http(rows: Sequence[Row]) -> str:
    """bitserve's packed requests over gRPC against the same over HTTP, at each concurrency."""
    lines = []
    for c in sorted({r.concurrency for r in rows}):
        http = _at(rows, "bitserve packed UINT8 (binary)", c)
        grpc = _at(rows, "bitserve packed UINT8 (gRPC)", c)
        if not (http and grpc and http["ok"] and grpc["ok"]):
            continue
        ratio = f"{grpc['rps'] / http['rps']:.2f}x"
        lines.append(
            [c, _pair(grpc, http, "rps"), ratio, _pair(grpc, http, "p50_ms"),
             _pair(grpc, http, "p99_ms"), _pair(grpc, http, "server_cpu_s_per_req", 1e3)]
        )  # fmt: skip
    if not lines:
        return "_gRPC and HTTP were not both measured._"
    return markdown_table(
        ["conc.", "req/s gRPC / HTTP", "gRPC ÷ HTTP", "p50 ms gRPC / HTTP",
         "p99 ms gRPC / HTTP", "server CPU ms/req gRPC / HTTP"],
        lines,
    )  # fmt: skip


def plot(rows: Sequence[Row], path: Path) -> None:
    """Throughput and p99 latency against concurrency, one line per peer (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    labels = list(dict.fromkeys(r.peer.label for r in rows))
    for label in labels:
        rs = [r for r in rows if r.peer.label == label and r.data["ok"]]
        cs = [r.concurrency for r in rs]
        style = "-o" if label.startswith("bitserve") else "--s"
        ax1.plot(cs, [r.data["rps"] for r in rs], style, label=label)
        ax2.plot(cs, [r.data["p99_ms"] for r in rs], style, label=label)
    for ax, ylabel in ((ax1, "requests / s"), (ax2, "p99 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({r.concurrency for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_title("throughput (higher is better)")
    ax2.set_title("p99 latency (lower is better)")
    ax1.legend(fontsize=8)
    fig.suptitle("20 x 50000 bits -> 20 x 500 float32 per request, every answer checked")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
