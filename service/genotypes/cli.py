"""``bitserve genotypes score-model``: write a ``[score]`` model folder (see
:mod:`service.genotypes.writer`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """Add ``genotypes`` and its ``score-model`` sub-command to ``bitserve``'s sub-parsers."""
    from service.genotypes.score_file import parse_columns

    genotypes = sub.add_parser("genotypes", help="genotype (PLINK) models")
    gsub = genotypes.add_subparsers(dest="genotypes_command", required=True)
    p = gsub.add_parser(
        "score-model",
        help="write a plink2 --score model folder from a .bed/.bim and a score file",
        description="Write a model folder that serves plink2 --score: ALLELE_CT, "
        "NAMED_ALLELE_DOSAGE_SUM, SCORE_AVG and SCORE_SUM per sample, missing genotypes "
        "mean-imputed from the .bed (founders), weights on either allele. Columns count from "
        "1, as plink2's --score i j k and --score-col-nums.",
    )
    p.add_argument("--bim", type=Path, required=True, help="the data set's .bim")
    p.add_argument("--bed", type=Path, required=True, help="its .bed (variant-major)")
    p.add_argument("--fam", type=Path, default=None, help="its .fam [default: beside --bed]")
    p.add_argument("--score", type=Path, required=True, help="the score file")
    p.add_argument("--id-col", type=int, default=1, help="variant id column [default 1]")
    p.add_argument("--allele-col", type=int, default=2, help="allele column [default 2]")
    p.add_argument("--score-cols", type=parse_columns, default=[3],
                   help="weight columns, e.g. 3 or 3-5 or 3,6 [default 3]")  # fmt: skip
    p.add_argument("--max-batch-size", type=int, default=1024,
                   help="the model's max_batch_size [default 1024]")  # fmt: skip
    p.add_argument("out", type=Path, metavar="OUT_MODEL_DIR")
    q = gsub.add_parser(
        "score",
        help="score every sample of a .bed with a score model, in this process",
        description="Score every sample of a .bed (its .bim and .fam beside it) with a score "
        "model of a repository, in this process (no server, no Ray), and write plink2's "
        ".sscore columns: #FID IID ALLELE_CT NAMED_ALLELE_DOSAGE_SUM SCOREk_AVG SCOREk_SUM.",
    )
    q.add_argument("--model-repository", type=Path, required=True, metavar="DIR")
    q.add_argument("--model", required=True)
    q.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N [default cpu]")
    q.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads [default: every CPU this process may use]")  # fmt: skip
    q.add_argument("bed", type=Path, metavar="DATA.bed")
    q.add_argument("out", type=Path, metavar="OUT.sscore")


def run(args: argparse.Namespace) -> int:
    """Run ``bitserve genotypes ...``: 0 on success, 1 with one line on stderr if not."""
    if args.genotypes_command == "score":
        return _score(args)
    from service.genotypes.writer import write_score_model

    try:
        report = write_score_model(
            args.bim, args.bed, args.score, args.out, fam=args.fam, id_col=args.id_col,
            allele_col=args.allele_col, score_cols=args.score_cols,
            max_batch_size=args.max_batch_size,
        )  # fmt: skip
    except (OSError, ValueError) as e:  # PlinkError, ScoreFileError, FileExistsError
        print(f"bitserve genotypes score-model: {e}", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    return 0


def _score(args: argparse.Namespace) -> int:
    """The torch-free path (:mod:`service.genotypes.fast`) for a CPU and a folder as
    score-model writes it, else the model loaded as ``bitserve serve`` loads it."""
    from service.models.config import ConfigError

    if args.threads is not None and args.threads < 1:
        print("bitserve genotypes score: --threads must be at least 1", file=sys.stderr)
        return 2
    try:
        result = _score_either(args)
    except ConfigError as e:
        print("\n".join(e.problems), file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"bitserve genotypes score: {e}", file=sys.stderr)
        return 1
    print(f"{args.out}: {len(result['SCORE_SUM'])} samples scored")
    return 0


def _score_either(args: argparse.Namespace) -> dict[str, Any]:
    from service.genotypes import fast

    threads = args.threads or fast.default_threads()
    if args.device == "cpu":
        fm = fast.load_fast_model(args.model_repository, args.model)
        if isinstance(fm, fast.FastScoreModel):
            return fast.score_bed_fast(fm, args.bed, args.out, threads=threads)
        print(f"bitserve genotypes score: {fm}: loading it as serve does", file=sys.stderr)
    import torch

    from service.genotypes.bulk import score_bed

    torch.set_num_threads(threads)
    return score_bed(args.model_repository, args.model, args.bed, args.out, device=args.device)
