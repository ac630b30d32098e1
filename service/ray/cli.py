"""``bitserve score``: the command line of :func:`service.ray.job.score_files` and, for a
PLINK ``.bed`` without ``--address``, of :func:`service.ray.bed_local.score_bed_here`.

    bitserve score --model-repository R --model M INPUT OUTPUT/ [--address ADDR] [...]

Parquet input: without ``--address`` it starts a Ray of its own, embedded in the process (this
machine's CPUs and GPUs), even where a local cluster runs; with it (``auto``: the local
cluster), it joins that cluster. Ray Data's own progress bars show the reads, the scoring and
the writes. A ``.bed`` without ``--address`` is scored in this process, no Ray (its start-up
would outlast the work), into the same output files; ``--ray`` scores it on a Ray of its own
instead. The options that only place Ray's actors and tasks (``--actors``, ``--num-gpus``,
``--num-cpus``, ``--rows-per-task``, ``--resources``) and those a ``.bed`` cannot use
(``--bitorder``: its codes are PLINK's; ``--k``, ``--threshold``: an index's) are refused
there, naming ``--ray``, rather than ignored. Run it again with the same arguments to
resume: rows already in OUTPUT are skipped, whichever way they were written.

This module imports Ray only when a Ray job runs (``bitserve --help`` stays fast).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
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
        help="score Parquet files of packed rows on Ray Data (needs the ray extra), or a "
        "PLINK .bed in this process",
        description="Score every row of INPUT (a Parquet file or a folder of them; a path "
        "or a URI such as s3://) with a model of a repository, on Ray Data: one actor per "
        "GPU, or CPU actors. Each input file NAME.parquet gets an output folder OUTPUT/NAME/ "
        "of files <start>-<stop>.parquet (its rows start..stop-1): the model's outputs, one "
        "column each, beside every column that is not an input. Resumable: run it again "
        "and the rows already written are skipped. A PLINK NAME.bed without --address is "
        "scored in this process, without Ray (the C kernel for a score-model folder on the "
        "CPU, else the model as serve loads it), into the same OUTPUT/NAME/ files; --ray "
        "scores it on Ray instead. The Ray-only options (--actors, --num-gpus, --num-cpus, "
        "--rows-per-task, --resources), and --bitorder, --k and --threshold, which a .bed "
        "cannot use, are refused there (exit 2) rather than ignored.",
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
        "[default: start Ray in this process; a .bed: no Ray, see --ray]",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="score a .bed on a Ray of its own, as a Parquet input is [default without "
        "--address: in this process, no Ray]",
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
        "(a 2-core machine) takes every CPU of the node]; a .bed in this process: its "
        "threads [default: every CPU it may use]",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="device for models whose config says auto [default: the actor's GPU, else cpu; "
        "a .bed in this process: the C kernel where the model allows, else the GPU if any]",
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
        yield str(bed_as_parquet(Path(args.input), Path(tmp), cfg, args.model))


RAY_ONLY = ("actors", "num_gpus", "num_cpus", "rows_per_task", "resources")
"""Options that place Ray's actors and tasks: nothing to place in one process."""
NOT_FOR_BED = ("bitorder", "k", "threshold")
"""Options a ``.bed`` cannot use: its codes are in PLINK's order; ``k`` and ``threshold``
are an index's."""


def run(args: argparse.Namespace) -> int:
    """Run ``bitserve score``; the exit status: 0 done, 1 failed, 2 bad usage."""
    for flag, value in (("--actors", args.actors), ("--rows-per-task", args.rows_per_task),
                        ("--threads", args.threads)):  # fmt: skip
        if value is not None and value < 1:
            print(f"bitserve score: {flag} must be at least 1", file=sys.stderr)
            return 2
    if args.input.endswith(".bed") and args.address is None and not args.ray:
        return _run_here(args)
    return _run_on_ray(args)


def _run_here(args: argparse.Namespace) -> int:
    """A ``.bed`` scored in this process (:mod:`service.ray.bed_local`)."""
    for name in (*RAY_ONLY, *NOT_FOR_BED):
        if getattr(args, name) is not None:
            flag = "--" + name.replace("_", "-")
            why = ("places Ray's actors" if name in RAY_ONLY
                   else "does not apply to a .bed's codes")  # fmt: skip
            print(f"bitserve score: {flag} {why}; a .bed without --address is scored in "
                  "this process, without Ray (add --ray to score it on Ray)",
                  file=sys.stderr)  # fmt: skip
            return 2
    if importlib.util.find_spec("pyarrow") is None:
        print("bitserve score: needs pyarrow: pip install 'bitserve[ray]' (or pyarrow alone, "
              "for a .bed scored without Ray)", file=sys.stderr)  # fmt: skip
        return 1
    from service.ray.bed_local import score_bed_here
    from service.ray.outputs import IncompleteOutput

    try:
        report = score_bed_here(args.input, args.output, args.model_repository, args.model,
                                version=args.version, device=args.device,
                                threads=args.threads, keep_inputs=args.keep_inputs)  # fmt: skip
    except (IncompleteOutput, ValueError) as e:  # ScoringError, PlinkError
        print(f"bitserve score: {e}", file=sys.stderr)
        return 1
    print(report.line())
    return 0


def _run_on_ray(args: argparse.Namespace) -> int:
    """A Ray job (:func:`service.ray.job.score_files`), a ``.bed`` written as Parquet first."""
    if args.input.endswith(".bed") and args.bitorder is not None:
        print("bitserve score: --bitorder does not apply to a .bed's codes (PLINK's order)",
              file=sys.stderr)  # fmt: skip
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
    from service.ray.job import score_files
    from service.ray.outputs import IncompleteOutput
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
    print(report.line())
    return 0
