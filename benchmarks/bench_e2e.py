"""End-to-end: bitserve against a hand-written FastAPI endpoint, MLServer and KServe.

Every peer serves the same workload (20 x 50000 bits in, 20 x 500 float32 out, the same torch
code) on 127.0.0.1; a separate load generator process drives each at 1, 8 and 32 concurrent
clients and checks every answer against a float64 reference.

    python -m benchmarks.bench_e2e            # all peers; installs MLServer and KServe into
                                              # benchmarks/e2e/.venvs/ on first use (minutes)
    python -m benchmarks.bench_e2e --smoke    # bitserve (HTTP and gRPC) and the hand-written
                                              # baseline only, a few seconds, main venv,
                                              # writes nothing

Without ``--smoke`` it writes ``benchmarks/results/e2e.md`` and ``benchmarks/results/e2e.png``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from benchmarks._common import RESULTS, report
from benchmarks.e2e import runner, servers


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="bitserve + baseline, seconds, no files")
    p.add_argument("--seconds", type=float, help="timed seconds per level (default 6; smoke 1.5)")
    p.add_argument("--levels", type=int, nargs="+", help="concurrency levels (default 1 8 32)")
    p.add_argument("--only", nargs="+", help="peers whose label starts with one of these")
    p.add_argument("--pool", type=int, default=8, help="distinct items cycled through")
    args = p.parse_args(argv)

    peers = servers.SMOKE_PEERS if args.smoke else servers.PEERS
    if args.only:
        peers = tuple(q for q in peers if any(q.label.startswith(s) for s in args.only))
    levels = args.levels or ([1, 8] if args.smoke else [1, 8, 32])
    seconds = args.seconds or (1.5 if args.smoke else 6.0)
    rows = runner.run_all(peers, levels, seconds=seconds, pool_size=2 if args.smoke else args.pool)
    if not rows:
        print("no peer could be measured", file=sys.stderr)
        return 1

    versions = []
    for server in (servers.MLSERVER, servers.KSERVE):
        if any(q.server == server for q in peers):
            versions.append(f"{server.name} {servers.package_version(server, server.name)}")
    body = f"""
Every peer serves the same workload on 127.0.0.1 and runs the same torch code
(`gpu_ops.BandedResampler`, Gaussian sigma = 125 fine points cut at 4 sigma): one item per
request, 20 functions x 50000 bits in (about 10% ones), 20 x 500 float32 out. A separate load
generator process (async httpx, closed loop) runs {seconds:g} s per concurrency level after a
short warm-up, and checks every answer against a float64 NumPy reference; "errors" counts
non-200 answers and wrong answers. Server CPU is the server process tree's user + system time
over the timed phase divided by the answers. Server and load generator share the machine's
cores. {", ".join(versions) + "." if versions else ""}

- bitserve: `bitserve serve` on its built-in demo model (this workload, dynamic batching up to
  16); packed = UINT8 (1, 20, 6250) with Triton's binary extension; BOOL = one byte per bit;
  gRPC = the same packed bytes in `raw_input_contents` of Triton's `ModelInferRequest`, each
  client on its own channel (its own HTTP/2 connection, as each HTTP client has its own).
- hand-written FastAPI + packbits: raw `np.packbits` bytes in, `np.unpackbits`, the same torch
  code in a thread, raw float32 bytes out (`benchmarks/e2e/peers/baseline_app.py`).
- MLServer: a custom `MLModel` runtime, V2 JSON (its REST API has no binary extension),
  `parallel_workers = 0` (with today's uvloop the default `parallel_workers = 1` crashes at
  start), compute in a thread.
- KServe: a Python `kserve.Model` in `ModelServer`, bound to 127.0.0.1, gRPC off.

{runner.table(rows)}

{runner.targets(rows)}

bitserve over gRPC against HTTP (packed UINT8 both ways; the shared machine's numbers are noisy,
see the README):

{runner.grpc_vs_http(rows)}
{"" if args.smoke else chr(10) + "![throughput and p99 against concurrency](e2e.png)" + chr(10)}
Reproduce: `python -m benchmarks.bench_e2e` (installs MLServer and KServe into
`benchmarks/e2e/.venvs/` on first use).
"""
    if not args.smoke:
        RESULTS.mkdir(parents=True, exist_ok=True)
        runner.plot(rows, RESULTS / "e2e.png")
    report(
        "e2e",
        "End-to-end serving: bitserve vs hand-written FastAPI, MLServer, KServe",
        body,
        smoke=args.smoke,
        devices=["cpu"],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
