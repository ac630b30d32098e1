"""gpu_ops.unpackbits / packbits against NumPy and naive torch shifts (issue 2).

Run as ``python -m benchmarks.bench_bits [--smoke] [--device cpu|cuda]``. 32 MiB of packed
input (256 KiB with ``--smoke``). "new" rows allocate the result, as NumPy does; "out=" rows
write into a preallocated tensor, as the server's batcher does; "C kernel" rows run the
compiled CPU kernel (the default when a C compiler is present), "torch path" rows the
chunked torch fallback, in the same run. The CPU section runs with torch's default thread
count, then again with one thread. GB/s counts bytes written;
the copy row is the floor: a ``copy_`` of the same number of bytes between preallocated
buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from benchmarks._common import copy_bandwidth, markdown_table, median_time, parse_args, report
from gpu_ops import _bits_c, _bits_torch, packbits, unpackbits

HEADERS = ("case", "median ms", "output GB/s", "% of copy", "speed-up vs baseline")


def _naive_unpack(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What users write today: broadcast shifts, then a conversion."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=x.device)
    return ((x[:, None] >> shifts) & 1).reshape(-1).to(dtype)


def _naive_pack(bits: torch.Tensor) -> torch.Tensor:
    weights = 1 << torch.arange(7, -1, -1, device=bits.device)
    return (bits.reshape(-1, 8).long() * weights).sum(-1).to(torch.uint8)


class _Table:
    """Collects rows: each case's time, its output rate and its speed-up over a baseline.

    The speed-up compares output elements per second, so a case that writes a different
    amount than its baseline (the batch-buffer row, bfloat16 against NumPy's float32) is
    still compared for the same work.
    """

    def __init__(self, device: str, copy_bw: float, repeat: int) -> None:
        self.device, self.copy_bw, self.repeat = device, copy_bw, repeat
        self.rows: list[list[object]] = []
        self.rates: dict[str, float] = {}

    def add(
        self,
        case: str,
        fn: Callable[[], object],
        out_bytes: int,
        baseline: str | None = None,
        repeat: int | None = None,
        *,
        itemsize: int = 1,
    ) -> None:
        t = median_time(fn, device=self.device, repeat=repeat or self.repeat, warmup=1)
        rate = out_bytes / t
        self.rates[case] = rate / itemsize  # elements per second
        speedup = self.rates[case] / self.rates[baseline] if baseline else 1.0
        ratio = f"{speedup:.2f}x vs {baseline}" if baseline else "baseline"
        self.rows.append([case, t * 1e3, rate / 1e9, f"{100 * rate / self.copy_bw:.0f}%", ratio])


def _torch_path(x: torch.Tensor, out: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The chunked torch unpack (the fallback without a C compiler) into ``out``."""
    _bits_torch.unpack_into(x, out, dim, "big")
    return out


def _cpu_section(n_bytes: int, repeat: int) -> str:
    gen = np.random.default_rng(0)
    a = gen.integers(0, 256, n_bytes, dtype=np.uint8)
    x = torch.from_numpy(a)
    n_out = 8 * n_bytes
    bw = copy_bandwidth("cpu", n_out * 4)
    tab = _Table("cpu", bw, repeat)
    slow = max(2, repeat // 5)
    ours = "ours (C kernel)" if _bits_c.kernels() is not None else "ours (no C compiler)"
    tp = "ours (torch path)"
    tab.add("numpy.unpackbits", lambda: np.unpackbits(a), n_out)
    tab.add(
        "torch naive shifts -> uint8",
        lambda: _naive_unpack(x, torch.uint8),
        n_out,
        "numpy.unpackbits",
        slow,
    )
    # A fresh result's first touch (page faults, the OS zeroing pages) bounds every "new" row.
    tab.add(
        "fresh uint8 result, fill only (floor for new)",
        lambda: _bits_c.empty([n_out], torch.uint8, x.device).fill_(0),
        n_out,
        "numpy.unpackbits",
    )
    tab.add(f"{ours} -> uint8 (new)", lambda: unpackbits(x), n_out, "numpy.unpackbits")
    out8 = torch.empty(n_out, dtype=torch.uint8)
    tab.add(f"{ours} -> uint8 (out=)", lambda: unpackbits(x, out=out8), n_out, "numpy.unpackbits")
    tab.add(f"{tp} -> uint8 (out=)", lambda: _torch_path(x, out8), n_out, "numpy.unpackbits")
    base32 = "numpy.unpackbits().astype(float32)"
    tab.add(base32, lambda: np.unpackbits(a).astype(np.float32), 4 * n_out, itemsize=4)
    tab.add(
        "torch naive shifts -> float32",
        lambda: _naive_unpack(x, torch.float32),
        4 * n_out,
        base32,
        slow,
        itemsize=4,
    )
    f32 = torch.float32
    tab.add(
        "fresh float32 result, fill only (floor for new)",
        lambda: _bits_c.empty([n_out], f32, x.device).fill_(0),
        4 * n_out,
        base32,
        itemsize=4,
    )
    tab.add(
        f"{ours} -> float32 (new)",
        lambda: unpackbits(x, dtype=f32),
        4 * n_out,
        base32,
        itemsize=4,
    )
    out32 = torch.empty(n_out, dtype=f32)
    tab.add(
        f"{ours} -> float32 (out=)",
        lambda: unpackbits(x, dtype=f32, out=out32),
        4 * n_out,
        base32,
        itemsize=4,
    )
    tab.add(f"{tp} -> float32 (out=)", lambda: _torch_path(x, out32), 4 * n_out, base32, itemsize=4)
    # The server's call: rows of L bits into one input's slice of a (rows, 2, L) batch buffer.
    L = 50_000
    rows = n_out // (2 * L)  # as many rows as fit in the float32 buffer
    packed = x[: rows * ((L + 7) // 8)].view(rows, -1)
    batch = out32[: rows * 2 * L].view(rows, 2, L)
    tab.add(
        f"{ours} -> float32 (out=buf[:, 1], L={L})",
        lambda: unpackbits(packed, dim=-1, count=L, dtype=f32, out=batch[:, 1]),
        4 * rows * L,
        base32,
        itemsize=4,
    )
    tab.add(
        f"{tp} -> float32 (out=buf[:, 1], L={L})",
        lambda: _torch_path(packed, batch[:, 1], 1),
        4 * rows * L,
        base32,
        itemsize=4,
    )
    for dt in (torch.bfloat16, torch.float16):
        name = str(dt).removeprefix("torch.")
        size = n_out * 2
        tab.add(
            f"{ours} -> {name} (new)",
            lambda dt=dt: unpackbits(x, dtype=dt),
            size,
            base32,
            itemsize=dt.itemsize,
        )
        out16 = torch.empty(n_out, dtype=dt)
        tab.add(
            f"{ours} -> {name} (out=)",
            lambda dt=dt, o=out16: unpackbits(x, dtype=dt, out=o),
            size,
            base32,
            itemsize=dt.itemsize,
        )
        tab.add(
            f"{tp} -> {name} (out=)",
            lambda o=out16: _torch_path(x, o),
            size,
            base32,
            itemsize=dt.itemsize,
        )
        del out16
    bits_np = np.unpackbits(a).view(np.bool_)
    bits = torch.from_numpy(bits_np)
    tab.add("numpy.packbits (bool)", lambda: np.packbits(bits_np), n_bytes)
    tab.add("ours packbits (bool)", lambda: packbits(bits), n_bytes, "numpy.packbits (bool)")
    tab.add(
        "ours packbits, torch-only path (bool)",
        lambda: _pack_torch(bits),
        n_bytes,
        "numpy.packbits (bool)",
    )
    head = (
        f"### CPU ({torch.get_num_threads()} torch threads), {n_bytes / 2**20:g} MiB packed\n\n"
        f"Copy bandwidth (floor): {bw / 1e9:.1f} GB/s. The C kernel can pass it: it reads "
        "1/8 to 1/64 of what it writes, and streams big reused outputs past the cache "
        "(a copy reads every line it overwrites).\n\n"
    )
    return head + markdown_table(HEADERS, tab.rows)


def _pack_torch(bits: torch.Tensor) -> torch.Tensor:
    out = torch.empty((bits.numel() + 7) // 8, dtype=torch.uint8, device=bits.device)
    _bits_torch.pack_into(bits.view(torch.uint8), out, 0, "big")
    return out


def _device_name(dev: str) -> str:
    return torch.cuda.get_device_name(dev) if torch.device(dev).type == "cuda" else dev


def _cuda_section(n_bytes: int, repeat: int, dev: str = "cuda") -> str:
    x = torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, device=dev)
    n_out = 8 * n_bytes
    bw = copy_bandwidth(dev, n_out * 4)
    tab = _Table(dev, bw, repeat)
    for dt in (torch.uint8, torch.bfloat16, torch.float32):
        name = str(dt).removeprefix("torch.")
        size = n_out * dt.itemsize
        naive = f"torch naive shifts -> {name}"
        tab.add(naive, lambda dt=dt: _naive_unpack(x, dt), size, itemsize=dt.itemsize)
        out = torch.empty(n_out, dtype=dt, device=dev)
        tab.add(
            f"ours -> {name} (out=)",
            lambda dt=dt, o=out: unpackbits(x, dtype=dt, out=o),
            size,
            naive,
            itemsize=dt.itemsize,
        )
        tab.add(
            f"ours -> {name} (new)",
            lambda dt=dt: unpackbits(x, dtype=dt),
            size,
            naive,
            itemsize=dt.itemsize,
        )
        tab.add(
            f"ours, torch-only path -> {name} (out=)",
            lambda o=out: _bits_torch.unpack_into(
                x, o.view(torch.uint8) if o.dtype == torch.bool else o, 0, "big"
            ),
            size,
            naive,
            itemsize=dt.itemsize,
        )
    L = 50_000
    nb = (L + 7) // 8
    rows = n_bytes // nb
    packed = x[: rows * nb].view(rows, nb)
    buf = torch.empty(rows, 2, L, dtype=torch.float32, device=dev)
    tab.add(
        f"ours -> float32 (out=buf[:, 1], L={L})",
        lambda: unpackbits(packed, dim=-1, count=L, dtype=torch.float32, out=buf[:, 1]),
        4 * rows * L,
        "torch naive shifts -> float32",
        itemsize=4,
    )
    bits = unpackbits(x, dtype=torch.bool)
    tab.add("torch naive pack", lambda: _naive_pack(bits), n_bytes)
    tab.add("ours packbits (bool)", lambda: packbits(bits), n_bytes, "torch naive pack")
    head = (
        f"### {dev} ({_device_name(dev)}), {n_bytes / 2**20:g} MiB packed\n\n"
        f"Copy bandwidth (floor): {bw / 1e9:.1f} GB/s. Target: unpack at >= 70% of it.\n\n"
    )
    return head + markdown_table(HEADERS, tab.rows)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(__doc__ or "", argv)
    n_bytes = (256 << 10) if args.smoke else (32 << 20)
    repeat = 3 if args.smoke else 5
    sections = []
    for device in args.device:
        if torch.device(device).type == "cuda":
            sections.append(_cuda_section(n_bytes, 5 if args.smoke else 20))
        else:
            sections.append(_cpu_section(n_bytes, repeat))
            threads = torch.get_num_threads()
            if threads > 1 and not args.smoke:  # and single-threaded, for the record
                torch.set_num_threads(1)
                try:
                    sections.append(_cpu_section(n_bytes, repeat))
                finally:
                    torch.set_num_threads(threads)
    report(
        "bits",
        "bit unpacking and packing",
        "\n\n".join(sections),
        smoke=args.smoke,
        devices=args.device,
    )


if __name__ == "__main__":
    main()
