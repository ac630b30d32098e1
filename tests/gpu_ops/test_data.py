"""gpu_ops.data: packed datasets, collate, the device prefetcher and pack_array vs NumPy."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from gpu_ops.data import (
    DevicePrefetcher,
    PackedBatch,
    PackedBitsDataset,
    collate_packed,
    pack_array,
)
from tests.common_utils import cpu_and_cuda

ROWS, L = 37, 21  # neither a multiple of the batch size nor of 8


def _dataset(
    rng: np.random.Generator, bitorder: str = "big", rows: int = ROWS
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Dense 0/1 features (rows, 3, L) and their packing along the last axis."""
    dense = rng.integers(0, 2, (rows, 3, L), dtype=np.uint8)
    return dense, np.packbits(dense, axis=-1, bitorder=bitorder)  # type: ignore[arg-type]


def _expected(packed: np.ndarray[Any, Any], bitorder: str, dtype: torch.dtype) -> torch.Tensor:
    ref = np.unpackbits(packed, axis=-1, count=L, bitorder=bitorder)  # type: ignore[arg-type]
    return torch.from_numpy(ref).to(dtype)


def _row_ids(rows: int) -> np.ndarray[Any, Any]:
    return np.arange(rows, dtype=np.int64)


@pytest.mark.parametrize("device", cpu_and_cuda())
@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_batches_equal_numpy_unpackbits(device: str, bitorder: str, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    _, packed = _dataset(rng, bitorder)
    labels = rng.standard_normal(ROWS).astype(np.float32)
    extra = rng.integers(0, 100, (ROWS, 2))
    ds = PackedBitsDataset(packed, L, bitorder=bitorder, labels=labels, extras=[extra])
    loader = DataLoader(ds, batch_size=8, collate_fn=collate_packed)
    batches = list(DevicePrefetcher(loader, device, dtype=dtype, reuse_buffers=False))
    assert [b.features.shape[0] for b in batches] == [8, 8, 8, 8, 5]  # last batch partial
    for b in batches:
        assert b.features.device.type == device
        assert b.features.dtype == dtype
        assert b.features.shape[1:] == (3, L)
    got = torch.cat([b.features.cpu() for b in batches])
    torch.testing.assert_close(got, _expected(packed, bitorder, dtype), rtol=0, atol=0)
    torch.testing.assert_close(
        torch.cat([b.labels.cpu() for b in batches]), torch.from_numpy(labels)
    )  # type: ignore[union-attr]
    torch.testing.assert_close(
        torch.cat([b.extras[0].cpu() for b in batches]), torch.from_numpy(extra)
    )


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_shuffled_batches_keep_rows_and_labels_together(device: str) -> None:
    rng = np.random.default_rng(1)
    _, packed = _dataset(rng)
    ds = PackedBitsDataset(packed, L, labels=_row_ids(ROWS))
    g = torch.Generator().manual_seed(3)
    loader = DataLoader(ds, batch_size=6, shuffle=True, generator=g, collate_fn=collate_packed)
    expected = _expected(packed, "big", torch.float32)
    seen: list[int] = []
    for x, ids, _ in DevicePrefetcher(loader, device):
        assert ids is not None
        torch.testing.assert_close(x.cpu(), expected[ids.cpu()], rtol=0, atol=0)
        seen += ids.tolist()
    assert sorted(seen) == list(range(ROWS))
    assert seen != list(range(ROWS))  # it did shuffle


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_memmap_dataset_with_two_workers(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    _, packed = _dataset(rng, "little")
    np.save(tmp_path / "bits.npy", packed)
    np.save(tmp_path / "ids.npy", _row_ids(ROWS))
    ds = PackedBitsDataset(tmp_path / "bits.npy", L, bitorder="little", labels=tmp_path / "ids.npy")
    assert isinstance(ds.bits, np.memmap)
    loader = DataLoader(
        ds,
        batch_size=5,
        shuffle=True,
        num_workers=2,
        collate_fn=collate_packed,
        generator=torch.Generator().manual_seed(0),
    )
    expected = _expected(packed, "little", torch.float32)
    seen: list[int] = []
    for x, ids, _ in DevicePrefetcher(loader, "cpu"):
        assert ids is not None
        torch.testing.assert_close(x, expected[ids], rtol=0, atol=0)
        seen += ids.tolist()
    assert sorted(seen) == list(range(ROWS))


def test_pickled_memmap_dataset_reopens_the_file_instead_of_copying(tmp_path: Path) -> None:
    packed = np.zeros((1000, 64), dtype=np.uint8)
    np.save(tmp_path / "bits.npy", packed)
    ds = PackedBitsDataset(str(tmp_path / "bits.npy"))
    blob = pickle.dumps(ds)
    assert len(blob) < packed.nbytes // 10
    again = pickle.loads(blob)  # our own object, made just above
    assert isinstance(again.bits, np.memmap)
    assert len(again) == 1000


def test_prefetcher_yields_every_batch_once_in_order() -> None:
    batches = [
        PackedBatch(torch.full((4, 1), k, dtype=torch.uint8), torch.tensor([k]), ())
        for k in range(7)
    ]
    pf = DevicePrefetcher(batches, "cpu", length=8, dtype=torch.uint8)
    assert len(pf) == 7
    out = [(b.features.clone(), b.labels) for b in pf]
    assert [int(lab.item()) for _, lab in out] == list(range(7))  # type: ignore[union-attr]
    for k, (x, _) in enumerate(out):
        bits = np.unpackbits(np.full((4, 1), k, dtype=np.uint8), axis=-1)
        assert x.equal(torch.from_numpy(bits))


def test_reused_buffers_alternate_and_fresh_ones_do_not() -> None:
    rng = np.random.default_rng(4)
    _, packed = _dataset(rng, rows=32)
    loader = DataLoader(PackedBitsDataset(packed, L), batch_size=8, collate_fn=collate_packed)
    ptrs = [b.features.data_ptr() for b in DevicePrefetcher(loader, "cpu")]
    assert ptrs[0] == ptrs[2] != ptrs[1] == ptrs[3]
    kept = [b.features for b in DevicePrefetcher(loader, "cpu", reuse_buffers=False)]
    assert len({t.data_ptr() for t in kept}) == 4
    expected = _expected(packed, "big", torch.float32)
    torch.testing.assert_close(torch.cat(kept), expected, rtol=0, atol=0)


def test_dense_loader_without_unpacking() -> None:
    dense = torch.randint(0, 2, (10, 5), dtype=torch.int8)
    batches = [PackedBatch(dense[:6], None, ()), PackedBatch(dense[6:], None, ())]
    out = [b.features.clone() for b in DevicePrefetcher(batches, "cpu", unpack=False)]
    torch.testing.assert_close(torch.cat(out), dense.float(), rtol=0, atol=0)


def test_collate_of_single_rows_matches_batched_fetch() -> None:
    rng = np.random.default_rng(5)
    _, packed = _dataset(rng)
    ds = PackedBitsDataset(packed, L, labels=_row_ids(ROWS), extras=[packed[:, 0]])
    idx = [5, 0, 36, 5]
    single = collate_packed([ds[i] for i in idx])
    batched = collate_packed(ds.__getitems__(idx))
    for a, b in zip(single, batched, strict=True):
        if isinstance(a, tuple):
            assert all(x.equal(y) for x, y in zip(a, b, strict=True))
        else:
            assert a.equal(b)
    assert single.bits.equal(torch.from_numpy(packed[idx]))


def test_prefetcher_rejects_other_batches() -> None:
    with pytest.raises(TypeError, match="collate_packed"):
        list(DevicePrefetcher([torch.zeros(2, 1, dtype=torch.uint8)], "cpu", length=8))  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"bits": np.zeros((4, 2), np.int8)}, TypeError, "uint8"),
        ({"bits": np.zeros(4, np.uint8)}, ValueError, "rows"),
        ({"bits": np.zeros((4, 2), np.uint8), "length": 17}, ValueError, "length=17"),
        ({"bits": np.zeros((4, 2), np.uint8), "length": 8}, ValueError, "length=8"),
        ({"bits": np.zeros((4, 2), np.uint8), "bitorder": "middle"}, ValueError, "bitorder"),
        ({"bits": np.zeros((4, 2), np.uint8), "labels": np.zeros(3)}, ValueError, "labels has 3"),
        ({"bits": [[1, 2]]}, TypeError, "NumPy array"),
    ],
)
def test_dataset_rejects_bad_input(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        PackedBitsDataset(**kwargs)


def test_dataset_index_out_of_range() -> None:
    ds = PackedBitsDataset(np.zeros((4, 2), np.uint8), 16)
    with pytest.raises(IndexError, match="4 rows"):
        ds[4]
    assert ds[-1].bits.shape == (2,)


def test_fetched_rows_are_fresh_writable_arrays(tmp_path: Path) -> None:
    """Batches never alias the dataset (in memory or a read-only memmap) and are writable."""
    packed = np.random.default_rng(10).integers(0, 256, (12, 3), dtype=np.uint8)
    np.save(tmp_path / "bits.npy", packed)
    labels = np.arange(12, dtype=np.int64)
    extra = np.arange(24, dtype=np.float32).reshape(12, 2)
    extra.flags.writeable = False
    for source in (packed.copy(), tmp_path / "bits.npy"):
        ds = PackedBitsDataset(source, 24, labels=labels, extras=[extra])
        bits_before = ds.bits.copy()
        for batch in (ds.__getitems__([3, 1, 3]), ds[5]):
            rows = [5] if batch.bits.dim() == 1 else [3, 1, 3]
            assert batch.labels is not None
            tensors = (batch.bits, batch.labels, *batch.extras)
            for t, a in zip(tensors, (ds.bits, labels, extra), strict=True):
                assert np.array_equal(t.numpy(), a[rows].reshape(t.shape))
                t.fill_(0)  # writable, and must not reach the dataset
        np.testing.assert_array_equal(ds.bits, bits_before)
    np.testing.assert_array_equal(labels, np.arange(12))
    np.testing.assert_array_equal(extra, np.arange(24, dtype=np.float32).reshape(12, 2))


# --- pack_array ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize(
    ("shape", "dim"), [((50, 13), -1), ((50, 13), 0), ((9, 4, 10), 1), ((23,), 0), ((0, 5), -1)]
)
@pytest.mark.parametrize("dtype", [np.int8, np.bool_, np.uint8, np.int64])
def test_pack_array_matches_numpy_packbits(
    shape: tuple[int, ...], dim: int, bitorder: str, dtype: Any
) -> None:
    rng = np.random.default_rng(6)
    arr = rng.integers(0, 3, shape).astype(dtype)  # 2s too: any nonzero is a one
    expected = np.packbits(arr, axis=dim, bitorder=bitorder)  # type: ignore[arg-type]
    row_bytes = max(arr[:1].nbytes, 1)
    got = pack_array(arr, dim, bitorder=bitorder, chunk_bytes=3 * row_bytes)  # many chunks
    np.testing.assert_array_equal(got, expected)


