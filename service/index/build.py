"""``bitserve index build``: a model folder for an ``[index]`` from packed rows or molecules.

    bitserve index build IN OUT_MODEL_DIR --metric tanimoto|hamming [--k 10] [--max-k 1000]
        [--column C] [--id-column C] [--bitorder big|little] [--radius 2] [--nbits 2048]
        [--max-batch-size 64]

``IN`` by its suffix:

- ``.parquet``: ``--column`` holds each row's packed bytes (``binary``, ``fixed_size_binary`` or
  a list of uint8), all of one length, packed with ``--bitorder``; ``--id-column`` (optional)
  holds integer ids.
- ``.npy``: uint8 ``(N, W)`` packed rows (in ``--bitorder``), or bool ``(N, L)`` bits (packed
  here in ``--bitorder``).
- ``.smi`` / ``.smiles`` / ``.sdf`` (RDKit, the ``chem`` extra): Morgan fingerprints of
  ``--radius`` and ``--nbits`` (RDKit's ``MorganGenerator``), stored as RDKit's own
  ``BitVectToBinaryText`` bytes (little bit order). A SMILES line is ``SMILES [ID]``: the
  integer IDs are the ids when every line has one; an SDF's ``--id-column`` names an integer
  property. Otherwise each molecule's id is its record number in the file (molecules RDKit
  cannot read are skipped and counted, so ids still point into the input).

Writes ``OUT_MODEL_DIR/config.toml`` and ``corpus.safetensors`` (``corpus`` (N, W) uint8,
``ids`` (N,) int64 when there are ids), never over an existing config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np

from service.text import safe_text

CORPUS_FILE = "corpus.safetensors"
CHEM_SUFFIXES = (".smi", ".smiles", ".sdf")


class BuildError(Exception):
    """The input cannot become an index; the message says why."""


def add_parser(sub: Any) -> None:
    """``bitserve index build`` under the ``bitserve`` parser's subcommands."""
    index = sub.add_parser("index", help="build search indexes (see `bitserve index build -h`)")
    verbs = index.add_subparsers(dest="index_command", required=True)
    b = verbs.add_parser(
        "build",
        help="write an [index] model folder from packed rows, bits or molecules",
        description="IN by its suffix: .parquet (--column of packed bytes, --id-column of "
        "integer ids), .npy (uint8 packed rows or bool bits), .smi/.smiles/.sdf (RDKit Morgan "
        "fingerprints of --radius and --nbits; ids: a SMILES line's integer second field, an "
        "SDF's --id-column property, else the record number). Writes config.toml and "
        "corpus.safetensors into OUT_MODEL_DIR.",
    )
    b.add_argument("input", type=Path, metavar="IN", help=".parquet, .npy, .smi/.smiles or .sdf")
    b.add_argument("out", type=Path, metavar="OUT_MODEL_DIR")
    b.add_argument("--metric", required=True, choices=["tanimoto", "hamming"])
    b.add_argument("--k", type=int, default=10, help="default hits per query [10]")
    b.add_argument("--max-k", type=int, default=1000, help="largest k a request may ask [1000]")
    b.add_argument("--max-batch-size", type=int, default=64, help="queries per batch [64]")
    b.add_argument("--column", help="Parquet: the column of packed bytes")
    b.add_argument("--id-column", help="Parquet: a column of integer ids; SDF: a property")
    b.add_argument(
        "--bitorder",
        choices=["big", "little"],
        help="bit order of the packed bytes [big; molecules: little, RDKit's]",
    )
    b.add_argument("--nbits", type=int, help="bits per row [8 x bytes; molecules: 2048]")
    b.add_argument("--radius", type=int, default=2, help="Morgan radius [2]")


