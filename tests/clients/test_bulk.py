"""infer_many (sync and async): order, bounded concurrency, laziness, .npy output."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from bitserve_client import AsyncClient, Client, InvalidInputError, ServerError
from bitserve_client._bulk import _NpyAppender

from .fake_v2 import FakeV2, async_handler, reference_bits


def jittery() -> float:
    # Random service times make requests finish out of order.
    return random.uniform(0.0, 0.004)


def infer_many(
    kind: str, fake: FakeV2, data: Any, **kwargs: Any
) -> dict[str, np.ndarray[Any, Any]]:
    kwargs.setdefault("progress", False)
    if kind == "sync":
        with Client("http://fake", transport=httpx.MockTransport(fake.handler)) as client:
            return client.infer_many("bits", data, **kwargs)

    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(jittery())
        return await async_handler(fake, request)

    async def run() -> dict[str, np.ndarray[Any, Any]]:
        async with AsyncClient("http://fake", transport=httpx.MockTransport(handler)) as client:
            return await client.infer_many("bits", data, **kwargs)

    return asyncio.run(run())


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def rows(n: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).random((n, 3, 13)) < 0.5


def test_array_keeps_order_under_concurrency(kind: str) -> None:
    bits = rows(203)
    fake = FakeV2(delay=jittery)
    result = infer_many(kind, fake, bits, batch_size=5, concurrency=4)
    ref = reference_bits(bits)
    np.testing.assert_array_equal(result["count"], ref["count"])
    np.testing.assert_array_equal(result["first"], ref["first"])
    assert 1 <= fake.max_in_flight <= 4
    infers = [r for r in fake.requests if r.url.path.endswith("/infer")]
    assert len(infers) == 41  # ceil(203 / 5)


def test_default_batch_size_is_the_models_max(kind: str) -> None:
    fake = FakeV2()
    infer_many(kind, fake, rows(20), concurrency=2)
    assert len([r for r in fake.requests if r.url.path.endswith("/infer")]) == 3  # 8 + 8 + 4


def test_memmap_to_npy_file(kind: str, tmp_path: Path) -> None:
    src = tmp_path / "in.npy"
    mm = np.lib.format.open_memmap(src, mode="w+", dtype=np.uint8, shape=(57, 3, 13))
    mm[:] = rows(57)
    mm.flush()
    del mm
    out = tmp_path / "count.npy"
    result = infer_many(
        kind, FakeV2(delay=jittery), str(src), outputs=["count"], out=out, concurrency=3
    )
    expected = reference_bits(np.load(src))["count"]
    np.testing.assert_array_equal(np.load(out), expected)
    np.testing.assert_array_equal(result["count"], expected)


def test_iterator_of_batches_streams_lazily(kind: str, tmp_path: Path) -> None:
    pulled = 0
    done_before: list[int] = []
    fake = FakeV2(delay=jittery)

    def batches() -> Iterator[np.ndarray[Any, Any]]:
        nonlocal pulled
        for i in range(30):
            pulled += 1
            done = len([r for r in fake.requests if r.url.path.endswith("/infer")])
            done_before.append(pulled - done)
            yield rows(7, seed=i)  # 7 rows, split into 4 + 3 with batch_size 4

    out = {"count": tmp_path / "c.npy", "first": tmp_path / "f.npy"}
    infer_many(kind, fake, batches(), batch_size=4, concurrency=2, out=out)
    allbits = np.concatenate([rows(7, seed=i) for i in range(30)])
    ref = reference_bits(allbits)
    np.testing.assert_array_equal(np.load(out["count"]), ref["count"])
    np.testing.assert_array_equal(np.load(out["first"]), ref["first"])
    # Never more than the window (2 x concurrency batches, i.e. 2 source items) ahead.
    assert max(done_before) <= 4


def test_iterator_into_memory_and_dict_inputs(kind: str) -> None:
    chunks = [{"x": rows(3, seed=s)} for s in range(5)]
    result = infer_many(kind, FakeV2(), iter(chunks), batch_size=8, concurrency=2)
    ref = reference_bits(np.concatenate([c["x"] for c in chunks]))
    np.testing.assert_array_equal(result["count"], ref["count"])


def test_async_iterator_of_batches() -> None:
    async def gen() -> AsyncIterator[np.ndarray[Any, Any]]:
        for s in range(4):
            yield rows(5, seed=s)

    result = infer_many("async", FakeV2(), gen(), batch_size=3, concurrency=2)
    ref = reference_bits(np.concatenate([rows(5, seed=s) for s in range(4)]))
    np.testing.assert_array_equal(result["count"], ref["count"])


def test_zero_rows_gives_empty_outputs(kind: str) -> None:
    result = infer_many(kind, FakeV2(), np.zeros((0, 3, 13), bool))
    assert result["count"].shape == (0, 3)
    assert result["count"].dtype == np.int32


def test_a_failing_batch_raises_and_stops(kind: str) -> None:
    fake = FakeV2()
    fake.script += [
        httpx.Response(200, json=fake.metadata("bits")),
        httpx.Response(200, json=fake.config()),
    ]
    fake.script += [httpx.Response(400, json={"error": "bad batch"})]
    with pytest.raises(ServerError, match="bad batch"):
        infer_many(kind, fake, rows(40), batch_size=4, concurrency=1)
    assert len([r for r in fake.requests if r.url.path.endswith("/infer")]) < 10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 9}, "batch_size 9 must be in 1..8"),
        ({"concurrency": 0}, "concurrency"),
        ({"out": "x.npy"}, "give out as a dict"),
    ],
)
def test_bad_arguments(kind: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        infer_many(kind, FakeV2(), rows(4), **kwargs)


@pytest.mark.parametrize("n", [0, 1, 9, 1000])
def test_npy_appender_writes_a_valid_file(tmp_path: Path, n: int) -> None:
    path = tmp_path / "a.npy"
    data = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3)
    writer = _NpyAppender(path, np.dtype(np.float32), (2, 3))
    for start in itertools.count(0, 7):
        if start >= n:
            break
        writer.write(data[start : start + 7])
    loaded = writer.finish()
    np.testing.assert_array_equal(loaded, data)
    assert np.load(path).shape == (n, 2, 3)
