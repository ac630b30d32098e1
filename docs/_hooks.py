"""MkDocs hook: links from a docs page to repository files outside ``docs/``.

The pages link to the repository's other files as GitHub shows them, relatively
(``[results](../benchmarks/results/e2e.md)``), so that a page reads right on GitHub. MkDocs
knows only the files under ``docs/`` and would warn about every such link (which fails
``mkdocs build --strict``), so this hook checks them itself: a link whose target is not a file
or folder of the repository fails the build, naming the page and the link. In the built site
such a link points at ``repo_url``'s copy of the file when mkdocs.yml sets ``repo_url``, else at
the file in the checkout that the site was built in (``site/`` beside ``docs/``).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

# A Markdown link or image target: ](target) or ](target "title").
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)(?P<rest>[^)]*)\)")
_SCHEME = "bitserve-repo:"


def _outside_target(page_src: Path, docs_dir: Path, target: str) -> str | None:
    """The repository-relative path of ``target`` if it leaves ``docs/``, else None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return None
    path = target.split("#", 1)[0]
    if not path:
        return None
    resolved = (page_src.parent / path).resolve()
    if resolved.is_relative_to(docs_dir.resolve()):
        return None
    return target


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Check each link out of ``docs/`` and mark it so MkDocs' own check leaves it alone."""
    docs_dir = Path(config["docs_dir"])
    root = docs_dir.parent.resolve()
    page_src = Path(page.file.abs_src_path)

    def rewrite(match: re.Match[str]) -> str:
        target = match.group("target")
        if _outside_target(page_src, docs_dir, target) is None:
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = (page_src.parent / path).resolve()
        if not resolved.is_relative_to(root) or not resolved.exists():
            raise PluginError(f"{page.file.src_uri}: link to {target!r}: no such file")
        repo_path = resolved.relative_to(root).as_posix()
        return f"]({_SCHEME}{repo_path}{'#' + anchor if anchor else ''}{match.group('rest')})"

    return _LINK.sub(rewrite, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Point the marked links at the repository's copy of each file."""
    repo_url = (config.get("repo_url") or "").rstrip("/")
    root = Path(config["docs_dir"]).parent.resolve()
    site = Path(config["site_dir"]).resolve()
    page_dir = posixpath.dirname(page.url) if not page.url.endswith("/") else page.url

    def rewrite(match: re.Match[str]) -> str:
        repo_path = match.group(2)
        if repo_url:
            url = f"{repo_url}/blob/main/{repo_path}"
        else:
            here = site.relative_to(root).as_posix() if site.is_relative_to(root) else "site"
            url = posixpath.relpath(repo_path, posixpath.join(here, page_dir))
        return f'{match.group(1)}="{url}'

    return re.sub(rf'(href|src)="{re.escape(_SCHEME)}([^"#]*)', rewrite, html)