def read_parquet(
    path: Path, column: str | None, id_column: str | None
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any] | None]:
    """``(rows (N, W) uint8, ids (N,) int64 or None)`` of a Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if column is None:
        raise BuildError("a Parquet input needs --column (the column of packed bytes)")
    names = [column] + ([id_column] if id_column else [])
    try:
        table = pq.read_table(path, columns=names)
    except (pa.ArrowInvalid, KeyError, OSError) as exc:
        raise BuildError(f"{path.name}: {safe_text(str(exc))}") from None
    col = table.column(column).combine_chunks()
    if col.null_count:
        raise BuildError(f"column {column!r} has {col.null_count} null rows")
    if pa.types.is_list(col.type) or pa.types.is_fixed_size_list(col.type):
        values = col.to_pylist()
        rows = np.array([np.asarray(v, dtype=np.uint8) for v in values], dtype=np.uint8)
        if rows.ndim != 2:
            raise BuildError(f"column {column!r}: rows of different lengths")
    elif pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type):
        kind = np.int64 if pa.types.is_large_binary(col.type) else np.int32
        offsets = np.frombuffer(col.buffers()[1], kind)[col.offset : col.offset + len(col) + 1]
        lengths = np.diff(offsets)
        if lengths.size and (lengths != lengths[0]).any():
            bad = int(np.flatnonzero(lengths != lengths[0])[0])
            raise BuildError(
                f"column {column!r}: row {bad} has {lengths[bad]} bytes, row 0 {lengths[0]}"
            )
        width = int(lengths[0]) if lengths.size else 0
        start = int(offsets[0]) if len(col) else 0
        data = np.frombuffer(col.buffers()[2], np.uint8)[start : start + width * len(col)]
        rows = data.reshape(len(col), width)
    elif pa.types.is_fixed_size_binary(col.type):
        width = col.type.byte_width
        data = np.frombuffer(col.buffers()[1], np.uint8)
        rows = data[col.offset * width : (col.offset + len(col)) * width].reshape(-1, width)
    else:
        raise BuildError(
            f"column {column!r} is {col.type}; needs packed bytes (binary, fixed_size_binary "
            "or a list of uint8)"
        )
    ids = None
    if id_column:
        idcol = table.column(id_column)
        if not pa.types.is_integer(idcol.type) or idcol.null_count:
            raise BuildError(f"--id-column {id_column!r} is {idcol.type}; needs integers")
        ids = idcol.to_numpy().astype(np.int64)
    return rows, ids


def read_npy(
    path: Path, bitorder: Literal["big", "little"]
) -> tuple[np.ndarray[Any, Any], int | None]:
    """``(rows (N, W) uint8, bit count or None)`` of an ``.npy`` (bool rows packed here)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise BuildError(f"{path.name}: {safe_text(str(exc))}") from None
    if arr.ndim != 2:
        raise BuildError(f"{path.name} holds shape {list(arr.shape)}; needs (N, W) or (N, L)")
    if arr.dtype == np.bool_:
        return np.packbits(arr, axis=1, bitorder=bitorder), arr.shape[1]
    if arr.dtype != np.uint8:
        raise BuildError(
            f"{path.name} holds {arr.dtype}; needs uint8 packed rows (N, W) or bool bits (N, L)"
        )
    return arr, None


