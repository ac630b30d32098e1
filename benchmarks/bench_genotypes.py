"""plink2 --score against bitserve's genotype score model: parity, speed, bytes on the wire.

Data: ``plink2 --dummy`` (10,000 samples x 100,000 variants, 2% missing genotypes; ``--smoke``:
200 x 2,000), a score file naming every variant on its first or second allele at random, two
weight columns. One thread each, one run each (the issue's protocol):

* ``plink2 --score ... --threads 1`` (reading the .bed and computing the frequencies for
  mean imputation included), wall time of the process;
* ``bitserve genotypes score --threads 1`` as a process of its own (Python start-up, the
  model folder read, the .bed read memory-mapped and scored by the C kernel, the .sscore
  written: no torch, :mod:`service.genotypes.fast`); and the same in this process;
* the served model's pipeline in this process (torch on one thread, what ``bitserve
  genotypes score`` falls back to): the model loaded (lookup table built, dry run), then the
  .bed read, transposed and scored;
* ``bitserve score --threads 1`` as a process of its own: a .bed without ``--address`` is
  scored in the process, no Ray (the same C kernel, :mod:`service.ray.bed_local`), into the
  Parquet files the Ray path writes; wall time of the process;
* ``bitserve score --ray`` (Ray Data, a Ray of its own, one actor, one torch thread): the .bed
  written as Parquet rows, scored, written as Parquet, wall time of the process;
* served end to end: ``bitserve serve`` (``OMP_NUM_THREADS=1``) and the client's
  ``plink.score_bed`` (``read_bed`` transpose, variant check, ``infer_many``), wall time of the
  client call (the server started and the model loaded before).

Parity: every sample's SCORE1/2_SUM and _AVG against plink2's (which prints 6 significant
digits), max relative difference. Writing the model folder (``score-model``) is timed too.

    python -m benchmarks.bench_genotypes [--smoke]
"""

from __future__ import annotations

import importlib.util
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._common import markdown_table, parse_args, quiet_host, report

HEADERS = ["contender", "wall s", "x plink2 (wall)", "CPU s", "x plink2 (CPU)",
           "SUM max rel diff", "AVG max rel diff"]  # fmt: skip


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _plink(*args: str) -> tuple[float, float]:
    """Wall and CPU seconds of one plink2 run."""
    c0, t0 = _children_cpu(), time.perf_counter()
    subprocess.run(["plink2", "--threads", "1", "--memory", "2000", *args], check=True,
                   capture_output=True)  # fmt: skip
    return time.perf_counter() - t0, _children_cpu() - c0


def _process_cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def _score_file(bim: Path, out: Path) -> None:
    rng = np.random.default_rng(0)
    lines = ["ID\tA\tW1\tW2"]
    with open(bim) as fh:
        for line in fh:
            f = line.split()
            allele = f[4] if rng.random() < 0.5 else f[5]
            w = rng.normal(size=2)
            lines.append(f"{f[1]}\t{allele}\t{w[0]:.6g}\t{w[1]:.6g}")
    out.write_text("\n".join(lines) + "\n")


