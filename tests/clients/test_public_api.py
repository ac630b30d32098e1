"""The public surface of bitserve_client is exactly the documented one.

The package's names are listed in its docstring and in ``__all__``; the clients' and the
results' public members are the lists below, which the client's page (docs/client.md) names too.
Anything else (helpers of the clients, modules) has a leading underscore.
"""

from __future__ import annotations

import re
from pathlib import Path

import bitserve_client
import pytest
from bitserve_client import (
    AsyncClient,
    BulkInferenceError,
    BulkResult,
    Client,
    InferResult,
    ServerError,
)

ROOT = Path(__file__).resolve().parents[2]
CLIENT_PAGE = ROOT / "docs" / "client.md"
ELSEWHERE = {"search": ROOT / "docs" / "search.md"}
"""Methods documented on a page of their own instead of the client page."""

CLIENT = [
    "close",
    "infer",
    "infer_iter",
    "infer_many",
    "is_closed",
    "is_live",
    "is_ready",
    "load_model",
    "model_config",
    "model_metadata",
    "model_spec",
    "repository_index",
    "search",
    "server_metadata",
    "unload_model",
    "url",
]
ASYNC_CLIENT = sorted([*(n for n in CLIENT if n != "close"), "aclose"])
MAPPING = ["get", "items", "keys", "values"]
INFER_RESULT = sorted(
    [
        *MAPPING,
        *("as_numpy", "get_output", "headers", "id", "model_name", "model_version"),
        *("parameters", "request_id"),
    ]
)
BULK_RESULT = sorted([*MAPPING, "as_numpy", "model_name", "paths", "rows"])


def public(obj: object) -> list[str]:
    return sorted(n for n in dir(obj) if not n.startswith("_"))


def documented_names() -> list[str]:
    doc = bitserve_client.__doc__ or ""
    listing = doc[doc.index("Public API") :]
    return re.findall(r"^- ``(\w+)``: ", listing, re.MULTILINE)


def test_all_is_sorted_and_is_the_documented_list() -> None:
    assert list(bitserve_client.__all__) == sorted(bitserve_client.__all__)
    assert documented_names() == list(bitserve_client.__all__)


def test_the_package_has_no_other_public_names() -> None:
    assert public(bitserve_client) == sorted(set(bitserve_client.__all__) - {"__version__"})


@pytest.mark.parametrize(
    ("cls", "expected"),
    [
        (Client, CLIENT),
        (AsyncClient, ASYNC_CLIENT),
        (InferResult, INFER_RESULT),
        (BulkResult, BULK_RESULT),
    ],
)
def test_class_surfaces(cls: type, expected: list[str]) -> None:
    members = public(cls)
    slots = [n for c in cls.__mro__ for n in getattr(c, "__slots__", ())]
    members = sorted({*members, *(n for n in slots if not n.startswith("_"))})
    assert members == expected


def test_readme_names_every_client_method() -> None:
    section = CLIENT_PAGE.read_text()
    names = {*CLIENT, *ASYNC_CLIENT, *INFER_RESULT, *BULK_RESULT} - set(MAPPING)
    for name in sorted(names - set(ELSEWHERE)):
        assert re.search(rf"\b{name}\b", section), f"docs/client.md lacks {name}"
    for name, page in ELSEWHERE.items():
        assert f"Client.{name}(" in page.read_text(), f"{page.name} lacks Client.{name}"


def test_error_attributes() -> None:
    err = ServerError(503, "busy", retry_after=2.0, request_id="r1")
    assert (err.status, err.message, err.retry_after, err.request_id) == (503, "busy", 2.0, "r1")
    assert str(err) == "HTTP 503: busy"
    bulk = BulkInferenceError(
        "stopped", rows_done=3, total=9, result=BulkResult({}, model_name="m", rows=3)
    )
    assert (bulk.rows_done, bulk.total, bulk.result.rows) == (3, 9, 3)


def test_version_is_the_distributions() -> None:
    import tomllib

    pyproject = ROOT / "clients" / "python" / "pyproject.toml"
    with pyproject.open("rb") as f:
        assert tomllib.load(f)["project"]["version"] == bitserve_client.__version__
