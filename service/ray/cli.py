"""``bitserve score``: the command line of :func:`service.ray.job.score_files`.

    bitserve score --model-repository R --model M INPUT OUTPUT/ [--address ADDR] [...]

Without ``--address`` it starts a Ray of its own, embedded in the process (this machine's CPUs
and GPUs), even where a local cluster runs; with it (``auto``: the local cluster), it joins that
cluster. Ray Data's own progress bars show the reads, the scoring and the writes. Run
it again with the same arguments to resume: rows already in OUTPUT are skipped.

This module imports Ray only when the command runs (``bitserve --help`` stays fast).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """Add the ``score`` command to the ``bitserve`` subcommands."""
    p = sub.add_parser(
        "score",
        help="score Parquet files of packed rows on Ray Data (needs the ray extra)",
        description="Score every row of INPUT (a Parquet file or a folder of them; a path "
        "or a URI such as s3://) with a model of a repository, on Ray Data: one actor per "
        "GPU, or CPU actors. Each input file NAME.parquet gets an output folder OUTPUT/NAME/ "
        "of files <start>-<stop>.parquet (its rows start..stop-1): the model's outputs, one "
        "column each, beside every column that is not an input. Resumable: run it again "
        "and the rows already written are skipped.",
    )
    p.add_argument(
        "--model-repository",
        required=True,
        metavar="DIR",
        help="the model repository (every node must see it at this path)",
    )
    p.add_argument("--model", required=True, help="the model's name")
    p.add_argument(
        "--model-version",
        dest="version",
        default=None,
        metavar="V",
        help="the model version [default: the highest]",
    )
    p.add_argument(
        "--address",
        default=None,
        help="a Ray cluster to join (e.g. auto, ray://head:10001, 10.0.0.1:6379) "
        "[default: start Ray in this process]",
    )
    p.add_argument(
        "--actors",
        type=int,
        default=None,
        metavar="N",
        help="a fixed number of scoring actors [default: one per GPU; without "
        "GPUs from 1 up to the CPUs less one]",
    )
    p.add_argument(
        "--num-gpus",
        type=float,
        default=None,
        metavar="G",
        help="GPUs per actor [default: 1 on a cluster with GPUs, else 0]",
    )
    p.add_argument(
        "--num-cpus",
        type=float,
        default=None,
        metavar="C",
        help="CPUs per actor [default 1]",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="T",
        help="torch threads per actor [default: its CPUs; a CPU actor alone on its node "
        "(a 2-core machine) takes every CPU of the node]",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="device for models whose config says auto [default: the actor's GPU, else cpu]",
    )
    p.add_argument(
        "--bitorder",
        choices=["big", "little"],
        default=None,
        help="bit order of the packed columns [default: the model's]",
    )
    p.add_argument("--k", type=int, default=None, help="an index model's hits per row")
    p.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="a Tanimoto index's least similarity of a hit",
    )
    p.add_argument(
        "--keep-inputs",
        action="store_true",
        help="also write the input columns (by default they are left out)",
    )
    p.add_argument(
        "--rows-per-task",
        type=int,
        default=None,
        metavar="N",
        help="rows a read task reads [default 262144]",
    )
    p.add_argument(
        "--resources",
        default=None,
        metavar="JSON",
        help="custom Ray resources per actor, e.g. '{\"scorer\": 1}'",
    )
    p.add_argument("input", metavar="INPUT", help="a Parquet file or folder (path or URI), or "
                   "a PLINK .bed (its .bim and .fam beside it; FID and IID are passed "
                   "through) for a genotype model")  # fmt: skip
    p.add_argument("output", metavar="OUTPUT", help="the output folder (path or URI)")  # fmt: skip


@contextlib.contextmanager
def _bed_as_parquet(args: argparse.Namespace) -> Iterator[str]:
    """The input to score: ``args.input`` itself, or for a PLINK ``.bed`` a Parquet file of
    its samples in a temporary folder (:mod:`service.ray.bed_input`), removed afterwards."""
    if not args.input.endswith(".bed"):
        yield args.input
        return
    from service.ray.bed_input import bed_as_parquet
    from service.ray.scorer import read_config

    _, cfg = read_config(Path(args.model_repository).resolve(), args.model, args.version)
    with tempfile.TemporaryDirectory(prefix="bitserve-bed-") as tmp:
        yield str(bed_as_parquet(Path(args.input), Path(tmp), cfg))


def run(args: argparse.Namespace) -> int:
    """Run ``bitserve score``; the exit status: 0 done, 1 failed, 2 bad usage."""
    for flag, value in (("--actors", args.actors), ("--rows-per-task", args.rows_per_task),
                        ("--threads", args.threads)):  # fmt: skip
        if value is not None and value < 1:
            print(f"bitserve score: {flag} must be at least 1", file=sys.stderr)
            return 2
    extra: dict[str, Any] = {}
    if args.resources is not None:
        try:
            extra["resources"] = json.loads(args.resources)
        except ValueError as e:
            print(f"bitserve score: --resources: not JSON: {e}", file=sys.stderr)
            return 2
    if args.rows_per_task is not None:
        extra["rows_per_task"] = args.rows_per_task
    try:
        import ray
    except ImportError:
        print("bitserve score: needs Ray: pip install 'bitserve[ray]'", file=sys.stderr)
        return 1
    from service.ray.job import IncompleteOutput, score_files
    from service.ray.scorer import ScoringError

    # Ray Data's import (about 1 s on a 2-core host) runs while ray.init waits for Ray's
    # processes to start, instead of after it, before the job can start its actors.
    preload = threading.Thread(target=importlib.import_module, args=("ray.data",), daemon=True)
    preload.start()
    if args.address is None:  # a new Ray of its own, even where a local cluster runs
        ray.init(address="local", include_dashboard=False)
    else:
        ray.init(address=args.address)
    preload.join()
    try:
        with _bed_as_parquet(args) as source:
            report = score_files(
                source,
                args.output,
                args.model_repository,
                args.model,
                version=args.version,
                keep_inputs=args.keep_inputs,
                bitorder=args.bitorder,
                parameters={
                    key: value
                    for key, value in (("k", args.k), ("threshold", args.threshold))
                    if value is not None
                },
                device=args.device,
                actors=args.actors,
                num_gpus=args.num_gpus,
                num_cpus=args.num_cpus,
                threads=args.threads,
                **extra,
            )
    except (ScoringError, IncompleteOutput, ValueError) as e:
        print(f"bitserve score: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    print(
        f"{report.output}: {report.scored} row(s) scored, {report.skipped} already there, "
        f"{report.files} file(s), {report.seconds:.1f} s ({report.rows_per_s:,.0f} rows/s)"
    )
    return 0