def _bitserve_score(
    tmp: Path, bed: Path, env: dict[str, str], *, ray: bool
) -> tuple[dict[str, np.ndarray] | None, float, float, str]:
    """``bitserve score --threads 1`` of the .bed, in its process (``ray=False``) or with
    ``--ray`` on a Ray of its own: its outputs (None when it did not run), wall and CPU
    seconds, and why it did not run."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return None, math.nan, math.nan, "pyarrow is not installed"
    if ray and importlib.util.find_spec("ray") is None:
        return None, math.nan, math.nan, "Ray is not installed"
    from harness.server import bitserve_command

    out = tmp / ("ray-out" if ray else "here-out")
    on_ray = ["--ray", "--actors", "1"] if ray else []
    c0, t0 = _children_cpu(), time.perf_counter()
    done = subprocess.run([*bitserve_command(), "score", "--model-repository", str(tmp / "repo"),
                           "--model", "prs", *on_ray, "--threads", "1", str(bed), str(out)],
                          capture_output=True, text=True, check=False,
                          env={**env, "RAY_USAGE_STATS_ENABLED": "0"})  # fmt: skip
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if done.returncode != 0:  # Ray's start can fail on an overloaded host: say so, go on
        print(f"bitserve score failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        last = done.stderr.strip().splitlines()[-1:] or [""]
        return None, math.nan, math.nan, f"exit {done.returncode}: {last[0][:200]}"
    table = pa.concat_tables([pq.read_table(f) for f in sorted(out.rglob("*.parquet"))])
    result = {
        k: np.stack(table.column(k).to_numpy(zero_copy_only=False)).astype(float)
        for k in ("ALLELE_CT", "NAMED_ALLELE_DOSAGE_SUM", "SCORE_AVG", "SCORE_SUM")
    }
    return result, wall, cpu, ""


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-3)))


def main() -> None:
    args = parse_args(__doc__ or "")
    if shutil.which("plink2") is None:
        print("plink2 is not installed (apt-get install plink2): nothing to compare")
        return
    n, L = (200, 2000) if args.smoke else (10_000, 100_000)
    quiet = (True, "smoke run") if args.smoke else quiet_host(wait_s=60)
    torch.set_num_threads(1)
    from bitserve_client import Client, plink

    from harness.server import bitserve_command, start_server
    from service.genotypes import fast, write_score_model
    from service.genotypes.bulk import load_score_model, score_bed

    tmp = Path(tempfile.mkdtemp(prefix="bench-genotypes-"))
    try:
        d = tmp / "d"
        _plink("--dummy", str(n), str(L), "0.02", "acgt", "--make-bed", "--out", str(d))
        _score_file(d.with_suffix(".bim"), tmp / "s.txt")
        score_args = ["--score", str(tmp / "s.txt"), "1", "2", "header", "cols=+scoresums",
                      "--score-col-nums", "3-4"]  # fmt: skip
        t_plink, c_plink = _plink("--bfile", str(d), *score_args, "--out", str(tmp / "o"))
        lines = (tmp / "o.sscore").read_text().splitlines()[1:]
        want = np.array([line.split()[3:] for line in lines], float)  # CT DS AVG1 AVG2 SUM1 SUM2
        t0 = time.perf_counter()
        write_score_model(d.with_suffix(".bim"), d.with_suffix(".bed"), tmp / "s.txt",
                          tmp / "repo" / "prs", score_cols=[3, 4])  # fmt: skip
        t_write = time.perf_counter() - t0
        bed = d.with_suffix(".bed")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        c0, t0 = _children_cpu(), time.perf_counter()
        cmd_args = ["genotypes", "score", "--threads", "1", "--model-repository",
                    str(tmp / "repo"), "--model", "prs", str(bed),
                    str(tmp / "b.sscore")]  # fmt: skip
        subprocess.run([*bitserve_command(), *cmd_args], check=True, capture_output=True,
                       env=env)  # fmt: skip
        t_cmd, c_cmd = time.perf_counter() - t0, _children_cpu() - c0
        lines = (tmp / "b.sscore").read_text().splitlines()[1:]
        cmd = np.array([line.split("\t")[2:] for line in lines], float)
        c0, t0 = time.process_time(), time.perf_counter()
        fm = fast.load_fast_model(tmp / "repo", "prs")
        assert isinstance(fm, fast.FastScoreModel), fm
        fast_r = fast.score_bed_fast(fm, bed, threads=1)
        t_fast, c_fast = time.perf_counter() - t0, time.process_time() - c0
        c0, t0 = time.process_time(), time.perf_counter()
        loaded = load_score_model(tmp / "repo", "prs")
        t_load, c_load = time.perf_counter() - t0, time.process_time() - c0
        c0, t0 = time.process_time(), time.perf_counter()
        bulk = score_bed(tmp / "repo", "prs", bed, loaded=loaded)
        t_bulk, c_bulk = time.perf_counter() - t0, time.process_time() - c0
        c0, t0 = time.process_time(), time.perf_counter()
        plink.read_bed(bed)
        t_read, c_read = time.perf_counter() - t0, time.process_time() - c0
        here_r, t_here, c_here, here_why = _bitserve_score(tmp, bed, env, ray=False)
        if args.smoke:  # a Ray start is most of CI's smoke run; tests/ray/test_bed_e2e.py runs it
            ray_r, t_ray, c_ray, ray_why = None, math.nan, math.nan, "not in a smoke run"
        else:
            ray_r, t_ray, c_ray, ray_why = _bitserve_score(tmp, bed, env, ray=True)
        with start_server(tmp / "repo", env={"OMP_NUM_THREADS": "1"}) as server, \
                Client(server.url) as client:  # fmt: skip
            plink.score_bed(client, "prs", bed, progress=False)  # warm: first batches, pools
            s0, c0, t0 = _process_cpu(server.process.pid), time.process_time(), time.perf_counter()
            served = plink.score_bed(client, "prs", bed, progress=False, concurrency=1)
            t_served = time.perf_counter() - t0
            c_served = time.process_time() - c0 + _process_cpu(server.process.pid) - s0
        S = 2
        results = {
            "cmd": {"ALLELE_CT": cmd[:, :1], "NAMED_ALLELE_DOSAGE_SUM": cmd[:, 1:2],
                    "SCORE_AVG": cmd[:, 2 : 2 + S], "SCORE_SUM": cmd[:, 2 + S :]},
            "fast": fast_r,
            "bulk": bulk,
            "served": {k: np.asarray(served[k]) for k in bulk},
        }  # fmt: skip
        if here_r is not None:
            results["here"] = here_r
        if ray_r is not None:
            results["ray"] = ray_r
        rows: list[list[object]] = [
            ["plink2 --score --threads 1", t_plink, 1.0, c_plink, 1.0, "-", "-"]
        ]
        parity = {}
        for label, r in results.items():
            sums, avg = r["SCORE_SUM"], r["SCORE_AVG"]
            parity[label] = (_rel(sums, want[:, 4:6]), _rel(avg, want[:, 2:4]))
            exact = np.array_equal(r["ALLELE_CT"][:, 0], want[:, 0]) and np.array_equal(
                r["NAMED_ALLELE_DOSAGE_SUM"][:, 0], want[:, 1])  # fmt: skip
            assert exact, f"{label}: ALLELE_CT / NAMED_ALLELE_DOSAGE_SUM differ from plink2's"

        def row(label: str, wall: float, cpu: float, p: tuple[float, float] | None) -> list[object]:
            rel = [f"{p[0]:.1e}", f"{p[1]:.1e}"] if p else ["-", "-"]
            return [label, wall, t_plink / wall, cpu, c_plink / cpu, *rel]

        rows += [
            row("`bitserve genotypes score --threads 1`, its own process (no torch: NumPy + C "
                "kernel on the memory-mapped .bed)", t_cmd, c_cmd, parity["cmd"]),
            row("the same in this process: model folder read + .bed scored", t_fast, c_fast,
                parity["fast"]),
            row("served model's pipeline in this process (torch): read + transpose + score",
                t_bulk, c_bulk, parity["bulk"]),
            row("the same with the model load (lookup table, dry run)", t_load + t_bulk,
                c_load + c_bulk, None),
        ]  # fmt: skip
        for key, label, r, wall, cpu, why in (
            ("here", "`bitserve score --threads 1`, its own process (a .bed: in the process, no "
             "Ray; the C kernel; Parquet out)", here_r, t_here, c_here, here_why),
            ("ray", "`bitserve score --ray` (Ray Data, a Ray of its own, 1 actor, --threads 1), "
             "its own process", ray_r, t_ray, c_ray, ray_why),
        ):  # fmt: skip
            if r is None:
                rows.append([f"{label}: did not run ({why})", "-", "-", "-", "-", "-", "-"])
            else:
                rows.append(row(label, wall, cpu, parity[key]))
        rows.append(row("served: client plink.score_bed (read_bed + infer_many), server warm",
                        t_served, c_served, parity["served"]))  # fmt: skip
        nb = math.ceil(L / 4)
        body = (
            f"{quiet[1]}.\n\n"
            f"plink2 --dummy {n:,} samples x {L:,} variants, 2% missing, every variant scored "
            "on its first or second allele at random, two score columns; one run each, one "
            "thread each (plink2 --threads 1; bitserve genotypes score --threads 1; "
            "torch.set_num_threads(1); bitserve score --threads 1, and with --ray --actors 1; "
            "the server with OMP_NUM_THREADS=1).\n\n"
            + markdown_table(HEADERS, rows)
            + "\n\nCPU s: user + system seconds of the process(es) doing the work (plink2's; "
            "this process's; the client's and the server's together when served; `bitserve "
            "score`'s, and with --ray the Ray processes it started and reaped), which a busy "
            "host inflates less than wall time.\n\nALLELE_CT and NAMED_ALLELE_DOSAGE_SUM "
            "equal plink2's exactly. Relative "
            "differences are |got - plink2| / max(|plink2|, 1e-3); plink2 prints 6 significant "
            "digits, so 5e-6 is its own rounding.\n\n"
            f"- bytes on the wire per sample: {nb:,} (ceil({L:,} / 4) codes) + the request's "
            "JSON header shared by its batch of samples (float32 would be "
            f"{4 * L:,}: {4 * L / nb:.0f}x).\n"
            f"- `read_bed` alone (NumPy transpose of the variant-major .bed, {n:,} x {nb:,} "
            f"bytes out): {t_read:.2f} s wall, {c_read:.2f} s CPU.\n"
            f"- `bitserve genotypes score-model` (reading the .bed for the means, writing the "
            f"folder): {t_write:.2f} s.\n"
        )
        report("genotypes", "Genotypes: plink2 --score against a served score model", body,
               smoke=args.smoke, devices=["cpu"])  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
