"""Search served: an ``[index]`` model over REST against the in-process op, its memory and load.

- **Throughput.** A Tanimoto index (2048-bit fingerprint-like rows) and a Hamming index
  (1024-bit binary embeddings), served by one ``bitserve serve`` (``--workers 1``,
  ``max_batch_size`` 64) and searched through ``Client.search`` by 8 threads at once, 64
  queries a request, k = 10; against ``gpu_ops.PackedCorpus`` on the same rows in this
  process, 64 queries a call. Interleaved rounds, medians; every served answer is checked
  against the op's.
- **Memory.** The server's RSS with a 1M x 2048-bit index against the same server with a
  64-row index (the empty server: the same code loaded), after a search each.
- **Load.** ``build_version`` of the 1M x 2048-bit index in this process (read, check, hash,
  prepare, dry run), and the served reload (unload, then load over REST).

    python -m benchmarks.bench_search_served            # section "Served" of results/search.md
    python -m benchmarks.bench_search_served --smoke    # tiny sizes, prints only
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import RESULTS, machine_info, markdown_table, parse_args, quiet_host
from harness.server import BitserveServer, start_server

Array = np.ndarray[Any, Any]
BATCH = 64
CONCURRENCY = 8
K = 10
MiB = 1 << 20
SECTION = "## Served over REST (bench_search_served)"
THREADS = sorted({1, torch.get_num_threads()})
"""The op's thread counts: the server's under ``--workers 1`` here, and torch's default."""