def test_pack_array_memmap_to_file_with_progress(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    dense = rng.integers(0, 2, (301, 2, 19), dtype=np.int8)
    np.save(tmp_path / "dense.npy", dense)
    src = np.load(tmp_path / "dense.npy", mmap_mode="r")
    out = pack_array(src, out=tmp_path / "packed.npy", chunk_bytes=1000, progress=True)
    assert isinstance(out, np.memmap)
    on_disk = np.load(tmp_path / "packed.npy")
    np.testing.assert_array_equal(on_disk, np.packbits(dense, axis=-1))
    ds = PackedBitsDataset(tmp_path / "packed.npy", 19)
    x = next(
        iter(DevicePrefetcher(DataLoader(ds, batch_size=301, collate_fn=collate_packed), "cpu"))
    )
    assert x.features.equal(torch.from_numpy(dense).float())


def test_pack_array_errors() -> None:
    with pytest.raises(TypeError, match="float64"):
        pack_array(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="dim 2"):
        pack_array(np.zeros((2, 3), np.int8), 2)
    with pytest.raises(ValueError, match="bitorder"):
        pack_array(np.zeros((2, 3), np.int8), bitorder="BIG")
    with pytest.raises(ValueError, match="other than 0/1"):
        pack_array(np.array([[0, 1, 2]], np.int8), check_binary=True)


def test_pack_array_refuses_to_overwrite_its_own_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dense = np.random.default_rng(9).integers(0, 2, (40, 24), dtype=np.uint8)
    path = tmp_path / "dense.npy"
    np.save(path, dense)
    monkeypatch.chdir(tmp_path)
    mm = np.load(path, mmap_mode="r")
    same_paths: list[Any] = [path, str(path), "dense.npy", tmp_path / "." / "dense.npy"]
    for source in (path, str(path), mm, mm[5:], np.asarray(mm)[::2]):
        for out in same_paths:
            with pytest.raises(ValueError, match="truncate the input"):
                pack_array(source, out=out)
    (tmp_path / "link.npy").symlink_to(path)
    with pytest.raises(ValueError, match="truncate the input"):
        pack_array(path, out=tmp_path / "link.npy")
    with pytest.raises(ValueError, match="truncate the input"):
        pack_array(tmp_path / "link.npy", out=path)
    np.testing.assert_array_equal(np.load(path), dense)  # the input survived every attempt
    got = pack_array(mm, out=tmp_path / "packed.npy")  # another path is fine
    np.testing.assert_array_equal(got, np.packbits(dense, axis=-1))


# --- CUDA: stream handling ------------------------------------------------------------------------


def _big_dataset(rows: int = 64, length: int = 1 << 16) -> tuple[PackedBitsDataset, torch.Tensor]:
    rng = np.random.default_rng(8)
    packed = rng.integers(0, 256, (rows, length // 8), dtype=np.uint8)
    ds = PackedBitsDataset(packed, length, labels=_row_ids(rows))
    return ds, torch.from_numpy(np.unpackbits(packed, axis=-1)).float()


@pytest.mark.needs_cuda
@pytest.mark.parametrize("pin_memory", [True, False])
def test_cuda_batches_survive_a_busy_consumer_stream(pin_memory: bool) -> None:
    # The consumer queues slow work before reading each batch; if the side stream did not
    # wait for it before overwriting a reused buffer, the clones below would see later rows.
    ds, expected = _big_dataset()
    loader = DataLoader(ds, batch_size=8, collate_fn=collate_packed, pin_memory=pin_memory)
    got, ids = [], []
    for x, y, _ in DevicePrefetcher(loader, "cuda"):
        assert y is not None
        torch.cuda._sleep(20_000_000)
        got.append(x.clone())
        ids.append(y)
    torch.cuda.synchronize()
    torch.testing.assert_close(torch.cat(got).cpu(), expected[torch.cat(ids).cpu()], rtol=0, atol=0)


@pytest.mark.needs_cuda
def test_cuda_batches_are_not_read_before_their_copy_finishes() -> None:
    # Each batch is large, so its copy and unpack on the side stream take a while; reading it
    # at once on the caller's stream must still see the finished data.
    ds, expected = _big_dataset(rows=32, length=1 << 20)
    loader = DataLoader(ds, batch_size=16, collate_fn=collate_packed, pin_memory=True)
    sums = [x.sum(dim=-1) for x, _, _ in DevicePrefetcher(loader, "cuda")]
    torch.testing.assert_close(torch.cat(sums).cpu(), expected.sum(dim=-1), rtol=0, atol=0)


def test_pack_array_progress_without_tqdm_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    arr = np.ones((4, 9), np.int8)
    with pytest.raises(ImportError, match="needs tqdm"):
        pack_array(arr, progress=True)
    np.testing.assert_array_equal(pack_array(arr), np.packbits(arr, axis=-1))  # no bar: fine


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_epoch_left_early_does_not_disturb_the_next(device: str) -> None:
    """Stop an epoch with batch 1 still being prefetched; the next epoch is still exact."""
    rng = np.random.default_rng(11)
    _, packed = _dataset(rng)
    ds = PackedBitsDataset(packed, L, labels=_row_ids(ROWS))
    loader = DataLoader(ds, batch_size=4, collate_fn=collate_packed)
    pf = DevicePrefetcher(loader, device)
    expected = _expected(packed, "big", torch.float32)
    for _ in range(3):
        first = next(iter(pf))  # the generator is dropped with a prefetch in flight
        assert first.labels is not None
        torch.testing.assert_close(first.features.cpu(), expected[first.labels.cpu()])
        for x, ids, _ in pf:
            assert ids is not None
            torch.testing.assert_close(x.cpu(), expected[ids.cpu()], rtol=0, atol=0)
    if device == "cuda":
        side = pf._side
        assert side is not None
        list(pf)
        assert pf._side is side  # one side stream for the prefetcher's life
