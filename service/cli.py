"""The ``bitserve`` command line.

    bitserve serve [--model-repository DIR] [--host H] [--port P] [... every setting]
    bitserve check-repo DIR [--device cpu] [--max-operator-bytes N]   # validate a repository
                                      # as serve loads it (dry runs included); exit 1 on problems
    bitserve demo-repo DIR       # write the built-in demo model out as a repository
    bitserve score --model-repository DIR --model M INPUT OUTPUT/   # Parquet rows on Ray Data
                                      # (a PLINK .bed: in this process, no Ray; --ray: on Ray)
    bitserve index build IN OUT_MODEL_DIR --metric tanimoto   # an [index] model folder from
                                      # Parquet / .npy packed rows or RDKit SMILES / SDF
    bitserve genotypes score-model --bim D.bim --bed D.bed --score S.txt OUT/  # plink2 --score

Every ``serve`` flag is also a ``BITSERVE_*`` environment variable (flags win); see
:class:`service.settings.Settings`. The settings (pydantic, about 0.2 s to import) are imported
only for the commands that read them (``serve``, ``check-repo``) and for ``--help``: the
other commands start without them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

if typing.TYPE_CHECKING:
    from service.settings import Settings

_SETTINGS_COMMANDS = ("serve", "check-repo")
"""The commands whose flags and defaults come from :class:`Settings`."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in typing.get_args(annotation)]
    return None


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    from service.settings import Settings

    for name, field in Settings.model_fields.items():
        help_text = (field.description or "").replace("%", "%%")
        default = field.default
        shown = "unset" if default is None else default
        env = f"BITSERVE_{name.upper()}"
        if _is_bool(field.annotation):
            parser.add_argument(
                _flag(name),
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{help_text} [env {env}; default {shown}]",
            )
            continue
        annotation = field.annotation
        if isinstance(annotation, types.UnionType):  # X | None: the flag takes X
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        parser.add_argument(
            _flag(name),
            dest=name,
            default=None,
            choices=_choices(annotation),
            metavar=name.upper() if _choices(annotation) is None else None,
            help=f"{help_text} [env {env}; default {shown}]",
        )


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Return the argument parser of the ``bitserve`` command.

    Args:
        command: the subcommand that will be parsed: the parsers of ``serve`` and
            ``check-repo`` get their flags only when it is one of them or None (every parser
            whole, for ``--help``), so the other commands never import the settings.
    """
    whole = command is None or command in _SETTINGS_COMMANDS
    parser = argparse.ArgumentParser(
        prog="bitserve",
        description="bitserve: Open Inference Protocol (KServe V2) server for bit-packed features.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the inference server",
        description="Run the server; with no --model-repository it serves the built-in demo.",
    )
    if whole:
        _add_setting_flags(serve)
    check = sub.add_parser(
        "check-repo",
        help="validate a model repository",
        description="Check every model as `serve` loads it: its files, its model's signature "
        "against the config, and a dry run at batch 1 and at max_batch_size on --device (the "
        "CPU by default); print one line per problem, exit 1 if there is any.",
    )
    check.add_argument(
        "--device",
        default="cpu",
        help="where to build and dry-run every model, whatever its config says: cpu, cuda, "
        "cuda:N or auto [default cpu]",
    )
    check.add_argument("root", type=Path, metavar="DIR")
    if whole:
        _add_check_limits(check)
    demo = sub.add_parser("demo-repo", help="write the built-in demo model as a repository")
    demo.add_argument("root", type=Path, metavar="DIR")
    from service.index import build
    from service.ray import cli as ray_cli  # imports Ray only when a Ray job runs

    ray_cli.add_parser(sub)
    build.add_parser(sub)
    from service.genotypes import cli as genotypes_cli

    genotypes_cli.add_parser(sub)
    return parser


def _add_check_limits(check: argparse.ArgumentParser) -> None:
    from service.settings import Settings

    for name, what in (("max_operator_bytes", "operators"), ("max_batch_bytes", "input buffers")):
        check.add_argument(
            _flag(name),
            metavar="N",
            default=None,
            help=f"refuse {what} bigger than this, as `serve` does [env "
            f"BITSERVE_{name.upper()}; default {Settings.model_fields[name].default}]",
        )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by the flags that were given."""
    from service.settings import Settings

    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    return Settings(**given)


