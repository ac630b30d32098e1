"""Memory measurements that need a fresh process (the tests check them, the benchmarks report
them)."""

from __future__ import annotations

import subprocess
import sys

_PEAK_SCRIPT = """
import torch
from gpu_ops import BandedResampler
def status(key):  # kB, from this process's memory map (reset by exec, unlike ru_maxrss)
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1])
x = torch.linspace(0, 1, {B}, dtype=torch.float64)
c = torch.rand({N}, {A}, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
T = torch.zeros({N}, {A}, {B})
for n in range({N}):  # one function at a time
    s, w = BandedResampler.from_response(x, c[n : n + 1], "gaussian", sigma={sigma!r}).band()
    T[n].scatter_(-1, s[0].long()[:, None] + torch.arange(w.shape[-1]), w[0])
    del s, w
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := the resident size now
before = status("VmRSS")
op = BandedResampler.from_dense(T)
print((status("VmHWM") - before) * 1024 / (T.numel() * T.element_size()))
"""


def from_dense_peak(N: int, A: int, B: int, sigma: float) -> float:
    """Peak resident memory of ``from_dense`` above the resident size before it (T and the
    interpreter), in units of T, for a Gaussian band; in a fresh process (Linux: /proc)."""
    code = _PEAK_SCRIPT.format(N=N, A=A, B=B, sigma=sigma)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout)
