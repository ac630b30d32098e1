"""The response cache: what its key tells apart, LRU by bytes, hits that never run the model,
entries dropped with their version, statistics and metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from service import dataplane
from service.batching.queue import BatchInfo
from service.dataplane import DataPlane
from service.models.config import ModelConfig
from service.models.repository import ModelRepository
from service.models.response_cache import ENTRY_OVERHEAD, ResponseCache, cache_key
from service.models.signature import Bound, WireInput
from service.observability.metrics import Metrics
from service.protocol.types import InferRequest, RequestInput, RequestOutput
from service.residency.sizes import Size
from tests.service.test_repository import N, bits_of, cfg_text, run, write
from tests.service.test_residency import ask, one_model_bytes

FREE = ModelConfig.model_validate(
    {
        "max_batch_size": 8,
        "inputs": [
            {"name": "x", "datatype": "UINT8", "shape": [4]},
            {"name": "bits", "datatype": "BOOL", "shape": [16], "packing": "bits"},
        ],
        "model": {"file": "never-loaded.pt"},
        "outputs": [
            {"name": "y", "datatype": "FP32", "shape": [4]},
            {"name": "n", "datatype": "INT64", "shape": []},
        ],
    }
)


def key_of(
    x: np.ndarray,
    *,
    bits: np.ndarray | None = None,
    bitorder: str | None = None,
    outputs: list[str] | None = None,
    version: str = "1",
    **parameters: Any,
) -> bytes:
    """The cache key of one request to a model of config FREE, laid out as ``bind`` lays it
    out (built by hand: the key must hold whatever shape a model's inputs may take)."""
    handle = SimpleNamespace(name="m", version=version, cfg=FREE)
    packed = np.zeros((x.shape[0], 2), np.uint8) if bits is None else bits
    params = {"bitorder": bitorder} if bitorder else {}
    req = InferRequest(
        id="any",
        inputs=[
            RequestInput("x", "UINT8", x.shape, x),
            RequestInput("bits", "UINT8", packed.shape, packed, params),
        ],
        outputs=None if outputs is None else [RequestOutput(o) for o in outputs],
        parameters=parameters,
    )
    names = [o.name for o in FREE.outputs]
    bound = Bound(
        (WireInput(x, False), WireInput(packed, True, bitorder)),
        tuple(range(len(names))) if outputs is None else tuple(names.index(o) for o in outputs),
        x.shape[0],
    )
    return cache_key(handle, req, bound)  # type: ignore[arg-type]


def test_key_tells_apart_what_changes_the_answer() -> None:
    data = np.arange(8, dtype=np.uint8)
    base = key_of(data.reshape(2, 4))
    assert len(base) == 16  # 128 bits
    assert key_of(data.reshape(2, 4).copy()) == base  # equal requests: one entry
    # The same bytes under another shape never share an entry.
    assert key_of(data.reshape(4, 2)) != base
    assert key_of(data.reshape(1, 8)) != base
    # Nor the same packed bits in the other bit order.
    bits = np.random.default_rng(0).integers(0, 256, (2, 2), dtype=np.uint8)
    assert key_of(data.reshape(2, 4), bits=bits, bitorder="little") != key_of(
        data.reshape(2, 4), bits=bits, bitorder="big"
    )
    # Parameters that change the answer are in the key (k, threshold: any name)...
    assert key_of(data.reshape(2, 4), k=5) != key_of(data.reshape(2, 4), k=6)
    assert key_of(data.reshape(2, 4), k=5) != base
    assert key_of(data.reshape(2, 4), threshold=0.5) != key_of(data.reshape(2, 4), threshold=0.6)
    # ...those about when or how it travels are not.
    assert key_of(data.reshape(2, 4), priority=1, timeout=5000, binary_data_output=True) == base
    # The outputs asked for.
    assert key_of(data.reshape(2, 4), outputs=["y"]) != key_of(data.reshape(2, 4), outputs=["n"])
    assert key_of(data.reshape(2, 4), outputs=["y"]) != base
    assert key_of(data.reshape(2, 4), outputs=["n", "y"]) != key_of(
        data.reshape(2, 4), outputs=["y", "n"]
    )
    assert key_of(data.reshape(2, 4), version="2") != base
    # One byte more or less changes it.
    other = data.copy()
    other[7] ^= 1
    assert key_of(other.reshape(2, 4)) != base


def test_key_reads_the_bytes_not_their_layout() -> None:
    # The key hashes an input's buffer as it arrived (no copy when it is contiguous): a
    # strided view of the same values is the same request, other values are not.
    rng = np.random.default_rng(7)
    for _ in range(20):
        wide = rng.integers(0, 256, (2, 8), dtype=np.uint8)
        view = wide[:, ::2]  # (2, 4), not contiguous
        assert not view.flags.c_contiguous
        assert key_of(view) == key_of(np.ascontiguousarray(view))
        assert key_of(view) != key_of(np.ascontiguousarray(wide[:, 1::2])) or np.array_equal(
            view, wide[:, 1::2]
        )
    # The heads cached per request form do not mix forms up: 200 forms, each its own key,
    # the same key when asked again.
    data = np.arange(24, dtype=np.uint8)
    shapes = [(a, 24 // a) for a in (1, 2, 3, 4, 6, 8, 12, 24)]
    keys = {s: key_of(data[: s[0] * s[1]].reshape(s)) for s in shapes}
    assert len(set(keys.values())) == len(shapes)
    assert all(key_of(data[: s[0] * s[1]].reshape(s)) == k for s, k in keys.items())


def test_key_parameters_by_where_they_are_given() -> None:
    # A parameter that changes the answer counts wherever it is given (the request, an input
    # or an output), and the same value at another place is another request.
    x = np.arange(8, dtype=np.uint8).reshape(2, 4)
    handle = SimpleNamespace(name="m", version="1", cfg=FREE)
    packed = np.zeros((2, 2), np.uint8)
    bound = Bound((WireInput(x, False), WireInput(packed, True)), (0, 1), 2)

    def key(
        req_params: dict[str, Any], in_params: dict[str, Any], out_params: dict[str, Any]
    ) -> bytes:
        req = InferRequest(
            id="any",
            inputs=[RequestInput("x", "UINT8", x.shape, x, in_params),
                    RequestInput("bits", "UINT8", packed.shape, packed)],
            outputs=[RequestOutput("y", parameters=out_params), RequestOutput("n")],
            parameters=req_params,
        )  # fmt: skip
        return cache_key(handle, req, bound)  # type: ignore[arg-type]

    base = key({}, {}, {})
    ignored = key({"priority": 2}, {"binary_data_size": 8}, {"binary_data": True})
    assert ignored == base
    k_request, k_input, k_output = (
        key({"k": 3}, {}, {}),
        key({}, {"k": 3}, {}),
        key({}, {}, {"k": 3}),
    )
    assert len({base, k_request, k_input, k_output}) == 4
    assert key({"k": 3, "priority": 1}, {}, {}) == k_request


def test_lru_by_bytes() -> None:
    info = BatchInfo(1, 1)
    one = [np.zeros(100, np.uint8)]
    cache = ResponseCache(3 * (100 + ENTRY_OVERHEAD))
    for k in (b"a", b"b", b"c"):
        cache.put(k, ("m", "1"), one, info)
    assert len(cache) == 3
    assert cache.get(b"a") is not None  # a is now the most recent
    cache.put(b"d", ("m", "2"), one, info)
    assert cache.get(b"b") is None  # the least recently used went
    assert {k for k in (b"a", b"c", b"d") if cache.get(k) is not None} == {b"a", b"c", b"d"}
    cache.put(b"big", ("m", "1"), [np.zeros(10_000, np.uint8)], info)  # larger than all
    assert cache.get(b"big") is None
    assert len(cache) == 3
    cache.drop("m", "1")
    assert cache.get(b"a") is None
    assert cache.get(b"d") is not None
    assert cache.used_bytes == 100 + ENTRY_OVERHEAD
    stored = cache.get(b"d")
    assert stored is not None
    assert stored[0][0] is not one[0]  # a copy: the batch's buffers may be reused


CACHED = "[response_cache]\nenable = true\n"


def cached_repo(root: Path, **kw: Any) -> ModelRepository:
    return ModelRepository(root, warmup=False, cache=ResponseCache(1 << 20), **kw)


def test_a_hit_never_runs_the_model_and_has_its_own_id(tmp_path: Path) -> None:
    write(tmp_path / "a", cfg_text() + CACHED)
    metrics = Metrics()

    async def main() -> None:
        repo = cached_repo(tmp_path, metrics=metrics)
        await repo.start()
        dp = DataPlane(repo, metrics)
        assert repo.get("a").config()["response_cache"] == {"enable": True}  # as Triton's
        first = await ask(dp, "a", seed=3, id="first")
        stats = repo.get("a").stats
        assert stats.execution_count == 1
        second = await ask(dp, "a", seed=3, id="second")  # ask checks against the reference
        assert stats.execution_count == 1  # not run again
        assert second.id == "second"
        assert second.outputs[0].data.tobytes() == first.outputs[0].data.tobytes()
        await ask(dp, "a", seed=3, id="third", parameters={"priority": 1})  # still a hit
        await ask(dp, "a", seed=4)  # other bytes: a miss
        assert stats.execution_count == 2
        together = await asyncio.gather(*(ask(dp, "a", seed=5) for _ in range(4)))
        assert len({r.outputs[0].data.tobytes() for r in together}) == 1
        triton = dp.statistics("a")["model_stats"][0]["inference_stats"]
        assert triton["cache_hit"]["count"] >= 2
        assert triton["cache_hit"]["count"] + triton["cache_miss"]["count"] == 8
        assert triton["success"]["count"] == 8  # hits are successes, as in Triton
        text = metrics.render().decode()
        hits = triton["cache_hit"]["count"]
        assert f'nv_cache_num_hits_per_model{{model="a",version="1"}} {hits}' in text
        assert 'nv_cache_num_misses_per_model{model="a",version="1"}' in text
        await repo.stop()

    run(main)


def test_a_model_without_response_cache_is_never_cached(tmp_path: Path) -> None:
    write(tmp_path / "a", cfg_text())

    async def main() -> None:
        repo = cached_repo(tmp_path)
        await repo.start()
        dp = DataPlane(repo, Metrics())
        for _ in range(3):
            await ask(dp, "a", seed=3)
        assert repo.get("a").stats.execution_count == 3
        assert "response_cache" not in repo.get("a").config()
        assert repo.cache is not None
        assert len(repo.cache) == 0
        await repo.stop()

    run(main)


@pytest.mark.parametrize("change", ["reload", "unload", "evict"])
def test_entries_are_dropped_with_their_version(tmp_path: Path, change: str) -> None:
    size = one_model_bytes(tmp_path)
    for name, shift in (("a", 0.0), ("b", 1.0)):
        write(tmp_path / "r" / name, cfg_text() + CACHED, shift=shift)

    async def main() -> None:
        budget = {"": Size(nbytes=size + size // 2)} if change == "evict" else None
        repo = cached_repo(tmp_path / "r", budget=budget)
        await repo.start()
        dp = DataPlane(repo, Metrics())
        await ask(dp, "b", seed=1)
        await ask(dp, "a", seed=1)
        cache = repo.cache
        assert cache is not None
        # Under the budget, a's load evicted b: b's entry went with it.
        assert {v for v, _ in cache._by_version} == ({"a"} if change == "evict" else {"a", "b"})
        if change == "reload":
            await repo.load("a")
        elif change == "unload":
            await repo.unload("a")
        else:
            await ask(dp, "b", seed=1)  # evicts a
        assert all(v != "a" for v, _ in cache._by_version)
        if change != "unload":
            await ask(dp, "a", seed=1)  # computed again, by the version serving now
            assert repo.get("a").stats.execution_count == 2
        await repo.stop()

    run(main)


def test_the_same_bytes_in_the_other_bit_order_run_the_model(tmp_path: Path) -> None:
    write(tmp_path / "a", cfg_text() + CACHED)

    async def main() -> None:
        repo = cached_repo(tmp_path)
        await repo.start()
        h = repo.get("a")
        packed = np.packbits(bits_of(2, 7), axis=-1)
        assert packed.shape == (2, N, 3)
        big = InferRequest(id="b", inputs=[RequestInput("bits", "UINT8", packed.shape, packed)])
        little = InferRequest(
            id="l",
            inputs=[RequestInput("bits", "UINT8", packed.shape, packed, {"bitorder": "little"})],
        )
        r1 = await dataplane.infer(h, big)
        r2 = await dataplane.infer(h, little)  # the same bytes, read the other way round
        assert h.stats.execution_count == 2
        assert r1.outputs[0].data.tobytes() != r2.outputs[0].data.tobytes()
        r3 = await dataplane.infer(h, little)
        assert h.stats.execution_count == 2  # now a hit
        assert r3.outputs[0].data.tobytes() == r2.outputs[0].data.tobytes()
        await repo.stop()

    run(main)