def corpus_rows(rng: np.random.Generator, n: int, nbits: int, density: float) -> Array:
    """``(n, nbits / 8)`` packed rows: 100k random ones tiled, the first 8 bytes random (so
    rows differ), as cheap to make at 1M as at 100k."""
    base = np.packbits(rng.random((min(n, 100_000), nbits), dtype=np.float32) < density, axis=1)
    rows = np.tile(base, (-(-n // len(base)), 1))[:n]
    rows[:, :8] = rng.integers(0, 256, (n, 8), dtype=np.uint8)
    return rows


def write_model(folder: Path, rows: Array, metric: str, ids: bool = True) -> None:
    from safetensors.numpy import save_file

    from service.index.build import config_text

    folder.mkdir(parents=True)
    tensors = {"corpus": rows}
    if ids:
        tensors["ids"] = np.arange(len(rows), dtype=np.int64) + 10**9
    save_file(tensors, str(folder / "corpus.safetensors"))
    (folder / "config.toml").write_text(
        config_text(metric, 8 * rows.shape[1], "big", K, 1000, BATCH)
    )


def rss(server: BitserveServer) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmRSS")


def served(url: str, model: str, queries: list[Array]) -> tuple[float, list[Array]]:
    """Seconds for every request of ``queries`` through ``Client.search`` at CONCURRENCY."""
    from bitserve_client import Client

    with Client(url, timeout=600) as client:
        client.search(model, queries[0])  # the spec fetched, a connection open
        t0 = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            ids = list(pool.map(lambda q: client.search(model, q, k=K)[0], queries))
        return time.perf_counter() - t0, ids


def in_process(
    corpus: Any, metric: str, queries: list[Array], threads: int
) -> tuple[float, list[Array]]:
    """Seconds for every batch of ``queries`` through the op, one call each, on ``threads``
    torch threads."""
    out = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        for q in queries:
            t = torch.from_numpy(q)
            search = corpus.tanimoto_topk if metric == "tanimoto" else corpus.hamming_topk
            _, rows = search(t, K)
            out.append(rows.numpy() + 10**9)
        return time.perf_counter() - t0, out
    finally:
        torch.set_num_threads(before)


def throughput(tmp: Path, n: int, rounds: int, requests: int) -> list[list[object]]:
    """Rows of the throughput table, one per index."""
    import gpu_ops

    rng = np.random.default_rng(1)
    specs = {"fp": ("tanimoto", 2048, 0.05), "emb": ("hamming", 1024, 0.5)}
    repo = tmp / "throughput"
    corpora, batches = {}, {}
    for name, (metric, nbits, density) in specs.items():
        rows = corpus_rows(rng, n, nbits, density)
        write_model(repo / name, rows, metric)
        corpora[name] = gpu_ops.PackedCorpus(torch.from_numpy(rows))
        picks = rng.integers(0, n, requests * BATCH)
        queries = rows[picks].copy()
        queries[:, 8:16] ^= rng.integers(0, 256, (len(picks), 8), dtype=np.uint8)
        batches[name] = [queries[i : i + BATCH] for i in range(0, len(queries), BATCH)]
        del rows
    out: list[list[object]] = []
    times: dict[tuple[str, int, str], list[float]] = {}
    with contextlib.ExitStack() as stack:
        # The server as --workers 1 plans it here (1 torch thread on 2 cores), and with
        # OMP_NUM_THREADS set to torch's default (the plan then leaves torch's threads).
        servers = {
            t: stack.enter_context(
                start_server(repo, timeout=600, env={} if t == 1 else {"OMP_NUM_THREADS": str(t)})
            )
            for t in THREADS
        }
        for _ in range(rounds):
            for name, (metric, _, _) in specs.items():
                for threads, server in servers.items():
                    t_op, want = in_process(corpora[name], metric, batches[name], threads)
                    t_rest, got = served(server.url, name, batches[name])
                    for a, b in zip(got, want, strict=True):
                        np.testing.assert_array_equal(a, b)  # the same hits, in the same order
                    times.setdefault((name, threads, "op"), []).append(t_op)
                    times.setdefault((name, threads, "rest"), []).append(t_rest)
    q = requests * BATCH
    for name, (metric, nbits, _) in specs.items():
        for threads in THREADS:
            op_s, rest_s = times[(name, threads, "op")], times[(name, threads, "rest")]
            op, rest = q / statistics.median(op_s), q / statistics.median(rest_s)
            ratios = [o / r for o, r in zip(op_s, rest_s, strict=True)]
            label = f"{metric}, {n:,} x {nbits} bits, top-{K}"
            out.append([label, threads, f"{op:,.1f}", f"{rest:,.1f}", f"{rest / op:.2f}x",
                        f"{min(ratios):.2f}-{max(ratios):.2f}"])  # fmt: skip
    return out


def memory_and_load(tmp: Path, n: int) -> tuple[list[list[object]], list[list[object]]]:
    """Rows of the memory table and of the load table."""
    from bitserve_client import Client

    from service.models.builder import build_version
    from service.models.layout import model_versions

    rng = np.random.default_rng(2)
    small, big = tmp / "small", tmp / "big"
    tiny = corpus_rows(rng, 64, 2048, 0.05)
    write_model(small / "tiny", tiny, "tanimoto")
    write_model(big / "tiny", tiny, "tanimoto")
    rows = corpus_rows(rng, n, 2048, 0.05)
    write_model(big / "fp", rows, "tanimoto")
    corpus_bytes = rows.nbytes
    del rows
    gc.collect()
    t0 = time.perf_counter()
    _, pipe = build_version(
        "fp", model_versions(big, "fp")["1"], default_device="cpu", max_operator_bytes=1 << 30
    )
    build_s = time.perf_counter() - t0
    del pipe
    gc.collect()
    readings = {}
    for label, repo in (("empty", small), ("index", big)):
        with start_server(repo, timeout=600) as server, Client(server.url, timeout=600) as c:
            c.search("tiny", tiny[:4])
            if label == "index":
                c.search("fp", tiny[:4])
            readings[label] = rss(server)
            if label == "index":
                c.unload_model("fp")
                time.sleep(1.0)
                t0 = time.perf_counter()
                c.load_model("fp")
                reload_s = time.perf_counter() - t0
    grew = readings["index"] - readings["empty"]
    budget = corpus_bytes + 200 * MiB
    memory = [
        ["server with a 64-row index (empty)", f"{readings['empty'] / MiB:,.0f}", ""],
        [f"server with a {n:,} x 2048-bit index", f"{readings['index'] / MiB:,.0f}",
         f"+{grew / MiB:,.0f} MiB for a {corpus_bytes / MiB:,.0f} MiB corpus "
         f"(target <= +{budget / MiB:,.0f}: {'met' if grew <= budget else 'MISSED'})"],
    ]  # fmt: skip
    load = [
        [f"build_version, {n:,} x 2048 bits (in process)", f"{build_s:.2f}",
         "met" if build_s <= 3.0 else "MISSED"],
        ["served: unload, then POST .../load", f"{reload_s:.2f}",
         "met" if reload_s <= 3.0 else "MISSED"],
    ]  # fmt: skip
    return memory, load


def write_section(text: str) -> None:
    """Put ``text`` as the served section of ``results/search.md``, keeping the rest."""
    path = RESULTS / "search.md"
    old = path.read_text() if path.exists() else "# Search on bits\n"
    start = old.find(SECTION)
    if start >= 0:
        end = old.find("\n## ", start + len(SECTION))
        old = old[:start] + (old[end + 1 :] if end >= 0 else "")
    path.write_text(old.rstrip() + "\n\n" + text.strip() + "\n")
    print(f"wrote {path}")


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    pre.add_argument("--rows", type=int, default=250_000, help="throughput corpus rows")
    known, rest = pre.parse_known_args()
    args = parse_args(__doc__.splitlines()[0], rest)
    if args.smoke:
        rounds, rows, requests, big = 1, 5_000, 8, 20_000
    else:
        rounds, rows, requests, big = known.rounds, known.rows, 16, 1_000_000
    _, host = quiet_host(wait_s=0 if args.smoke else 120)
    print(host, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-search-served-") as tmp:
        speed = throughput(Path(tmp), rows, rounds, requests)
        memory, load = memory_and_load(Path(tmp), big)
    headers = ["index", "torch threads", "op q/s", "served q/s (REST, c=8)", "served / op"]
    headers += ["per round"]
    speed_table = markdown_table(headers, speed)
    body = f"""{SECTION}

Measured {machine_info(["cpu"])}; {host}. One `bitserve serve --workers 1`, the index
`max_batch_size = {BATCH}`; the client (`Client.search`, {CONCURRENCY} threads, {BATCH}
queries a request, k = {K}) on the same host. In process: `gpu_ops.PackedCorpus` on the same
rows, {BATCH} queries a call, on the server's torch threads: 1 (what `--workers 1` plans
on this host) and torch's default (the server started with `OMP_NUM_THREADS`). {
        requests
    } requests a round, median of {rounds} interleaved
rounds; every served answer equal to the op's.

{speed_table}

Target: served >= 0.8x the op.

{markdown_table(["server", "RSS MiB", "growth"], memory)}

{markdown_table(["load", "seconds", "target <= 3 s"], load)}
"""
    print(body)
    if not args.smoke:
        write_section(body)


if __name__ == "__main__":
    main()
