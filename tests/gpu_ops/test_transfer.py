"""gpu_ops.transfer: which paths share memory, which copy, and the staging pool's semantics."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from gpu_ops import _hostmem, _staging
from gpu_ops.transfer import (
    StagingBuffer,
    StagingPool,
    from_dlpack,
    to_device,
    to_dlpack,
    to_numpy,
)

HAS_CUDA = torch.cuda.is_available()


def _addr(buf: Any) -> int:
    """The address of the first byte of a buffer-protocol object."""
    return int(np.asarray(memoryview(buf)).__array_interface__["data"][0])


class FakeCupyArray:
    """A CuPy-like DLPack producer that lives on the CPU (backed by a NumPy array)."""

    def __init__(self, arr: np.ndarray[Any, Any]) -> None:
        self.arr = arr

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.arr.__dlpack_device__()


# --- to_device on the CPU: views where memory is writable, copies where it is not ----------


def test_bytearray_is_shared() -> None:
    raw = bytearray(range(16))
    t = to_device(raw, "cpu")
    assert t.dtype == torch.uint8
    assert t.shape == (16,)
    assert t.data_ptr() == _addr(raw)
    t[0] = 200  # the view writes through
    assert raw[0] == 200


def test_bytes_are_copied_by_default_without_warning() -> None:
    raw = bytes(range(10))
    t = to_device(raw, "cpu")  # filterwarnings=error: torch's non-writable warning would fail
    assert t.tolist() == list(range(10))
    assert t.data_ptr() != _addr(raw)
    t[0] = 99
    assert raw[0] == 0


def test_bytes_shared_on_request() -> None:
    raw = bytes(range(10))
    t = to_device(raw, "cpu", share_readonly=True)
    assert t.data_ptr() == _addr(raw)
    assert t.tolist() == list(range(10))


def test_memoryview_keeps_its_format_and_shares() -> None:
    store = bytearray(np.arange(6, dtype=np.float32).tobytes())
    t = to_device(memoryview(store).cast("f"), "cpu")
    assert t.dtype == torch.float32
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert t.data_ptr() == _addr(store)
    sliced = to_device(memoryview(store)[4:12], "cpu")
    assert sliced.data_ptr() == _addr(store) + 4


def test_numpy_writable_strided_view_is_shared() -> None:
    arr = np.random.default_rng(0).random((6, 8))
    view = arr[1::2, ::3]
    t = to_device(view, "cpu")
    assert np.shares_memory(t.numpy(), arr)
    np.testing.assert_array_equal(t.numpy(), view)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda a: a[::-1], id="negative-stride"),
        pytest.param(lambda a: a.astype(a.dtype.newbyteorder(">")), id="big-endian"),
        pytest.param(lambda a: np.frombuffer(a.tobytes(), a.dtype), id="read-only"),
    ],
)
def test_numpy_layouts_torch_cannot_view_are_copied(make: Any) -> None:
    base = np.arange(12, dtype=np.int32)
    arr = make(base)
    t = to_device(arr, "cpu")
    assert t.dtype == torch.int32
    np.testing.assert_array_equal(t.numpy(), arr)
    assert not np.shares_memory(t.numpy(), base)


def test_float64_to_float32_converts() -> None:
    arr = np.random.default_rng(1).standard_normal((3, 5))
    t = to_device(arr, "cpu", dtype=torch.float32)
    assert t.dtype == torch.float32
    np.testing.assert_array_equal(t.numpy(), arr.astype(np.float32))


def test_bool_and_scalars() -> None:
    arr = np.array([True, False, True])
    assert to_device(arr, "cpu").tolist() == [True, False, True]
    assert to_device(np.float32(2.5), "cpu").item() == 2.5


def test_tensor_already_there_is_returned_as_is() -> None:
    t = torch.arange(4)
    assert to_device(t, "cpu") is t
    assert to_device(t, "cpu", dtype=torch.int64) is t
    f = to_device(t, "cpu", dtype=torch.float32)
    assert f.dtype == torch.float32
    assert f.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("obj", "match"),
    [
        ("text", "str"),
        (np.array(["a", "b"]), "unsupported dtype"),
        (np.array([object()]), "unsupported dtype"),
        (12, "int"),
    ],
)
def test_unsupported_inputs_raise_type_error(obj: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        to_device(obj, "cpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only error")
def test_cuda_target_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        to_device(b"\x01", "cuda")


# --- DLPack ----------------------------------------------------------------------------------


def test_from_dlpack_shares_a_producers_memory() -> None:
    arr = np.arange(10, dtype=np.float32).reshape(2, 5)
    t = from_dlpack(FakeCupyArray(arr))
    assert t.data_ptr() == arr.__array_interface__["data"][0]
    t[0, 0] = 42.0
    assert arr[0, 0] == 42.0


def test_to_device_accepts_dlpack_producers() -> None:
    arr = np.arange(4, dtype=np.int16)
    t = to_device(FakeCupyArray(arr), "cpu")
    assert np.shares_memory(t.numpy(), arr)


def test_from_dlpack_numpy_negative_strides_copy_instead_of_aborting() -> None:
    # torch.from_dlpack on a negative-stride array aborts the whole process (torch 2.13).
    arr = np.arange(10)[::-1]
    np.testing.assert_array_equal(from_dlpack(arr).numpy(), arr)


def test_from_dlpack_rejects_non_producers() -> None:
    with pytest.raises(TypeError, match="not a DLPack producer"):
        from_dlpack([1, 2, 3])


def test_to_dlpack_round_trip_shares_and_detaches() -> None:
    t = torch.arange(6, dtype=torch.float32).requires_grad_()
    back = torch.from_dlpack(to_dlpack(t))
    assert back.data_ptr() == t.data_ptr()
    assert not back.requires_grad
    np.testing.assert_array_equal(np.from_dlpack(back), np.arange(6, dtype=np.float32))


def test_to_numpy_views_cpu_tensors() -> None:
    t = torch.arange(5, dtype=torch.int32)
    arr = to_numpy(t)
    arr[1] = 7
    assert t[1].item() == 7
    with pytest.raises(TypeError, match="bfloat16"):
        to_numpy(t.to(torch.bfloat16))


# --- StagingPool on any host -------------------------------------------------------------------


def _ptr(buf: StagingBuffer) -> int:
    return buf._block.data_ptr()


def _gather(pool: StagingPool, parts: list[Any]) -> torch.Tensor:
    """What the pipeline does: every payload written back to back, then one move."""
    sizes = [
        p.nbytes if isinstance(p, torch.Tensor) else _hostmem.as_array(p).nbytes for p in parts
    ]
    with pool.acquire(sum(sizes)) as buf:
        offset = 0
        for p, size in zip(parts, sizes, strict=True):
            end = buf.write(p, offset)
            assert end == offset + size
            offset = end
        return buf.to_device(pool.device).clone()


def test_pool_uses_ordinary_memory_for_the_cpu() -> None:
    pool = StagingPool("cpu")
    with pool.acquire(100) as buf:
        assert not buf._block.is_pinned()
        assert buf.nbytes == 100


def test_writes_concatenate_mixed_payloads() -> None:
    parts: list[Any] = [
        b"\x01\x02\x03",
        bytearray(b"\x04"),
        memoryview(b"\x05\x06"),
        np.array([[7, 8], [9, 10]], dtype=np.uint8).T,  # non-contiguous: written in C order
        torch.tensor([11, 12], dtype=torch.uint8),
        b"",
    ]
    data = _gather(StagingPool("cpu"), parts)
    assert data.tolist() == [1, 2, 3, 4, 5, 6, 7, 9, 8, 10, 11, 12]


def test_released_block_is_reused_and_held_blocks_are_not_shared() -> None:
    pool = StagingPool("cpu")
    with pool.acquire(50) as a, pool.acquire(50) as b:
        pa, pb = _ptr(a), _ptr(b)
        assert pa != pb
    with pool.acquire(60) as c:
        assert _ptr(c) in (pa, pb)
    assert len(pool._free) == 2


def test_smallest_fitting_block_is_chosen() -> None:
    pool = StagingPool("cpu")
    big_size = 4 * _staging.MIN_BLOCK_BYTES
    with pool.acquire(big_size) as big, pool.acquire(10) as small:
        p_big, p_small = _ptr(big), _ptr(small)
    with pool.acquire(12) as c:
        assert _ptr(c) == p_small
    with pool.acquire(_staging.MIN_BLOCK_BYTES + 1) as d:
        assert _ptr(d) == p_big


def test_cpu_to_device_hands_the_buffer_out_and_never_reuses_it() -> None:
    pool = StagingPool("cpu")
    with pool.acquire(4) as buf:
        buf.write(b"\x01\x02\x03\x04")
        out = buf.to_device("cpu")
        assert out.data_ptr() == _ptr(buf)  # no copy on the CPU
        with pytest.raises(RuntimeError, match="handed out"):
            buf.write(b"\x00")
    with pool.acquire(4) as again:
        again.write(b"\x09\x09\x09\x09")
        assert _ptr(again) != out.data_ptr()
    assert out.tolist() == [1, 2, 3, 4]


def test_misuse_is_reported() -> None:
    pool = StagingPool("cpu")
    with pool.acquire(4) as buf:
        with pytest.raises(ValueError, match="do not fit"):
            buf.write(b"12345")
        with pytest.raises(ValueError, match="do not fit"):
            buf.write(b"12", offset=3)
        with pytest.raises(ValueError, match="host data"):
            buf.write(torch.zeros(1, device="meta"))
    with pytest.raises(RuntimeError, match="released"):
        buf.write(b"1")
    with pytest.raises(ValueError, match="nbytes"):
        pool.acquire(-1).__enter__()


def test_cached_free_blocks_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_staging, "MAX_CACHED_BYTES", 3 * _staging.MIN_BLOCK_BYTES)
    pool = StagingPool("cpu")
    sizes = [_staging.MIN_BLOCK_BYTES, 2 * _staging.MIN_BLOCK_BYTES, 4 * _staging.MIN_BLOCK_BYTES]
    with pool.acquire(sizes[0]), pool.acquire(sizes[1]), pool.acquire(sizes[2]):
        pass
    # The largest block goes first: the two smaller ones fit under the bound.
    assert sorted(b.numel() for b in pool._free) == sizes[:2]


def test_pool_is_thread_safe() -> None:
    pool = StagingPool("cpu")
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(40):
            parts = [rng.integers(0, 256, rng.integers(0, 50), dtype=np.uint8) for _ in range(3)]
            data = _gather(pool, list(parts))
            if data.numpy().tobytes() != b"".join(p.tobytes() for p in parts):
                errors.append(f"seed {seed}: wrong bytes")
            with pool.acquire(64) as buf:
                buf.write(bytes([seed]) * 64)
                if set(buf._block[:64].tolist()) != {seed}:
                    errors.append(f"seed {seed}: buffer shared between threads")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --- CUDA: pinned memory, non_blocking copies and events ----------------------------------------


@pytest.mark.needs_cuda
def test_cuda_to_device_from_every_host_source() -> None:
    rng = np.random.default_rng(2)
    arr = rng.standard_normal((64, 33))
    for obj in (arr, arr[:, ::2], arr[::-1], np.frombuffer(arr.tobytes(), np.float64)):
        out = to_device(obj, "cuda", dtype=torch.float32)
        assert out.device.type == "cuda"
        assert out.dtype == torch.float32
        np.testing.assert_array_equal(out.cpu().numpy(), np.asarray(obj, dtype=np.float32))
    raw = bytes(range(256))
    assert to_device(raw, "cuda").cpu().tolist() == list(range(256))
    widened = to_device(np.array([0, 1, 255], dtype=np.uint8), "cuda", dtype=torch.float32)
    assert widened.tolist() == [0.0, 1.0, 255.0]


@pytest.mark.needs_cuda
def test_cuda_pinned_tensor_goes_straight_and_device_tensor_stays() -> None:
    src = torch.arange(1000, dtype=torch.int32).pin_memory()
    out = to_device(src, "cuda")
    torch.cuda.synchronize()
    assert out.cpu().equal(src)
    assert to_device(out, "cuda") is out
    back = to_device(out, "cpu")
    assert back.equal(src)


@pytest.mark.needs_cuda
def test_cuda_pool_is_pinned_and_copies_once() -> None:
    pool = StagingPool("cuda")
    parts: list[Any] = [np.full(1000, i, dtype=np.uint8) for i in range(5)]
    data = _gather(pool, parts)
    assert data.is_cuda
    np.testing.assert_array_equal(data.cpu().numpy(), np.concatenate(parts))
    with pool.acquire(10) as buf:
        assert buf._block.is_pinned()


@pytest.mark.needs_cuda
def test_cuda_block_is_not_reused_while_its_copy_is_in_flight() -> None:
    pool = StagingPool("cuda")
    payload = np.arange(1 << 20, dtype=np.uint8)
    torch.cuda._sleep(200_000_000)  # keep the stream busy so the copy stays queued
    with pool.acquire(payload.nbytes) as buf:
        buf.write(payload)
        first = _ptr(buf)
        out = buf.to_device("cuda")
    assert len(pool._inflight) == 1
    with pool.acquire(payload.nbytes) as again:
        again_ptr = _ptr(again)
        assert again_ptr != first  # still being read by the DMA engine
        again.write(np.zeros_like(payload))
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), payload)
    with pool.acquire(payload.nbytes) as third:  # both blocks are free again
        assert _ptr(third) in (first, again_ptr)
    assert not pool._inflight


@pytest.mark.needs_cuda
def test_cuda_rewriting_a_buffer_waits_for_its_copy() -> None:
    pool = StagingPool("cuda")
    payload = np.arange(1 << 20, dtype=np.uint8)
    with pool.acquire(payload.nbytes) as buf:
        buf.write(payload)
        torch.cuda._sleep(200_000_000)
        out = buf.to_device("cuda")
        buf.write(np.zeros_like(payload))  # must block until the copy above has read it
    torch.cuda.synchronize()
    np.testing.assert_array_equal(out.cpu().numpy(), payload)


@pytest.fixture
def old_dlpack(monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy < 2.1 or an older torch: read-only arrays cannot cross DLPack."""

    def refuse(obj: Any) -> torch.Tensor:
        raise BufferError("Cannot export readonly array since signalling readonly is unsupported")

    monkeypatch.setattr(_hostmem, "_torch_from_dlpack", refuse)


