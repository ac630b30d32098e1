"""``bitserve_client.plink``: the .bed transposed to one row of 2-bit codes per sample,
against unpacking every genotype with NumPy; sample and variant selections; the variant
check against a model's metadata. NumPy only (the client's tests run without torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from bitserve_client import plink


def _write(prefix: Path, codes: np.ndarray) -> None:
    """codes (samples, variants) 0..3 -> prefix.bed/.bim/.fam."""
    n, L = codes.shape
    nb = (n + 3) // 4
    padded = np.zeros((L, nb * 4), np.uint8)
    padded[:, :n] = codes.T
    blocks = (padded.reshape(L, nb, 4).astype(np.uint32) << (2 * np.arange(4))).sum(-1)
    prefix.with_suffix(".bed").write_bytes(b"\x6c\x1b\x01" + blocks.astype(np.uint8).tobytes())
    prefix.with_suffix(".bim").write_text("".join(f"1\trs{i}\t0\t{i}\tA\tG\n" for i in range(L)))
    prefix.with_suffix(".fam").write_text("".join(f"F{i}\tI{i}\t0\t0\t0\t-9\n" for i in range(n)))


def _packed(codes: np.ndarray) -> np.ndarray:
    """Reference: (n, L) codes -> (n, ceil(L / 4)) bytes, the first code lowest."""
    n, L = codes.shape
    padded = np.zeros((n, (L + 3) // 4 * 4), np.uint8)
    padded[:, :L] = codes
    grouped = padded.reshape(n, -1, 4).astype(np.uint32) << (2 * np.arange(4))
    return grouped.sum(-1).astype(np.uint8)


@pytest.mark.parametrize(("n", "L"), [(1, 1), (5, 3), (4, 4), (13, 37), (300, 21), (258, 130)])
def test_read_bed_matches_numpy(tmp_path: Path, n: int, L: int) -> None:
    codes = np.random.default_rng(n * 1000 + L).integers(0, 4, (n, L), dtype=np.uint8)
    _write(tmp_path / "d", codes)
    got = plink.read_bed(tmp_path / "d.bed")
    assert got.shape == (n, (L + 3) // 4)
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, _packed(codes))


def test_read_bed_selections(tmp_path: Path) -> None:
    codes = np.random.default_rng(7).integers(0, 4, (70, 45), dtype=np.uint8)
    _write(tmp_path / "d", codes)
    samples, variants = [69, 3, 40, 41], [44, 0, 7, 8, 9]
    got = plink.read_bed(tmp_path / "d.bed", samples=samples, variants=variants)
    np.testing.assert_array_equal(got, _packed(codes[samples][:, variants]))
    got = plink.read_bed(tmp_path / "d.bed", samples=slice(10, 30), variants=slice(5, 40))
    np.testing.assert_array_equal(got, _packed(codes[10:30, 5:40]))


def test_read_bed_refuses_other_files(tmp_path: Path) -> None:
    codes = np.zeros((8, 4), np.uint8)
    _write(tmp_path / "d", codes)
    bed = tmp_path / "d.bed"
    bed.write_bytes(b"\x6c\x1b\x00" + bed.read_bytes()[3:])
    with pytest.raises(ValueError, match=r"not a variant-major PLINK \.bed"):
        plink.read_bed(bed)
    bed.write_bytes(b"\x6c\x1b\x01" + b"\x00" * 5)
    with pytest.raises(ValueError, match=r"8 bytes; 4 variants x 8 samples take 11"):
        plink.read_bed(bed)


def test_readers_and_hash(tmp_path: Path) -> None:
    _write(tmp_path / "d", np.zeros((3, 2), np.uint8))
    v = plink.read_bim(tmp_path / "d.bim")
    assert v.ids == ["rs0", "rs1"]
    assert (v.a1, v.a2) == (["A", "A"], ["G", "G"])
    s = plink.read_fam(tmp_path / "d.fam")
    assert (s.fid, s.iid) == (["F0", "F1", "F2"], ["I0", "I1", "I2"])
    import hashlib

    assert plink.ids_sha256(v) == hashlib.sha256(b"rs0\tA\tG\nrs1\tA\tG\n").hexdigest()


def test_check_variants(tmp_path: Path) -> None:
    _write(tmp_path / "d", np.zeros((3, 2), np.uint8))
    v = plink.read_bim(tmp_path / "d.bim")
    meta = {"inputs": [{"parameters": {"logical_shape": [2], "ids_sha256": plink.ids_sha256(v)}}]}
    plink.check_variants(meta, v)
    meta["inputs"][0]["parameters"]["logical_shape"] = [3]
    with pytest.raises(plink.VariantMismatchError, match=r"scores \[3\] variants; the .bim has 2"):
        plink.check_variants(meta, v)
    meta["inputs"][0]["parameters"] = {"logical_shape": [2], "ids_sha256": "0" * 64}
    with pytest.raises(plink.VariantMismatchError, match="not the model's"):
        plink.check_variants(meta, v)


def test_read_bed_in_several_variant_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plink, "_BLOCK_VARIANTS", 8)
    codes = np.random.default_rng(3).integers(0, 4, (29, 43), dtype=np.uint8)
    _write(tmp_path / "d", codes)
    np.testing.assert_array_equal(plink.read_bed(tmp_path / "d.bed"), _packed(codes))