def read_molecules(
    path: Path, radius: int, nbits: int, id_column: str | None
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]:
    """``(rows (N, nbits/8) uint8 little bit order, ids (N,) int64, molecules skipped)``."""
    try:
        from rdkit import Chem, DataStructs, RDLogger
        from rdkit.Chem import rdFingerprintGenerator
    except ImportError:
        raise BuildError("molecules need RDKit: pip install 'bitserve[chem]'") from None
    RDLogger.DisableLog("rdApp.*")  # type: ignore[attr-defined]
    gen = rdFingerprintGenerator.GetMorganGenerator(radius=radius, fpSize=nbits)
    records: list[tuple[Any, Any]] = []  # (molecule or None, id text or None)
    if path.suffix == ".sdf":
        for mol in Chem.SDMolSupplier(str(path)):
            given = None
            if mol is not None and id_column:
                given = mol.GetProp(id_column) if mol.HasProp(id_column) else None
            records.append((mol, given))
    else:
        with path.open(encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                if not fields:
                    continue
                mol = Chem.MolFromSmiles(fields[0])
                records.append((mol, fields[1] if len(fields) > 1 else None))
    given_ids = [g for _, g in records]
    use_given = bool(records) and all(g is not None and _is_int(g) for g in given_ids)
    if path.suffix == ".sdf" and id_column and not use_given:
        raise BuildError(f"SD property {id_column!r} is missing or not an integer on some records")
    rows, ids, skipped = [], [], 0
    for number, (mol, given) in enumerate(records):
        if mol is None:
            skipped += 1
            continue
        fp = gen.GetFingerprint(mol)
        rows.append(np.frombuffer(DataStructs.BitVectToBinaryText(fp), np.uint8))
        ids.append(int(given) if use_given else number)
    if not rows:
        raise BuildError(f"{path.name}: no molecule RDKit could read ({skipped} skipped)")
    return np.stack(rows), np.asarray(ids, np.int64), skipped


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def config_text(metric: str, nbits: int, bitorder: str, k: int, max_k: int, mbs: int) -> str:
    """The ``config.toml`` of an index model."""
    return f"""\
max_batch_size = {mbs}

[[inputs]]
name = "query"
datatype = "BOOL"
shape = [{nbits}]
packing = "bits"
bitorder = "{bitorder}"

[index]
file = "{CORPUS_FILE}"
metric = "{metric}"
k = {k}
max_k = {max_k}

[[outputs]]
name = "ids"
datatype = "INT64"

[[outputs]]
name = "scores"
datatype = "FP32"
"""


def build(args: argparse.Namespace) -> str:
    """Write the model folder; returns what was written, as a line.

    Raises:
        BuildError: a bad input or option, or a folder that already holds a config.
    """
    from service.models.config import CONFIG_FILE, MAX_K

    src: Path = args.input
    suffix = src.suffix.lower()
    if not src.is_file():
        raise BuildError(f"{src}: no such file")
    if not 1 <= args.k <= args.max_k <= MAX_K:
        raise BuildError(f"needs 1 <= --k ({args.k}) <= --max-k ({args.max_k}) <= {MAX_K}")
    ids: np.ndarray[Any, Any] | None = None
    skipped = 0
    if suffix in CHEM_SUFFIXES:
        nbits = args.nbits or 2048
        bitorder = args.bitorder or "little"
        if bitorder != "little":
            raise BuildError("RDKit's fingerprint bytes are little bit order (--bitorder little)")
        rows, ids, skipped = read_molecules(src, args.radius, nbits, args.id_column)
    elif suffix == ".parquet":
        bitorder = args.bitorder or "big"
        rows, ids = read_parquet(src, args.column, args.id_column)
        nbits = args.nbits or 8 * rows.shape[1]
    elif suffix == ".npy":
        order: Literal["big", "little"] = "little" if args.bitorder == "little" else "big"
        bitorder = order
        rows, logical = read_npy(src, order)
        nbits = args.nbits or logical or 8 * rows.shape[1]
    else:
        raise BuildError(f"{src.name}: needs .parquet, .npy, {', '.join(CHEM_SUFFIXES)}")
    if rows.shape[0] < args.k:
        raise BuildError(f"{rows.shape[0]} rows, fewer than --k {args.k}")
    if (nbits + 7) // 8 != rows.shape[1]:
        raise BuildError(
            f"--nbits {nbits} needs {(nbits + 7) // 8} bytes a row; rows have {rows.shape[1]}"
        )
    if ids is not None and np.unique(ids).size != ids.size:
        raise BuildError("the ids are not unique")
    out: Path = args.out
    if (out / CONFIG_FILE).exists():
        raise BuildError(f"{out / CONFIG_FILE} exists; not overwritten")
    out.mkdir(parents=True, exist_ok=True)
    from safetensors.numpy import save_file

    tensors = {"corpus": np.ascontiguousarray(rows, np.uint8)}
    if ids is not None:
        tensors["ids"] = np.ascontiguousarray(ids, np.int64)
    save_file(tensors, str(out / CORPUS_FILE))
    text = config_text(args.metric, nbits, bitorder, args.k, args.max_k, args.max_batch_size)
    (out / CONFIG_FILE).write_text(text, encoding="utf-8")
    more = f" ({skipped} molecules RDKit could not read skipped)" if skipped else ""
    return f"wrote {out}: {rows.shape[0]} rows of {nbits} bits, {args.metric}{more}"


def run(args: argparse.Namespace) -> int:
    """``bitserve index build``: 0 when written, 1 with the reason on stderr."""
    from service.models.config import ConfigError  # here: `bitserve --help` stays light

    try:
        print(build(args))
    except (BuildError, ConfigError) as exc:
        print(f"bitserve index build: {exc}", file=sys.stderr)
        return 1
    return 0
