"""The packages import, carry py.typed, and the console script is wired."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("module", "folder"),
    [
        ("gpu_ops", ROOT / "gpu_ops"),
        ("service", ROOT / "service"),
        ("bitserve_client", ROOT / "clients" / "python" / "bitserve_client"),
    ],
)
def test_package_is_typed(module: str, folder: Path) -> None:
    mod = importlib.import_module(module)
    assert mod.__file__ is not None
    assert (folder / "py.typed").is_file()
    assert Path(mod.__file__).resolve().parent == folder.resolve()


def test_all_is_sorted() -> None:
    for name in ("gpu_ops", "bitserve_client"):
        mod = importlib.import_module(name)
        assert list(mod.__all__) == sorted(mod.__all__), name
