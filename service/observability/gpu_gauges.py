"""Triton's GPU gauges through NVML (``nvidia-ml-py``), read when ``/metrics`` is scraped.

``nv_gpu_utilization`` (0.0 - 1.0), ``nv_gpu_memory_total_bytes``, ``nv_gpu_memory_used_bytes``
and ``nv_gpu_power_usage`` (watts), one series per GPU labelled ``gpu_uuid`` as Triton labels
them (``perf_analyzer --collect-metrics`` reads them by these names). On a host without a GPU,
or without the NVML library, the gauges are simply absent: :class:`GpuGauges` is then empty,
never an error. The NVML module is a parameter, so tests pass a fake one.
"""

from __future__ import annotations

import logging
from typing import Any

from service.observability.statistics import label_value

log = logging.getLogger(__name__)

_FAMILIES = (
    ("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)"),
    ("nv_gpu_memory_total_bytes", "GPU total memory, in bytes"),
    ("nv_gpu_memory_used_bytes", "GPU used memory, in bytes"),
    ("nv_gpu_power_usage", "GPU power usage in watts"),
)


def _import_nvml() -> Any:
    try:
        import pynvml  # nvidia-ml-py's module
    except ImportError:
        return None
    return pynvml


class GpuGauges:
    """The GPU gauges of this host.

    Args:
        nvml: the NVML binding (``pynvml``); by default imported, and absent when it cannot
            be. Initialised here: a failure (no driver, no GPU) leaves the gauges empty.
    """

    def __init__(self, nvml: Any = "import") -> None:
        self._nvml = _import_nvml() if nvml == "import" else nvml
        self._handles: list[tuple[str, Any]] = []
        if self._nvml is None:
            return
        try:
            self._nvml.nvmlInit()
            for i in range(self._nvml.nvmlDeviceGetCount()):
                handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = self._nvml.nvmlDeviceGetUUID(handle)
                if isinstance(uuid, bytes):  # older bindings return bytes
                    uuid = uuid.decode("ascii", "replace")
                self._handles.append((str(uuid), handle))
        except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            log.debug("no GPU metrics: NVML is not available (%s)", exc)
            self._handles = []

    @property
    def available(self) -> bool:
        """Whether any GPU is reported."""
        return bool(self._handles)

    def render(self) -> bytes:
        """The gauges in the Prometheus text format (empty without a GPU).

        A GPU whose reading fails is left out of that scrape (logged at debug level).
        """
        if not self._handles:
            return b""
        rows: list[tuple[str, list[float]]] = []
        nvml = self._nvml
        for uuid, handle in self._handles:
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                watts = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # NVML reports mW
                rows.append((uuid, [util.gpu / 100.0, mem.total, mem.used, watts]))
            except Exception as exc:
                log.debug("GPU %s: NVML reading failed (%s)", uuid, exc)
        lines: list[str] = []
        for i, (name, help_text) in enumerate(_FAMILIES):
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} gauge")
            for uuid, values in rows:
                lines.append(f'{name}{{gpu_uuid="{label_value(uuid)}"}} {_number(values[i])}')
        return ("\n".join(lines) + "\n").encode()


def _number(value: float) -> str:
    """A sample value: integers exactly (memory sizes pass 2**53 only in theory), floats
    with every digit."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