@pytest.mark.usefixtures("old_dlpack")
def test_readonly_sharing_without_dlpack_1_falls_back_silently() -> None:
    body = b"\x01\x02\x03\x04"
    t = to_device(body, "cpu", share_readonly=True)  # warnings are errors in this suite
    assert t.tolist() == [1, 2, 3, 4]
    assert t.data_ptr() == _addr(body)
    arr = np.frombuffer(body, dtype=np.uint8)
    assert from_dlpack(arr).data_ptr() == _addr(body)


@pytest.mark.usefixtures("old_dlpack")
def test_staging_write_copies_any_host_payload_without_dlpack() -> None:
    big = np.arange(12, dtype=">i4").reshape(3, 4)  # non-native byte order: values kept
    parts: list[Any] = [
        b"\x01\x02\x03",
        memoryview(np.arange(3, dtype=np.float32).tobytes()).cast("f"),
        np.arange(20, dtype=np.int16).reshape(4, 5)[:, ::2],  # strided
        np.arange(6, dtype=np.float64)[::-1],  # negative stride
        np.array([True, False, True]),
        np.float32(2.5),
        big.T,
        np.zeros((0, 3), dtype=np.float32),
    ]
    expected = b"".join(np.ascontiguousarray(np.asarray(p)).astype(
        np.asarray(p).dtype.newbyteorder("=")
    ).tobytes() for p in parts)  # fmt: skip
    data = _gather(StagingPool("cpu"), parts)
    assert data.numpy().tobytes() == expected
    pool = StagingPool("cpu")
    with pool.acquire(8) as buf:
        assert buf.write(b"\xff" * 4, offset=3) == 7  # unaligned offsets are fine
        with pytest.raises(ValueError, match="do not fit"):
            buf.write(np.zeros(2, dtype=np.float32), offset=4)
        with pytest.raises(TypeError, match="unsupported dtype"):
            buf.write(np.array(["a"]))


class _PendingCopy:
    """Stands in for the CUDA event of a copy still reading the buffer."""

    def __init__(self) -> None:
        self.waited = False

    def synchronize(self) -> None:
        self.waited = True

    def query(self) -> bool:
        return self.waited


@pytest.mark.parametrize("access", ["write", "to_device"])
def test_every_way_into_the_buffer_waits_for_its_inflight_copy(access: str) -> None:
    with StagingPool("cpu").acquire(4) as buf:
        pending = _PendingCopy()
        buf._event = pending  # type: ignore[assignment]
        if access == "write":
            buf.write(b"\x01" * 4)
        else:
            buf.to_device("cpu")
        assert pending.waited
