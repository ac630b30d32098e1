"""The device memory budget at start (only what fits is built; the rest listed, built on
their first request) and shared storage (an index corpus that several versions share is
accounted once per device)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.models.repository import ModelRepository
from service.residency.budget import Accounting, NoRoom, shared_parts
from service.residency.loading import Unbuilt
from service.residency.sizes import Size
from tests.service.index_cases import random_bits, write_index
from tests.service.test_repository import run
from tests.service.test_residency import (
    ask,
    budgeted,
    one_model_bytes,
    plane,
    resident,
    write_models,
)


@pytest.fixture
def size(tmp_path: Path) -> int:
    """The bytes one model of ``write_models`` holds."""
    return one_model_bytes(tmp_path)


# --- at start ---------------------------------------------------------------------------


def test_past_the_budget_at_start_only_what_fits_is_built(
    tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_models(tmp_path / "r", "abcdef")
    builds: list[str] = []
    real = ModelRepository._build_all

    def counted(self: ModelRepository, name: str, *args: Any) -> Any:
        builds.append(name)
        return real(self, name, *args)

    monkeypatch.setattr(ModelRepository, "_build_all", counted)
    budget = 2 * size + size // 2

    async def main() -> None:
        repo = budgeted(tmp_path / "r", budget)
        await repo.start()
        assert repo.ready
        # Two fit: two are built; the four others are listed READY and never built.
        assert len(builds) == 2
        assert resident(repo) == set(builds)
        rows = repo.index()
        assert {r["state"] for r in rows} == {"READY"}
        listed = sorted(r["name"] for r in rows if not r["resident"])
        assert len(listed) == 4
        assert all(r["resident_bytes"] == 0 for r in rows if not r["resident"])
        # Listed: its config and metadata are served without a build.
        handle = repo.get(listed[0])
        assert isinstance(handle.pipeline, Unbuilt)
        assert handle.metadata()["name"] == listed[0]
        assert handle.config()["max_batch_size"] == handle.cfg.max_batch_size
        assert len(builds) == 2
        # Each answers right on its first request (built then), within the budget.
        dp = plane(repo)
        for name in "abcdef":
            await ask(dp, name)
            assert repo.accounting.used("cpu") <= budget
        assert sorted(builds[2:]) == listed
        assert not isinstance(repo.get(listed[0]).pipeline, Unbuilt)
        await repo.stop()

    run(main)


def test_within_the_budget_at_start_everything_is_built(tmp_path: Path, size: int) -> None:
    write_models(tmp_path / "r", "abc")

    async def main() -> None:
        repo = budgeted(tmp_path / "r", 3 * size)
        await repo.start()
        assert resident(repo) == {"a", "b", "c"}
        await repo.stop()

    run(main)


def test_a_listed_model_reloads_and_unloads_as_any(tmp_path: Path, size: int) -> None:
    write_models(tmp_path / "r", "abcd")

    async def main() -> None:
        repo = budgeted(tmp_path / "r", size + size // 2)
        await repo.start()
        listed = [r["name"] for r in repo.index() if not r["resident"]]
        assert len(listed) == 3
        await repo.load(listed[0])  # an explicit load builds it (room made)
        assert resident(repo) == {listed[0]}
        await repo.unload(listed[1])  # never built: unloaded all the same
        assert {r["state"] for r in repo.index() if r["name"] == listed[1]} == {"UNAVAILABLE"}
        await ask(plane(repo), listed[2])
        assert resident(repo) == {listed[2]}
        await repo.stop()

    run(main)


# --- shared storage -----------------------------------------------------------------------


def test_accounting_counts_a_shared_part_once() -> None:
    acc = Accounting(lambda device: 100)
    corpus = {("corpus", "h", "cpu"): 40}
    idle = lambda: False  # noqa: E731
    acc.reserve("a", "cpu", 10, pinned=False, busy=idle, shared=corpus)
    acc.reserve("b", "cpu", 10, pinned=False, busy=idle, shared=corpus)
    assert acc.used("cpu") == 60  # 10 + 10 + the corpus once
    assert acc.bytes_of("a") == 50  # a version's own bytes and its shared parts
    assert acc.victims("cpu", 40) == []
    assert acc.victims("cpu", 45) == ["a"]  # a's own 10 are enough
    # 55: a frees its own 10 only (b still holds the corpus); b's eviction frees the corpus.
    assert acc.victims("cpu", 55) == ["a", "b"]
    # A new version sharing the corpus needs its own bytes only, and keeps the corpus.
    assert acc.victims("cpu", 40, shared=corpus) == []
    assert acc.victims("cpu", 55, shared=corpus) == ["a", "b"]
    with pytest.raises(NoRoom, match="more than the device memory budget"):
        acc.victims("cpu", 61, shared=corpus)  # with the corpus: more than the budget
    # Another corpus counts in full.
    assert acc.victims("cpu", 10, shared={("corpus", "other", "cpu"): 40}) == ["a"]
    acc.remove("a")
    assert acc.used("cpu") == 50
    acc.remove("b")
    assert acc.used("cpu") == 0


def test_a_shared_corpus_is_accounted_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    corpus = np.packbits(random_bits(rng, 40_000, 256), axis=1)  # 1.28 MB
    other = np.packbits(random_bits(rng, 40_000, 256), axis=1)
    root = tmp_path / "r"
    write_index(root / "a", corpus)
    write_index(root / "b", corpus, metric="hamming", k=3)  # a copy: the same content
    write_index(root / "c", other)

    async def sizes() -> tuple[dict[str, int], int]:
        repo = ModelRepository(root, warmup=False, budget={"": Size(nbytes=1 << 30)})
        await repo.start()
        rows = {r["name"]: r["resident_bytes"] for r in repo.index()}
        shared = shared_parts(repo.get("a").pipeline)
        assert shared == shared_parts(repo.get("b").pipeline)  # one copy, one key
        assert shared != shared_parts(repo.get("c").pipeline)
        (corpus_bytes,) = shared.values()
        assert repo.accounting.used("cpu") == sum(rows.values()) - corpus_bytes
        await repo.stop()
        return rows, corpus_bytes

    rows, corpus_bytes = asyncio.run(sizes())
    own = {n: b - corpus_bytes for n, b in rows.items()}
    # a and b fit together (sharing their corpus), c does not fit beside them.
    budget = rows["a"] + own["b"] + own["c"] + corpus_bytes // 2

    async def main() -> None:
        repo = ModelRepository(root, warmup=False, budget={"": Size(nbytes=budget)})
        await repo.start()
        for name in "ab":
            await repo.resident(repo.get(name))
        assert resident(repo) == {"a", "b"}
        # c: evicting a alone frees its own bytes only; b goes too, and the corpus with it.
        await repo.resident(repo.get("c"))
        assert resident(repo) == {"c"}
        await repo.resident(repo.get("a"))  # two corpora do not fit: c goes
        assert resident(repo) == {"a"}
        await repo.resident(repo.get("b"))  # needs only its own bytes beside a
        assert resident(repo) == {"a", "b"}
        assert repo.accounting.used("cpu") <= budget
        await repo.stop()

    run(main)


# --- giving memory back -------------------------------------------------------------------


def test_trims_run_in_the_background_one_at_a_time() -> None:
    import threading
    import time

    from service.residency.budget import _Trimmer

    started, release = threading.Event(), threading.Event()
    running = []

    def trim() -> None:
        running.append(threading.current_thread().name)
        started.set()
        release.wait(5)

    trimmer = _Trimmer(trim)
    trimmer.soon()  # returns at once: the trim runs in its own thread
    assert started.wait(5)
    assert running == ["malloc-trim"]
    for _ in range(10):  # asked while one runs: one more run after it, not ten
        trimmer.soon()
    release.set()
    deadline = time.monotonic() + 5
    while trimmer.runs < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert trimmer.runs == 2
    trimmer.soon()  # idle again: a new run
    deadline = time.monotonic() + 5
    while trimmer.runs < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trimmer.runs == 3
