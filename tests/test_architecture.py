"""The shape of ``service/``: no import circles, no module over 500 lines, no flat heap of
modules at its top.

Imports are read from the source (``ast``), every one of them: at module level, under
``if TYPE_CHECKING:`` and inside functions alike, so a circle cannot hide in a deferred import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICE = ROOT / "service"
MAX_LINES = 500
# protoc's output: generated, not written
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def service_modules() -> dict[str, Path]:
    return {
        module_name(p): p for p in sorted(SERVICE.rglob("*.py")) if not p.name.endswith(GENERATED)
    }


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``name``) imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                # `import a.b.c` binds a and imports a.b.c: the edge is to the deepest known
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target:
                    found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    found.add(sub)  # `from pkg import module`
                elif source in known:
                    found.add(source)
    found.discard(name)
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def import_graph() -> dict[str, set[str]]:
    modules = service_modules()
    known = set(modules)
    return {name: imports_of(path, name, known) for name, path in modules.items()}


def test_the_reader_sees_a_planted_circle(tmp_path: Path) -> None:
    """The checker itself: two modules importing each other, one deferred, are a circle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    (tmp_path / "m.py").write_text("def f():\n    from service.x import y\n")
    known = {"service.x", "service.x.y"}
    assert imports_of(tmp_path / "m.py", "service.m", known) == {"service.x.y"}


def test_service_has_no_import_circle() -> None:
    circles = strongly_connected(import_graph())
    shown = "\n".join(" <-> ".join(c) for c in circles)
    assert not circles, f"import circles in service/:\n{shown}"


@pytest.mark.parametrize("name", sorted(service_modules()))
def test_no_module_is_over_500_lines(name: str) -> None:
    lines = service_modules()[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES})"


def test_service_top_holds_few_modules() -> None:
    """service/ is rooms (packages) and the few modules every room shares: no flat heap."""
    top = sorted(p.stem for p in SERVICE.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 12, f"{len(top)} modules at the top of service/: {top}"
