"""Device strings: one parser for model configs, server settings and the pipeline; and the
one worker thread per device that runs its batches (:class:`DeviceExecutors`).

A device is written ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. ``auto`` in a model's config
defers to the server's ``device`` setting; ``auto`` there means CUDA device 0 when there is
one, else the CPU (a worker of ``--workers`` may be given its own CUDA device instead).
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor

_SYNTAX = re.compile(r"(auto|cpu|cuda)(?::(\d{1,4}))?")
SYNTAX = '"auto", "cpu", "cuda" or "cuda:N"'


def parse_device(text: str) -> tuple[str, int | None]:
    """``(kind, index)`` of a device string: ``("cuda", 1)`` for ``cuda:1``, ``("cuda", None)``
    for ``cuda``, ``("cpu", None)``, ``("auto", None)``.

    Raises:
        ValueError: anything else, naming the accepted forms.
    """
    m = _SYNTAX.fullmatch(text)
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ValueError(f"{text!r} is not {SYNTAX}")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def cuda_count() -> int:
    """CUDA devices this host has (0 without CUDA)."""
    import torch  # only here: configs and settings stay importable without it

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: str, default: str = "auto") -> str:
    """A concrete device (``"cpu"`` or ``"cuda:N"``) for a config's ``device``.

    Args:
        device: the config's device string.
        default: the server's device setting, used when ``device`` is ``auto``.

    Raises:
        ValueError: a malformed string, or a CUDA device this host does not have.
    """
    kind, index = parse_device(device)
    if kind == "auto":
        kind, index = parse_device(default)
    if kind == "auto":
        return "cuda:0" if cuda_count() else "cpu"
    if kind == "cpu":
        return "cpu"
    index = index or 0
    count = cuda_count()
    if index >= count:
        raise ValueError(f"device {device!r} requested but this host has {count} CUDA device(s)")
    return f"cuda:{index}"


class DeviceExecutors:
    """One single-thread executor per device, shared by the models placed on it.

    Device work is serialised per device (one CUDA context, one stream of batches), while
    different devices run in parallel and the event loop never blocks.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executors: dict[str, ThreadPoolExecutor] = {}

    def get(self, device: str) -> ThreadPoolExecutor:
        """The executor of ``device`` (e.g. ``"cuda:0"``, ``"cpu"``), created on first use."""
        with self._lock:
            ex = self._executors.get(device)
            if ex is None:
                ex = ThreadPoolExecutor(1, thread_name_prefix=f"bitserve-{device}")
                self._executors[device] = ex
            return ex

    def shutdown(self) -> None:
        """Stop every worker thread once its queued work is done."""
        with self._lock:
            for ex in self._executors.values():
                ex.shutdown(wait=False)
            self._executors.clear()


def set_torch_threads(torch_threads: int | None, interop_threads: int) -> None:
    """Apply a :class:`service.cluster.supervisor.WorkerPlan`'s threads to this process (a worker,
    or the one process of ``--workers 1``): intra-op threads (None: torch's default, as
    ``OMP_NUM_THREADS`` set them) and inter-op threads."""
    import torch

    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    torch.set_num_interop_threads(interop_threads)
