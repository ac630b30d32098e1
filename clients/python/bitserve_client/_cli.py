"""``bitserve-client``: health, metadata, the model repository, inference and a load test.

    bitserve-client [--url URL] [--token T] [--timeout S] [--retries N] COMMAND ...
    bitserve-client health [--model M]
    bitserve-client metadata MODEL [--config]
    bitserve-client index [--ready]
    bitserve-client load MODEL [--config JSON]
    bitserve-client unload MODEL
    bitserve-client infer MODEL --input NAME=FILE.npy | --input FILE.npz [...] [--output OUT.npz]
    bitserve-client infer-many MODEL --input [NAME=]FILE.npy [...] --output [NAME=]OUT.npy [...]
        [--batch-size B] [--concurrency C] [--resume] [--no-progress]
    bitserve-client search MODEL QUERIES.npy [--k K] [--threshold T] [--bitorder little]
        [--output OUT.npz]
    bitserve-client bench MODEL [--concurrency C] [--requests N] [--duration S] [--batch-size B]

The URL and token default to ``$BITSERVE_URL`` (else ``http://127.0.0.1:8000``) and
``$BITSERVE_TOKEN``. Exit status: 0 on success, 1 when the call fails (not ready, an error
answer, no connection, an unreadable file), 2 for bad usage, 141 (128 + SIGPIPE, what a
shell reports for a tool stopped by a closed pipe) without a word when stdout is closed
early, e.g. by ``| head``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from ._bench import run_bench
from ._client import Client
from ._exceptions import BitserveError

_SIGPIPE_STATUS = 128 + 13


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bitserve-client", description="Talk to a bitserve (or any V2) server."
    )
    p.add_argument("--url", help="the server (default $BITSERVE_URL, else http://127.0.0.1:8000)")
    p.add_argument("--token", help="a bearer token (default $BITSERVE_TOKEN)")
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP timeout in seconds")
    p.add_argument("--retries", type=int, default=3, help="retries on connect errors and 503")
    sub = p.add_subparsers(dest="command", required=True)

    h = sub.add_parser("health", help="is the server (or a model) live and ready")
    h.add_argument(
        "--model", help="check this model's readiness: exit 0 when it is ready (and live)"
    )

    m = sub.add_parser("metadata", help="print a model's V2 metadata as JSON")
    m.add_argument("model")
    m.add_argument("--config", action="store_true", help="print its config as well")

    x = sub.add_parser("index", help="list the repository's models and their states (JSON)")
    x.add_argument("--ready", action="store_true", help="only the ready ones")
    lo = sub.add_parser("load", help="(re)load a model from the repository")
    lo.add_argument("model")
    lo.add_argument(
        "--config", metavar="JSON", help="a config override, e.g. '{\"max_batch_size\": 4}'"
    )
    un = sub.add_parser("unload", help="stop serving a model")
    un.add_argument("model")

    inputs_help = "NAME=FILE.npy, NAME=FILE.npz (its array NAME) or FILE.npz (every array by name)"
    i = sub.add_parser("infer", help="run one inference on arrays from .npy / .npz files")
    i.add_argument("model")
    i.add_argument("--input", action="append", required=True, metavar="INPUT", help=inputs_help)
    i.add_argument("--output", metavar="OUT.npz", help="save the outputs to exactly this path")
    i.add_argument("--json", action="store_true", help="JSON tensors instead of binary")

    n = sub.add_parser("infer-many", help="bulk inference over rows of .npy files (memory-mapped)")
    n.add_argument("model")
    n.add_argument(
        "--input", action="append", required=True, metavar="[NAME=]FILE.npy",
        help="rows of one input (NAME= for a model with several); repeatable",
    )  # fmt: skip
    n.add_argument(
        "--output", action="append", required=True, metavar="[NAME=]OUT.npy",
        help="where an output's rows go (NAME= for several outputs); repeatable",
    )  # fmt: skip
    n.add_argument("--batch-size", type=int, help="rows per request (default: max_batch_size)")
    n.add_argument(
        "--concurrency", type=int, default=None,
        help="requests in flight (default: enough for two of the model's batches, 4 to 16)",
    )  # fmt: skip
    n.add_argument("--resume", action="store_true", help="keep the rows the outputs hold")
    n.add_argument("--no-progress", action="store_true")

    s = sub.add_parser(
        "search",
        help="search an index model with queries from a .npy file",
        description="Queries: (Q, L) bool / 0-1 bits, (Q, ceil(L/8)) packed uint8, or (Q, L) "
        "float embeddings (binarised by sign). Prints each query's ids and scores.",
    )
    s.add_argument("model")
    s.add_argument("queries", metavar="QUERIES.npy")
    s.add_argument("--k", type=int, help="hits per query (default: the model's k)")
    s.add_argument("--threshold", type=float, help="the least Tanimoto similarity of a hit")
    s.add_argument(
        "--bitorder", choices=["big", "little"], help="bit order of packed uint8 queries"
    )
    s.add_argument("--output", metavar="OUT.npz", help="save ids and scores to exactly this path")
    b = sub.add_parser("bench", help="load test with random valid inputs")
    b.add_argument("model")
    b.add_argument("--concurrency", type=int, default=8)
    b.add_argument("--requests", type=int, help="stop after N requests (default 200)")
    b.add_argument("--duration", type=float, help="stop after S seconds")
    b.add_argument("--batch-size", type=int, default=1, help="items per request")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-progress", action="store_true")
    return p


def _split_name(parser: argparse.ArgumentParser, item: str, what: str) -> tuple[str | None, str]:
    """``NAME=PATH`` -> (NAME, PATH); ``PATH`` -> (None, PATH)."""
    name, sep, path = item.partition("=")
    if not sep:
        return None, item
    if not name or not path:
        parser.error(f"{what} wants [NAME=]PATH, got {item!r}")
    return name, path


def _read_inputs(
    parser: argparse.ArgumentParser, items: Sequence[str]
) -> dict[str, np.ndarray[Any, Any]]:
    """The arrays of ``infer --input``: ``.npy`` files, or ``.npz`` arrays read by name."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for item in items:
        name, path = _split_name(parser, item, "--input")
        if not path.endswith(".npz"):
            if name is None:
                parser.error(f"--input wants NAME=FILE.npy or FILE.npz, got {item!r}")
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
            continue
        with np.load(path, allow_pickle=False) as npz:
            if name is None:
                arrays.update({key: npz[key] for key in npz.files})
            elif name in npz.files:
                arrays[name] = npz[name]
            elif len(npz.files) == 1:
                arrays[name] = npz[npz.files[0]]
            else:
                raise ValueError(f"{path} has no array {name!r}; it has {npz.files}")
    return arrays


