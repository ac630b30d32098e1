"""The device memory budget in-process: eviction order, pinned and busy versions, loads on
demand (shared, failing, racing unloads), refusals, metrics; and the pieces of
``service.residency.budget`` / ``service.residency.sizes`` on their own."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from service.dataplane import DataPlane
from service.errors import DeadlineExceeded, InvalidInput, ModelNotReady
from service.models.handle import ModelHandle
from service.models.repository import ModelRepository
from service.observability.metrics import Metrics
from service.protocol.types import InferRequest, InferResponse
from service.residency.budget import Accounting, NoRoom, budget_bytes, held_bytes, release
from service.residency.sizes import Size, parse_budget, parse_cache_config, parse_size
from service.settings import Settings
from tests.service.test_repository import (
    bits_of,
    boxcar_reference,
    cfg_text,
    request,
    run,
    write,
)

# --- sizes and settings -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1234", Size(nbytes=1234)),
        ("8GiB", Size(nbytes=8 << 30)),
        ("500 MB", Size(nbytes=500_000_000)),
        ("1.5KiB", Size(nbytes=1536)),
        ("75%", Size(fraction=0.75)),
    ],
)
def test_parse_size(text: str, size: Size) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "x", "0", "-1GB", "101%", "0%", "5 parsecs", "1e9"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match=r"size|percentage|budget|unit"):
        parse_size(text)


def test_budget_per_device_and_shares() -> None:
    budget = parse_budget("cpu=4GiB,cuda:1=50%,1GiB")
    assert budget_bytes(budget, "cpu") == 4 << 30
    assert budget_bytes(budget, "cpu", sharers=4) == 1 << 30
    assert budget_bytes(budget, "cuda:1", total=80 << 30) == 40 << 30
    assert budget_bytes(budget, "cuda:0", total=80 << 30, sharers=2) == 512 << 20
    assert budget_bytes(parse_budget("cuda=10%"), "cpu") is None
    for bad in ("tpu=1GB", "cpu=1GB,cpu=2GB", "cpu=1GB,,"):
        with pytest.raises(ValueError, match=r"device|empty"):
            parse_budget(bad)


def test_settings_and_cache_config() -> None:
    s = Settings(device_memory_budget="cpu=2GiB", cache_config="local,size=64MiB")
    assert s.budget == {"cpu": Size(nbytes=2 << 30)}
    assert s.cache_bytes == 64 << 20
    assert Settings(device_memory_budget="").budget is None
    assert parse_cache_config("local,size=1000") == 1000
    for bad in ("redis,size=10", "local", "local,size=10%", "local,bytes=10"):
        with pytest.raises(ValueError, match="cache_config"):
            parse_cache_config(bad)
    with pytest.raises(ValueError, match="device_memory_budget"):
        Settings(device_memory_budget="lots")


# --- what a pipeline holds --------------------------------------------------------------


def test_held_bytes_counts_each_storage_once() -> None:
    base = torch.zeros(100, dtype=torch.float32)
    lin = torch.nn.Linear(10, 5)  # 50 + 5 float32

    class Holder:
        def __init__(self) -> None:
            self.a = base
            self.view = base[10:20]  # the same storage: not counted again
            self.more = [torch.zeros(8, dtype=torch.uint8), {"x": base.view(10, 10)}]
            self.model = lin
            self.name = "plain"

    h = Holder()
    assert held_bytes(h) == 400 + 8 + 55 * 4
    release(h)
    assert held_bytes(h) == 0
    assert h.name == "plain"
    assert h.a is None
    assert h.model is None


# --- the accounting on its own ----------------------------------------------------------


def test_accounting_order_pinned_busy_and_refusals() -> None:
    busy: set[str] = set()
    acc = Accounting(lambda device: 100 if device == "cpu" else None)
    for key, nbytes, pinned in (("a", 30, False), ("b", 30, True), ("c", 30, False)):
        acc.reserve(key, "cpu", nbytes, pinned=pinned, busy=lambda k=key: k in busy)
    assert acc.used("cpu") == 90
    assert acc.victims("cpu", 10) == []
    assert acc.victims("cpu", 20) == ["a"]  # least recently used, not pinned
    acc.touch("a")
    assert acc.victims("cpu", 20) == ["c"]
    busy.add("c")
    assert acc.victims("cpu", 20) == ["a"]  # c is busy
    assert acc.victims("cpu", 40) == ["a"]
    with pytest.raises(NoRoom, match="busy") as err:
        acc.victims("cpu", 41)  # a alone is not enough while c is busy
    assert not err.value.permanent
    with pytest.raises(NoRoom, match="30 bytes pinned") as err:
        acc.victims("cpu", 80)  # b is pinned: never more than 70 free
    assert err.value.permanent
    with pytest.raises(NoRoom, match="more than the device memory budget") as err:
        acc.victims("cpu", 101)
    assert err.value.permanent
    assert acc.victims("cuda:0", 10**12) == []  # no budget there
    acc.remove("a")
    assert acc.order() == ["b", "c"]


# --- the repository under a budget ------------------------------------------------------

SHIFTS = {"a": 0.0, "b": 1.0, "c": 2.0, "d": 3.0, "e": 4.0, "f": 5.0}


def write_models(root: Path, names: str = "abc", pinned: str = "", **cfg: Any) -> None:
    for n in names:
        text = cfg_text(**cfg)
        if n in pinned:
            text = "pinned = true\n" + text
        write(root / n, text, shift=SHIFTS[n])


def one_model_bytes(tmp_path: Path) -> int:
    write_models(tmp_path / "one", "a")

    async def main() -> int:
        repo = ModelRepository(tmp_path / "one", warmup=False, budget=parse_budget("1GiB"))
        await repo.start()
        (row,) = repo.index()
        await repo.stop()
        return int(row["resident_bytes"])

    return asyncio.run(main())


def plane(repo: ModelRepository, metrics: Metrics | None = None) -> DataPlane:
    return DataPlane(repo, metrics or Metrics())


async def ask(dp: DataPlane, name: str, seed: int = 0, **kw: Any) -> InferResponse:
    """One request through the data plane (as every transport sends it)."""
    bits = bits_of(2, seed)
    rid = kw.pop("id", "r1")
    req = request(bits, **kw)
    req.id = rid

    async def decode(handle: ModelHandle) -> InferRequest:
        for t in req.inputs:
            handle.signature.check_input(t.name, t.datatype, t.shape)
        return req

    async def encode(h: ModelHandle, r: InferRequest, resp: InferResponse) -> InferResponse:
        return resp

    resp = await dp.infer_with(name, None, decode, encode)
    np.testing.assert_allclose(
        resp.outputs[0].data, boxcar_reference(bits, SHIFTS[name]), rtol=1e-6
    )
    return resp


def resident(repo: ModelRepository) -> set[str]:
    return {row["name"] for row in repo.index() if row.get("resident")}


def budgeted(root: Path, size: int, **kw: Any) -> ModelRepository:
    return ModelRepository(root, warmup=False, budget={"": Size(nbytes=size)}, **kw)


@pytest.fixture
def size(tmp_path: Path) -> int:
    return one_model_bytes(tmp_path)


def test_eviction_order_is_least_recently_used(tmp_path: Path, size: int) -> None:
    write_models(tmp_path / "r")
    metrics = Metrics()

    async def main() -> None:
        repo = budgeted(tmp_path / "r", 2 * size + size // 2, metrics=metrics)
        await repo.start()
        assert repo.ready  # every model READY, evicted or not
        assert resident(repo)  # (which ones: by the order the parallel loads ended)
        assert repo.accounting.used("cpu") <= 2 * size + size // 2
        assert {row["state"] for row in repo.index()} == {"READY"}
        dp = plane(repo, metrics)
        await ask(dp, "a")
        await ask(dp, "b")
        assert resident(repo) == {"a", "b"}
        await ask(dp, "c")  # evicts a, the least recently used
        assert resident(repo) == {"b", "c"}
        await ask(dp, "b")
        await ask(dp, "a")  # evicts c now (b was used after it)
        assert resident(repo) == {"a", "b"}
        assert repo.accounting.used("cpu") <= 2 * size + size // 2
        assert repo.ready  # evictions never make the server unready (strict readiness)
        value = metrics.registry.get_sample_value
        assert value("bitserve_model_evictions_total", {"model": "c"}) >= 1
        assert value("bitserve_requests_waited_for_load_total", {"model": "a"}) >= 1
        assert value("bitserve_model_loads_total", {"model": "a"}) >= 2
        assert value("bitserve_model_load_seconds_count", {"model": "a"}) >= 2
        assert value("bitserve_device_memory_bytes", {"model": "c", "device": "cpu"}) == 0
        assert value("bitserve_device_memory_bytes", {"model": "a", "device": "cpu"}) == size
        assert value("bitserve_device_memory_budget_bytes", {"device": "cpu"}) == 2.5 * size // 1
        evicted = repo.get("c")  # listed, ready, metadata served without a load
        assert evicted.metadata()["name"] == "c"
        assert resident(repo) == {"a", "b"}
        await repo.stop()

    run(main)


def test_pinned_versions_are_never_evicted(tmp_path: Path, size: int) -> None:
    write_models(tmp_path / "r", "abcd", pinned="a")

    async def main() -> None:
        repo = budgeted(tmp_path / "r", 2 * size + size // 2)
        await repo.start()
        dp = plane(repo)
        for name in "bcdbcdab":
            await ask(dp, name)
            assert "a" in resident(repo)
        await repo.stop()

    run(main)


def test_a_version_holding_a_request_is_never_evicted(tmp_path: Path, size: int) -> None:
    # a's batch waits 0.5 s for company: its request is queued, a is busy meanwhile.
    write_models(tmp_path / "r", "a", max_batch_size=4, delay_us=500_000)
    write_models(tmp_path / "r", "bc")

    async def main() -> None:
        repo = budgeted(tmp_path / "r", 2 * size + size // 2)
        await repo.start()
        dp = plane(repo)
        await ask(dp, "a")
        await ask(dp, "b")
        waiting = asyncio.create_task(ask(dp, "a", seed=1))
        await asyncio.sleep(0.05)
        assert not repo.get("a").batcher.idle
        await ask(dp, "c")  # a is the least recently used, but busy: b goes
        assert resident(repo) == {"a", "c"}
        await waiting
        await repo.stop()

    run(main)


def test_concurrent_requests_share_one_load(
    tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_models(tmp_path / "r")

    async def main() -> None:
        repo = budgeted(tmp_path / "r", size + size // 2)
        await repo.start()
        dp = plane(repo)
        await ask(dp, "a")
        builds: list[str] = []
        real = repo._build_all

        def counted(name: str, *args: Any) -> Any:
            builds.append(name)
            return real(name, *args)

        monkeypatch.setattr(repo, "_build_all", counted)
        await asyncio.gather(*(ask(dp, "b", seed=i) for i in range(6)))
        assert builds == ["b"]
        assert resident(repo) == {"b"}
        await repo.stop()

    run(main)


def test_a_load_failing_midway_leaves_the_budget_accounted(
    tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_models(tmp_path / "r")

    async def main() -> None:
        repo = budgeted(tmp_path / "r", 2 * size + size // 2)
        await repo.start()
        dp = plane(repo)
        await ask(dp, "a")
        await ask(dp, "b")
        used = repo.accounting.used("cpu")
        import service.residency.loading as repository

        real = repository.build_version

        def broken(*args: Any, **kw: Any) -> Any:
            real(*args, **kw)  # built, then it fails: what it built is dropped
            raise RuntimeError("disk went away")

        monkeypatch.setattr(repository, "build_version", broken)
        with pytest.raises(ModelNotReady, match=r"failed to load.*disk went away"):
            await ask(dp, "c")
        # c's reservation is gone; making room for it evicted a (the least recent) only.
        assert repo.accounting.used("cpu") == used - size
        assert resident(repo) == {"b"}
        assert "its last load on demand failed" in repo.index()[2]["reason"]
        monkeypatch.setattr(repository, "build_version", real)
        await ask(dp, "c")
        assert resident(repo) == {"b", "c"}
        assert repo.index()[2]["reason"] == ""
        await repo.stop()

    run(main)


def test_loads_racing_unloads_and_reloads(tmp_path: Path, size: int) -> None:
    write_models(tmp_path / "r")

    async def main() -> None:
        repo = budgeted(tmp_path / "r", size + size // 2)
        await repo.start()
        dp = plane(repo)
        await ask(dp, "a")
        # b loads on demand while it is unloaded: the request fails cleanly (not ready), or
        # is answered first; either way nothing of b stays accounted.
        pending = asyncio.create_task(ask(dp, "b"))
        await asyncio.sleep(0)
        await repo.unload("b")
        with contextlib.suppress(ModelNotReady):
            await pending
        assert "b" not in resident(repo)
        assert all(getattr(k, "name", "") != "b" for k in repo.accounting.order())
        # c loads on demand while an explicit load of c runs: both end with one c.
        await asyncio.gather(ask(dp, "c"), repo.load("c"))
        assert resident(repo) == {"c"}
        assert repo.accounting.used("cpu") == size
        await ask(dp, "a")
        assert resident(repo) == {"a"}
        assert repo.ready
        await repo.stop()

    run(main)


def test_too_large_is_refused_with_the_reason(tmp_path: Path, size: int) -> None:
    write_models(tmp_path / "r", "a")

    async def main() -> None:
        repo = budgeted(tmp_path / "r", size // 2)
        await repo.start()
        (row,) = repo.index()
        assert row["state"] == "UNAVAILABLE"
        assert "more than the device memory budget" in row["reason"]
        assert repo.accounting.used("cpu") == 0
        with pytest.raises(InvalidInput, match="more than the device memory budget"):
            await repo.load("a")
        await repo.stop()

    run(main)


def test_a_load_wait_is_bounded_by_the_request_timeout(
    tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_models(tmp_path / "r", "ab")

    async def main() -> None:
        repo = budgeted(tmp_path / "r", size + size // 2)
        await repo.start()
        dp = plane(repo)
        await ask(dp, "a")
        real = repo._build_all

        def slow(*args: Any) -> Any:
            import time

            time.sleep(0.3)
            return real(*args)

        monkeypatch.setattr(repo, "_build_all", slow)
        with pytest.raises(DeadlineExceeded, match="still loading"):
            await ask(dp, "b", parameters={"timeout": 1000}, timeout_us=1000)
        await ask(dp, "b")  # the same load goes on; a patient request gets it
        await repo.stop()

    run(main)


def test_no_budget_keeps_every_version_resident(tmp_path: Path) -> None:
    write_models(tmp_path / "r")

    async def main() -> None:
        repo = ModelRepository(tmp_path / "r", warmup=False)
        await repo.start()
        assert "resident" not in repo.index()[0]  # Triton's four keys only
        assert len(repo.accounting.order()) == 3
        dp = plane(repo)
        for name in "abc":
            await ask(dp, name)
        assert len(repo.accounting.order()) == 3
        await repo.stop()

    run(main)
