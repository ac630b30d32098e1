"""infer_many and infer_iter (sync and async): order, bounded concurrency, laziness, .npy
output, failures part way and resuming them, progress without tqdm."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from bitserve_client import (
    AsyncClient,
    BulkInferenceError,
    BulkResult,
    Client,
    InvalidInputError,
    ServerError,
)
from bitserve_client._bulk import default_concurrency
from bitserve_client._sink import _NpyWriter, rows_in

from .conftest import Harness, jittery, rows
from .fake_v2 import FakeV2, async_handler, reference_bits


@pytest.fixture
def bulk(make: Callable[..., Harness], kind: str) -> Callable[..., Harness]:
    """A harness whose server answers after random delays (sync: in the fake; async: on the
    event loop), so that requests finish out of order."""

    def factory(fake: FakeV2 | None = None) -> Harness:
        fake = fake or FakeV2()
        if kind != "async":
            fake.delay = jittery
        return make(fake, jitter=True)

    return factory


def many(h: Harness, data: Any, **kwargs: Any) -> BulkResult:
    kwargs.setdefault("progress", False)
    result = h("infer_many", "bits", data, **kwargs)
    assert isinstance(result, BulkResult)
    return result


def test_array_keeps_order_under_concurrency(bulk: Callable[..., Harness]) -> None:
    bits = rows(203)
    h = bulk()
    result = many(h, bits, batch_size=5, concurrency=4)
    ref = reference_bits(bits)
    np.testing.assert_array_equal(result["count"], ref["count"])
    np.testing.assert_array_equal(result.as_numpy("first"), ref["first"])
    assert (result.rows, result.paths, result.model_name) == (203, {}, "bits")
    assert 1 <= h.fake.max_in_flight <= 4
    assert h.infers() == 41  # ceil(203 / 5)


@pytest.mark.parametrize(("batch_size", "in_flight"), [(1, 16), (2, 8), (3, 6), (8, 4)])
def test_default_concurrency_keeps_two_batches_in_flight(
    make: Callable[..., Harness], batch_size: int, in_flight: int
) -> None:
    # Model "bits" batches up to 8 rows: two of its batches are 2 * ceil(8 / batch_size)
    # requests, at least 4 and at most 16. Each request takes 200 ms in the fake, so every
    # request the client allows is in flight at once.
    assert default_concurrency(8, batch_size) == in_flight
    fake = FakeV2(delay=lambda: 0.2)
    h = make(fake)
    bits = rows(3 * in_flight * batch_size)
    result = many(h, bits, batch_size=batch_size)
    np.testing.assert_array_equal(result["count"], reference_bits(bits)["count"])
    assert fake.max_in_flight == in_flight
    assert h.infers() == 3 * in_flight


def test_default_concurrency_bounds() -> None:
    assert [default_concurrency(0, b) for b in (1, 64)] == [4, 4]  # no batching: 4
    assert default_concurrency(256, 64) == 8  # the fingerprint MLP's: 64 rows of 256
    assert default_concurrency(256, 100) == 6  # ceil(2.56) batches a batch
    assert default_concurrency(4096, 1) == 16  # Triton's rule would say 8192
    assert default_concurrency(64, 64) == 4  # infer_many's default batch: the model's max


def test_default_batch_size_is_the_models_max(make: Callable[..., Harness]) -> None:
    h = make()
    many(h, rows(20), concurrency=2)
    assert h.infers() == 3  # 8 + 8 + 4


def test_memmap_to_npy_file(bulk: Callable[..., Harness], tmp_path: Path) -> None:
    src = tmp_path / "in.npy"
    mm = np.lib.format.open_memmap(src, mode="w+", dtype=np.uint8, shape=(57, 3, 13))
    mm[:] = rows(57)
    mm.flush()
    del mm
    out = tmp_path / "count.npy"
    result = many(bulk(), str(src), outputs=["count"], out=out, concurrency=3)
    expected = reference_bits(np.load(src))["count"]
    np.testing.assert_array_equal(np.load(out), expected)
    np.testing.assert_array_equal(result["count"], expected)
    assert result.paths == {"count": out}
    assert isinstance(result["count"], np.memmap)


def test_iterator_of_batches_streams_lazily(bulk: Callable[..., Harness], tmp_path: Path) -> None:
    pulled = 0
    done_before: list[int] = []
    h = bulk()

    def batches() -> Iterator[np.ndarray[Any, Any]]:
        nonlocal pulled
        for i in range(30):
            pulled += 1
            done_before.append(pulled - h.infers())
            yield rows(7, seed=i)  # 7 rows, split into 4 + 3 with batch_size 4

    out = {"count": tmp_path / "c.npy", "first": tmp_path / "f.npy"}
    result = many(h, batches(), batch_size=4, concurrency=2, out=out)
    ref = reference_bits(np.concatenate([rows(7, seed=i) for i in range(30)]))
    np.testing.assert_array_equal(np.load(out["count"]), ref["count"])
    np.testing.assert_array_equal(np.load(out["first"]), ref["first"])
    assert result.rows == 210
    # Never more than the window (2 x concurrency batches, i.e. 2 source items) ahead.
    assert max(done_before) <= 4


def test_iterator_into_memory_and_dict_inputs(make: Callable[..., Harness]) -> None:
    chunks = [{"x": rows(3, seed=s)} for s in range(5)]
    result = many(make(), iter(chunks), batch_size=8, concurrency=2)
    ref = reference_bits(np.concatenate([c["x"] for c in chunks]))
    np.testing.assert_array_equal(result["count"], ref["count"])


def test_async_iterator_of_batches() -> None:
    async def gen() -> AsyncIterator[np.ndarray[Any, Any]]:
        for s in range(4):
            yield rows(5, seed=s)

    h = Harness("async", FakeV2(), jitter=True)
    try:
        result = many(h, gen(), batch_size=3, concurrency=2)
    finally:
        h.close()
    ref = reference_bits(np.concatenate([rows(5, seed=s) for s in range(4)]))
    np.testing.assert_array_equal(result["count"], ref["count"])


def test_zero_rows_gives_empty_outputs(make: Callable[..., Harness]) -> None:
    result = many(make(), np.zeros((0, 3, 13), bool))
    assert result["count"].shape == (0, 3)
    assert result["count"].dtype == np.int32
    assert result.rows == 0


def test_infer_iter_yields_each_batch_in_order(bulk: Callable[..., Harness]) -> None:
    bits = rows(30, seed=3)
    h = bulk()
    results = h.collect("infer_iter", "bits", bits, batch_size=4, concurrency=3)
    assert [r["count"].shape[0] for r in results] == [4] * 7 + [2]
    ref = reference_bits(bits)["count"]
    np.testing.assert_array_equal(np.concatenate([r["count"] for r in results]), ref)


def test_infer_iter_stopped_early_sends_no_more() -> None:
    fake = FakeV2()
    with Client("http://fake", transport=httpx.MockTransport(fake.handler)) as client:
        it = client.infer_iter("bits", rows(80), batch_size=2, concurrency=2)
        first = next(it)
        it.close()
    assert first["count"].shape == (2, 3)
    assert fake.infer_count <= 4  # the window: 2 x concurrency, not 40 batches

    async def run() -> np.ndarray[Any, Any]:
        fake = FakeV2()

        async def handler(request: httpx.Request) -> httpx.Response:
            return await async_handler(fake, request)

        async with AsyncClient("http://fake", transport=httpx.MockTransport(handler)) as client:
            results = client.infer_iter("bits", rows(80), batch_size=2, concurrency=2)
            async with contextlib.aclosing(results) as it:
                result = await anext(it)
        assert fake.infer_count <= 4
        return result["count"]

    assert asyncio.run(run()).shape == (2, 3)


# -- failures and resuming ----------------------------------------------------------------------


def test_failure_says_how_many_rows_are_written_and_resume_finishes(
    bulk: Callable[..., Harness], tmp_path: Path
) -> None:
    bits = rows(40, seed=9)
    fake = FakeV2()
    fake.fail_infer_from = 5  # requests 1-4 answered: at most 16 rows, then "the server died"
    h = bulk(fake)
    out = tmp_path / "count.npy"
    with pytest.raises(BulkInferenceError, match=r"stopped after \d+ of 40 rows") as info:
        many(h, bits, outputs=["count"], out=out, batch_size=4, concurrency=2)
    err = info.value
    assert isinstance(err.__cause__, ServerError)
    assert err.__cause__.status == 500
    assert "resume=True" in str(err)
    assert str(out) in str(err)
    assert err.rows_done % 4 == 0
    assert err.rows_done <= 16
    assert err.total == 40
    ref = reference_bits(bits)["count"]
    # The file is a valid .npy of exactly the rows done.
    np.testing.assert_array_equal(np.load(out), ref[: err.rows_done])
    np.testing.assert_array_equal(err.result["count"], ref[: err.rows_done])
    assert rows_in(out) == err.rows_done == err.result.rows

    h.settle()
    fake.fail_infer_from = None
    before = h.infers()
    result = many(h, bits, outputs=["count"], out=out, batch_size=4, resume=True)
    assert h.infers() - before == (40 - err.rows_done) // 4  # only the rest is sent
    np.testing.assert_array_equal(np.load(out), ref)
    assert result.rows == 40
    # Resuming a finished run sends nothing.
    before = h.infers()
    assert many(h, bits, outputs=["count"], out=out, resume=True).rows == 40
    assert h.infers() == before


def test_failure_in_memory_keeps_the_rows_done(make: Callable[..., Harness]) -> None:
    bits = rows(20, seed=4)
    fake = FakeV2()
    fake.fail_infer_from = 3
    with pytest.raises(BulkInferenceError, match="stopped after 8 of 20 rows") as info:
        many(make(fake), bits, batch_size=4, concurrency=1)
    assert "error's .result" in str(info.value)
    ref = reference_bits(bits)
    np.testing.assert_array_equal(info.value.result["count"], ref["count"][:8])
    np.testing.assert_array_equal(info.value.result["first"], ref["first"][:8])


def test_resume_skips_rows_of_an_iterator(make: Callable[..., Harness], tmp_path: Path) -> None:
    chunks = [rows(5, seed=s) for s in range(6)]
    fake = FakeV2()
    fake.fail_infer_from = 4
    h = make(fake)
    out = tmp_path / "first.npy"
    with pytest.raises(BulkInferenceError, match=r"stopped after 8 rows;") as info:
        many(h, iter(chunks), outputs=["first"], out=out, batch_size=3, concurrency=1)
    assert info.value.total is None
    fake.fail_infer_from = None
    result = many(h, iter(chunks), outputs=["first"], out=out, batch_size=3, resume=True)
    np.testing.assert_array_equal(np.load(out), reference_bits(np.concatenate(chunks))["first"])
    assert result.rows == 30


def test_a_failing_batch_stops_the_run(make: Callable[..., Harness]) -> None:
    h = make()
    h.fake.fail_infer_from = 2
    with pytest.raises(BulkInferenceError, match="the server died"):
        many(h, rows(40), batch_size=4, concurrency=1)
    assert h.infers() < 10


def test_resume_refuses_files_of_another_shape(
    make: Callable[..., Harness], tmp_path: Path
) -> None:
    out = tmp_path / "count.npy"
    np.save(out, np.zeros((4, 5), np.int32))  # the model gives int32 rows of [3]
    message = r"cannot resume: .* holds int32 rows of \[5\], output 'count' is INT32 rows of \[3\]"
    with pytest.raises(InvalidInputError, match=message):
        many(make(), rows(8), outputs=["count"], out=out, resume=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 9}, "batch_size 9 must be in 1..8"),
        ({"concurrency": 0}, "concurrency"),
        ({"out": "x.npy"}, "give out as a dict"),
        ({"resume": True}, "resume=True needs out="),
    ],
)
def test_bad_arguments(make: Callable[..., Harness], kwargs: dict[str, Any], message: str) -> None:
    h = make()
    with pytest.raises(InvalidInputError, match=message):
        many(h, rows(4), **kwargs)
    assert h.infers() == 0
    with pytest.raises(InvalidInputError, match="cannot stream int"):
        many(h, 5)


# -- the resumable .npy writer ------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 9, 1000])
def test_npy_writer_states_the_rows_after_every_block(tmp_path: Path, n: int) -> None:
    path = tmp_path / "a.npy"
    data = np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3)
    writer = _NpyWriter(path, np.dtype(np.float32), (2, 3))
    for start in itertools.count(0, 7):
        if start >= n:
            break
        writer.write(data[start : start + 7])
        # Read while still open, as after a crash: the header states the rows written.
        np.testing.assert_array_equal(np.load(path), data[: min(n, start + 7)])
    writer.close()
    np.testing.assert_array_equal(np.load(path), data)
    assert np.load(path).shape == (n, 2, 3)


def test_npy_writer_resume_drops_a_torn_block(tmp_path: Path) -> None:
    path = tmp_path / "a.npy"
    data = np.arange(40, dtype=np.int64).reshape(20, 2)
    writer = _NpyWriter(path, np.dtype(np.int64), (2,))
    writer.write(data[:6])
    writer.close()
    with open(path, "ab") as f:  # half a block written, header not yet updated: a crash
        f.write(data[6:9].tobytes()[:20])
    assert rows_in(path) == 6
    writer = _NpyWriter(path, np.dtype(np.int64), (2,), keep_rows=6)
    writer.write(data[6:])
    writer.close()
    np.testing.assert_array_equal(np.load(path), data)


# -- progress -----------------------------------------------------------------------------------


def test_progress_falls_back_to_lines_without_tqdm(
    make: Callable[..., Harness],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from bitserve_client import _progress

    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now raises ImportError
    monkeypatch.setattr(_progress, "LINE_INTERVAL_S", 0.0)
    many(make(), rows(20), batch_size=8, concurrency=1, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("bits: 8/20 rows (40.0%), ")
    assert lines[1].startswith("bits: 16/20 rows (80.0%), ")
    assert lines[-1].startswith("bits: 20/20 rows (100.0%), ")
    assert all(line.endswith(" rows/s") for line in lines)


def test_progress_bar_with_tqdm(
    make: Callable[..., Harness], capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("tqdm")  # absent in the client-only venv
    many(make(), rows(20), batch_size=8, concurrency=1, progress=True)
    err = capsys.readouterr().err
    assert "20/20" in err
    assert "rows/s" not in err  # tqdm's own format, not the fallback line