def _infer(client: Client, parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    inputs = _read_inputs(parser, args.input)
    result = client.infer(args.model, inputs, binary=not args.json)
    if args.output:
        with open(args.output, "wb") as f:  # np.savez(path) would append ".npz" to the name
            arrays: dict[str, Any] = dict(result.items())
            np.savez(f, **arrays)
        print(f"wrote {', '.join(result)} to {args.output}")
        return 0
    print(f"model {result.model_name} version {result.model_version}")
    for name, arr in result.items():
        print(f"{name}: {arr.dtype} {list(arr.shape)}")
        print(np.array2string(arr, threshold=20, edgeitems=3, precision=5))
    return 0


def _named(
    parser: argparse.ArgumentParser, items: Sequence[str], what: str
) -> str | dict[str, str]:
    """One unnamed path, or NAME=PATH pairs as a dict."""
    pairs = [_split_name(parser, item, what) for item in items]
    if len(pairs) == 1 and pairs[0][0] is None:
        return pairs[0][1]
    if any(name is None for name, _ in pairs):
        parser.error(f"several {what} need a NAME= each")
    return {str(name): path for name, path in pairs}


def _infer_many(client: Client, parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    data: Any = _named(parser, args.input, "--input")
    out = _named(parser, args.output, "--output")
    # .npy files are memory-mapped by infer_many; .npz arrays are read by name.
    if isinstance(data, str) and data.endswith(".npz"):
        data = _read_inputs(parser, [data])
    elif isinstance(data, dict):
        data = {
            k: _read_inputs(parser, [f"{k}={v}"])[k] if v.endswith(".npz") else v
            for k, v in data.items()
        }
    result = client.infer_many(
        args.model,
        data,
        outputs=None if isinstance(out, str) else list(out),
        batch_size=args.batch_size,
        concurrency=args.concurrency,
        progress=not args.no_progress,
        out=out,
        resume=args.resume,
    )
    for name, path in result.paths.items():
        print(f"wrote {result.rows} rows of {name} to {path}")
    return 0


def _search(client: Client, args: argparse.Namespace) -> int:
    queries = np.load(args.queries, allow_pickle=False)
    ids, scores = client.search(
        args.model, queries, k=args.k, threshold=args.threshold, bitorder=args.bitorder
    )
    if args.output:
        with open(args.output, "wb") as f:  # np.savez(path) would append ".npz" to the name
            np.savez(f, ids=ids, scores=scores)
        print(f"wrote ids and scores {list(ids.shape)} to {args.output}")
        return 0
    rows = zip(np.atleast_2d(ids), np.atleast_2d(scores), strict=True)
    for q, (row_ids, row_scores) in enumerate(rows):
        pairs = zip(row_ids.tolist(), row_scores.tolist(), strict=True)
        hits = [f"{i}:{v:.4g}" for i, v in pairs if i >= 0]
        print(f"query {q}: {' '.join(hits) or '(no hits)'}")
    return 0


def _run(client: Client, parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "health":
        # With --model the answer is that model's own readiness (the server's is shown: one
        # other model that failed to load keeps a strict server not ready).
        checks = {"live": client.is_live(), "ready": client.is_ready()}
        if args.model:
            checks[f"model {args.model} ready"] = client.is_ready(args.model)
        for what, ok in checks.items():
            print(f"{what}: {'yes' if ok else 'no'}")
        if args.model:
            return 0 if checks["live"] and checks[f"model {args.model} ready"] else 1
        return 0 if all(checks.values()) else 1
    if args.command == "metadata":
        doc: dict[str, Any] = {"metadata": client.model_metadata(args.model)}
        if args.config:
            doc["config"] = client.model_config(args.model)
        print(json.dumps(doc if args.config else doc["metadata"], indent=2))
        return 0
    if args.command == "index":
        print(json.dumps(client.repository_index(ready=args.ready), indent=2))
        return 0
    if args.command == "load":
        try:
            config = None if args.config is None else json.loads(args.config)
        except ValueError as exc:
            parser.error(f"--config is not JSON: {exc}")
        if config is not None and not isinstance(config, dict):
            parser.error("--config must be a JSON object")
        client.load_model(args.model, config)
        print(f"loaded {args.model}")
        return 0
    if args.command == "unload":
        client.unload_model(args.model)
        print(f"unloaded {args.model}")
        return 0
    if args.command == "infer":
        return _infer(client, parser, args)
    if args.command == "infer-many":
        return _infer_many(client, parser, args)
    if args.command == "search":
        return _search(client, args)
    return run_bench(client, args)


def _quiet_broken_pipe() -> int:
    # Python would report the closed stdout again when it flushes at exit: point the file
    # descriptor at /dev/null first.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return _SIGPIPE_STATUS


def main(argv: Sequence[str] | None = None, *, transport: httpx.BaseTransport | None = None) -> int:
    """Run the CLI; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        transport: an httpx transport for the client (tests).
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        with Client(
            args.url,
            token=args.token,
            timeout=args.timeout,
            retries=args.retries,
            transport=transport,
        ) as client:
            status = _run(client, parser, args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except SystemExit as exc:  # argparse: --help (0) and usage errors (2)
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None) * 2
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except BitserveError as exc:
        print(f"bitserve-client: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # unreadable .npy files and the like
        print(f"bitserve-client: {exc}", file=sys.stderr)
        return 1
