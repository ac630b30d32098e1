"""A plink2 ``--score`` file: one row per variant, a variant id, an allele and weights.

Columns are counted from 1 as plink2 counts them: ``--score FILE 1 2 3`` (id, allele, the
first weight) is plink2's default, and ``--score-col-nums 3-5`` several weight columns. A
first line whose weight fields are not numbers is a header (its names name the scores).
Rows whose id or allele is missing (``.``) are skipped, as plink2 does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path


class ScoreFileError(ValueError):
    """A score file that cannot be read; the message names the file, line and column."""


@dataclass(frozen=True)
class ScoreRows:
    """The rows of a score file, in file order."""

    ids: list[str]
    alleles: list[str]
    weights: list[list[float]]
    """One list of S weights per row."""
    names: list[str]
    """The S score columns' names (the header's, else SCORE1, SCORE2, ...)."""


def parse_columns(spec: str) -> list[int]:
    """plink2's column list: ``"3"``, ``"3-5"``, ``"3,5-6"`` -> [3, 4, 5] (1-based).

    Raises:
        ValueError: not such a list, or a column below 1.
    """
    cols: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"{spec!r} is not a column list such as 3 or 3-5 or 3,5") from None
        if a < 1 or b < a:
            raise ValueError(f"{spec!r}: columns count from 1, ranges go up")
        cols.extend(range(a, b + 1))
    return cols


def _floats(fields: list[str], cols: list[int]) -> list[float] | None:
    try:
        return [float(fields[c - 1]) for c in cols]
    except (ValueError, IndexError):
        return None


def read_score_file(
    path: Path, id_col: int = 1, allele_col: int = 2, score_cols: list[int] | None = None
) -> ScoreRows:
    """Read a score file (whitespace-separated; ``#`` starts a header line too).

    Args:
        path: the file.
        id_col, allele_col: 1-based columns of the variant id and the scored allele.
        score_cols: 1-based weight columns (default ``[3]``).

    Raises:
        ScoreFileError: a row with too few columns or a weight that is not a finite number,
            a variant named twice, or no rows; naming the file and line.
    """
    cols = score_cols or [3]
    need = max(id_col, allele_col, *cols)
    ids: list[str] = []
    alleles: list[str] = []
    weights: list[list[float]] = []
    names = [f"SCORE{k + 1}" for k in range(len(cols))]
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            f = line.split()
            if not f:
                continue
            w = _floats(f, cols)
            if n == 1 and (w is None or f[0].startswith("#")):
                if len(f) >= need:
                    names = [f[c - 1].lstrip("#") for c in cols]
                continue
            if len(f) < need:
                raise ScoreFileError(f"{path}: line {n}: {len(f)} columns, needs {need}")
            if w is None or not all(math.isfinite(x) for x in w):
                shown = [f[c - 1] for c in cols]
                raise ScoreFileError(f"{path}: line {n}: weights {shown} are not finite numbers")
            vid, allele = f[id_col - 1], f[allele_col - 1]
            if vid == "." or allele == ".":
                continue
            if vid in seen:
                raise ScoreFileError(f"{path}: line {n}: variant {vid!r} again (first on line "
                                     f"{seen[vid]})")  # fmt: skip
            seen[vid] = n
            ids.append(vid)
            alleles.append(allele)
            weights.append(w)
    if not ids:
        raise ScoreFileError(f"{path}: no score rows")
    return ScoreRows(ids, alleles, weights, names)
