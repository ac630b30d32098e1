"""Regenerate the protobuf modules of this folder from its ``.proto`` files.

    python -m service.grpc.proto.generate          # rewrite the *_pb2.py/.pyi files here
    python -m service.grpc.proto.generate --check  # exit 1 if they are not current

The ``.proto`` files are Triton's, unchanged (see ``LICENSE`` and ``README.md`` here). The
generated code is committed, so a server needs only ``protobuf`` at run time; this script
needs ``grpcio-tools`` at the version pinned in ``pyproject.toml`` (its protoc decides the
exact output, which ``tests/service/test_grpc_proto.py`` compares with the committed files).

Two edits make protoc's output a package of its own:

* imports between the generated modules are absolute (``from service.grpc.proto import
  model_config_pb2``), not top-level modules;
* the descriptors go to a private pool (``service.grpc.proto._pool.POOL``), not protobuf's
  default one: ``tritonclient.grpc`` registers the same ``inference`` messages (of its own
  version of these files) in the default pool, and a process may import both.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("model_config.proto", "grpc_service.proto", "health.proto")
PACKAGE = "service.grpc.proto"
_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def _postprocess(name: str, text: str) -> str:
    text = _IMPORT.sub(rf"from {PACKAGE} import \1 as \2", text)
    if name.endswith(".py"):
        default = "_descriptor_pool.Default().AddSerializedFile("
        if default not in text:
            raise RuntimeError(f"{name}: protoc's output changed shape ({default!r} not found)")
        text = text.replace(default, "POOL.AddSerializedFile(")
        text = text.replace(
            "# @@protoc_insertion_point(imports)\n",
            f"# @@protoc_insertion_point(imports)\nfrom {PACKAGE}._pool import POOL\n",
            1,
        )
    return text


def generate(out: Path) -> list[Path]:
    """Run protoc over the ``.proto`` files here, writing the edited modules to ``out``.

    Returns:
        the files written.
    """
    from grpc_tools import protoc  # dev/test dependency only

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{HERE}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            *(str(HERE / p) for p in PROTOS),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        written = []
        for src in sorted(Path(tmp).iterdir()):
            dst = out / src.name
            dst.write_text(_postprocess(src.name, src.read_text()))
            written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    """Regenerate in place, or with ``--check`` report whether the committed files are current."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if stale")
    args = parser.parse_args(argv)
    if not args.check:
        for path in generate(HERE):
            print(f"wrote {path.relative_to(HERE.parents[2])}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [
            p.name
            for p in generate(Path(tmp))
            if not (HERE / p.name).exists() or (HERE / p.name).read_text() != p.read_text()
        ]
    for name in stale:
        print(f"{name} is not current: run python -m {PACKAGE}.generate", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