def serve(settings: Settings) -> int:
    """Run the server until SIGINT/SIGTERM: in this process, or as ``settings.workers``
    worker processes under a supervisor (:mod:`service.cluster.supervisor`)."""

    from service.observability.request_ids import configure_logging

    if settings.grpc_port:
        from service.grpc.server import check_bindable

        try:  # before the models load, and without a traceback (as uvicorn says it for HTTP)
            check_bindable(settings.host, settings.grpc_port)
        except OSError as e:
            print(f"bitserve serve: {e}", file=sys.stderr)
            return 1
    log_config = configure_logging(settings.log_level)
    from service.cluster import supervisor

    gpus = supervisor.gpu_count(settings.device)
    try:
        plan = supervisor.plan_workers(
            settings.workers,
            cores=supervisor.available_cores(),
            gpus=gpus,
            omp_threads=os.environ.get("OMP_NUM_THREADS"),
            linux=sys.platform == "linux",
        )
    except ValueError as e:
        print(f"bitserve serve: workers: {e}", file=sys.stderr)
        return 2
    if plan.workers > 1:
        return supervisor.supervise(settings, plan, gpus)
    logging.getLogger("service.cluster.supervisor").info("%s: serving in this process", plan.reason)
    from service.models.devices import set_torch_threads

    set_torch_threads(plan.torch_threads, plan.interop_threads)
    from service.observability.tracing import Tracing
    from service.server import BitServer, exit_process

    exit_process(BitServer(settings, tracing=Tracing.from_environ(os.environ)).run(log_config))


def _limit(name: str, flag: str | None) -> int:
    """A size limit of check-repo: its flag, else its ``BITSERVE_`` variable, else the
    default: the limit ``serve`` would apply in the same environment, validated as the setting
    is."""
    from pydantic import TypeAdapter

    from service.settings import Settings

    field = Settings.model_fields[name]
    raw = flag if flag is not None else os.environ.get(f"BITSERVE_{name.upper()}") or None
    if raw is None:
        return int(field.default)
    adapter: TypeAdapter[int] = TypeAdapter(Annotated[int, *field.metadata])
    return adapter.validate_python(raw.strip())


def check_repo(
    root: Path,
    max_operator_bytes: str | None = None,
    max_batch_bytes: str | None = None,
    device: str = "cpu",
) -> int:
    """``bitserve check-repo``: one line per problem on stderr; 0 when valid, 1 if not, 2 for
    a bad limit or device. Never a traceback: every error is a problem of the file it came
    from. Each version is built and dry-run on ``device`` as ``serve`` builds it."""
    from pydantic import ValidationError

    from service.models.devices import resolve_device

    try:
        device = resolve_device(device, "auto")
    except ValueError as e:
        print(f"bitserve check-repo: device: {e}", file=sys.stderr)
        return 2
    limits: dict[str, int] = {}
    for name, flag in (("max_operator_bytes", max_operator_bytes),
                       ("max_batch_bytes", max_batch_bytes)):  # fmt: skip
        try:
            limits[name] = _limit(name, flag)
        except ValidationError as e:
            print(f"bitserve check-repo: {name}: {e.errors()[0]['msg']}", file=sys.stderr)
            return 2
    if not root.is_dir():
        print(f"{root}: not a folder", file=sys.stderr)
        return 1
    from service.models.builder import check_repository

    logging.basicConfig(level=logging.CRITICAL)  # the problems are printed; no log lines
    problems = check_repository(root, device=device, **limits)
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s) in {root}", file=sys.stderr)
        return 1
    print(f"{root}: OK")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bitserve`` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command(argv)).parse_args(argv)
    if args.command == "serve":
        from pydantic import ValidationError

        try:
            settings = settings_from_args(args)
        except ValidationError as e:
            for err in e.errors():
                where = ".".join(str(p) for p in err["loc"]) or "settings"
                print(f"bitserve serve: {where}: {err['msg']}", file=sys.stderr)
            return 2
        return serve(settings)
    if args.command == "check-repo":
        return check_repo(args.root, args.max_operator_bytes, args.max_batch_bytes, args.device)
    if args.command == "demo-repo":
        from service.models.demo import write_demo_repository

        try:
            path = write_demo_repository(args.root)
        except OSError as e:  # FileExistsError: never overwrite a model
            print(f"bitserve demo-repo: {e}", file=sys.stderr)
            return 1
        print(f"wrote the demo model to {path}")
        return 0
    if args.command == "index":
        from service.index import build

        return build.run(args)
    if args.command == "genotypes":
        from service.genotypes import cli as genotypes_cli

        return genotypes_cli.run(args)
    if args.command == "score":
        from service.ray import cli as ray_cli

        return ray_cli.run(args)
    raise AssertionError(args.command)  # pragma: no cover - argparse refuses other commands


if __name__ == "__main__":
    raise SystemExit(main())
