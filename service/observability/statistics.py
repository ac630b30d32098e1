"""Per model version statistics: Triton's statistics extension and its ``nv_inference_*`` metrics.

One :class:`ModelStats` per model version counts what Triton's statistics extension reports
(``GET /v2/models[/{m}[/versions/{v}]]/stats``), with Triton's meanings:

- ``success`` / ``fail``: requests answered (count, and their whole duration in the server);
- ``queue``: the time requests waited for their batch;
- ``compute_input`` (staging and unpacking the inputs on the device), ``compute_infer``
  (operator and model) and ``compute_output`` (the device-to-host copy of the outputs): a
  batch's phase durations, added once for every request the batch computed (as Triton does,
  so ``ns / count`` is the average a request saw);
- ``inference_count`` (items), ``execution_count`` (batches), ``last_inference`` (ms since
  the epoch) and ``batch_stats`` (per batch size: executions and phase durations).

Three writers, each to its own fields, so no lock is needed: the data plane counts requests
(success, fail), the batcher counts queue waits, and the pipeline its batches, once per batch
(a few integer additions). Everything is a plain integer: :meth:`ModelStats.snapshot` gives a
:class:`Snapshot`, snapshots of the same version taken in several worker processes add up with
``+`` (``last_inference`` takes the latest), and travel as JSON (:meth:`Snapshot.to_dict`,
:meth:`Snapshot.from_dict`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

# The fields of one batch size's entry in ``batch_stats``: executions, then the phase ns.
_BATCH_FIELDS = ("count", "compute_input_ns", "compute_infer_ns", "compute_output_ns")


@dataclass(slots=True)
class Snapshot:
    """The counts of one model version at one moment; every field is an integer.

    ``batches`` maps a batch size to ``[executions, compute_input_ns, compute_infer_ns,
    compute_output_ns]``.
    """

    name: str
    version: str
    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_count: int = 0
    queue_ns: int = 0
    compute_count: int = 0
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    cache_hit_count: int = 0
    cache_hit_ns: int = 0
    cache_miss_count: int = 0
    cache_miss_ns: int = 0
    cache_not_stored_count: int = 0
    """Misses whose answer the cache did not admit (``ResponseCache.admit``; not Triton's)."""
    batches: dict[int, list[int]] = field(default_factory=dict)

    def __add__(self, other: Snapshot) -> Snapshot:
        """The counts of both (the same version, e.g. from two worker processes)."""
        if (self.name, self.version) != (other.name, other.version):
            raise ValueError(
                f"cannot add the statistics of {other.name}/{other.version} to "
                f"{self.name}/{self.version}"
            )
        out = Snapshot(self.name, self.version)
        for f in fields(self):
            if f.name in ("name", "version", "batches"):
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name == "last_inference_ms" else a + b)
        out.batches = {k: list(v) for k, v in self.batches.items()}
        for size, row in other.batches.items():
            mine = out.batches.setdefault(size, [0] * len(_BATCH_FIELDS))
            out.batches[size] = [x + y for x, y in zip(mine, row, strict=True)]
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (batch sizes as string keys)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["batches"] = {str(k): list(v) for k, v in self.batches.items()}
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Snapshot:
        """The inverse of :meth:`to_dict`."""
        kwargs = {f.name: data[f.name] for f in fields(cls) if f.name != "batches"}
        snap = cls(**kwargs)
        snap.batches = {int(k): [int(x) for x in v] for k, v in data["batches"].items()}
        return snap

    def triton(self) -> dict[str, Any]:
        """One ``model_stats`` entry of Triton's statistics extension."""

        def duration(count: int, ns: int) -> dict[str, int]:
            return {"count": count, "ns": ns}

        compute = self.compute_count
        return {
            "name": self.name,
            "version": self.version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": duration(self.success_count, self.success_ns),
                "fail": duration(self.fail_count, self.fail_ns),
                "queue": duration(self.queue_count, self.queue_ns),
                "compute_input": duration(compute, self.compute_input_ns),
                "compute_infer": duration(compute, self.compute_infer_ns),
                "compute_output": duration(compute, self.compute_output_ns),
                "cache_hit": duration(self.cache_hit_count, self.cache_hit_ns),
                "cache_miss": duration(self.cache_miss_count, self.cache_miss_ns),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": duration(row[0], row[1]),
                    "compute_infer": duration(row[0], row[2]),
                    "compute_output": duration(row[0], row[3]),
                }
                for size, row in sorted(self.batches.items())
            ],
        }


def merge(snapshots: Iterable[Snapshot]) -> list[Snapshot]:
    """Snapshots of the same versions (e.g. one list per worker process) added up per version,
    in the order each version first appears."""
    out: dict[tuple[str, str], Snapshot] = {}
    for s in snapshots:
        key = (s.name, s.version)
        out[key] = out[key] + s if key in out else s + Snapshot(s.name, s.version)
    return list(out.values())


class ModelStats:
    """The live counters of one model version (see the module docstring for who writes what).

    Args:
        name: the model name.
        version: the version.
    """

    __slots__ = ("_counts",)

    def __init__(self, name: str, version: str) -> None:
        self._counts = Snapshot(name, version)

    @property
    def name(self) -> str:
        """The model name."""
        return self._counts.name

    @property
    def version(self) -> str:
        """The version."""
        return self._counts.version

    def __getattr__(self, field_name: str) -> Any:
        # The counts, read-only (``stats.success_count``); writes go through the methods.
        return getattr(self._counts, field_name)

    # --- the writers ----------------------------------------------------------------------

    def request_done(self, ok: bool, ns: int) -> None:
        """One request answered (by the data plane): ``ns`` from its arrival to its answer."""
        c = self._counts
        if ok:
            c.success_count += 1
            c.success_ns += ns
        else:
            c.fail_count += 1
            c.fail_ns += ns

    def cache_hit(self, ns: int) -> None:
        """A request answered from the response cache (by the data plane): ``ns`` to find it
        (Triton's ``cache_hit``)."""
        c = self._counts
        c.cache_hit_count += 1
        c.cache_hit_ns += ns

    def cache_miss(self, ns: int, stored: bool = True) -> None:
        """A request the response cache did not hold: ``ns`` to look it up (its key, the
        lookup and the admission; Triton's ``cache_miss``); ``stored``: whether its answer
        will be (a full cache admits only requests that missed before)."""
        c = self._counts
        c.cache_miss_count += 1
        c.cache_miss_ns += ns
        if not stored:
            c.cache_not_stored_count += 1

    def cache_stored(self, ns: int) -> None:
        """A missed request's answer stored: ``ns`` to store it, counted in ``cache_miss``'s
        time as Triton counts its insertions."""
        self._counts.cache_miss_ns += ns

    def queued(self, requests: int, ns: int) -> None:
        """A batch left the queue (by the batcher): ``ns`` is its requests' waits added up."""
        c = self._counts
        c.queue_count += requests
        c.queue_ns += ns

    def executed(
        self, items: int, requests: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        """One batch computed (by the pipeline, once per batch).

        Args:
            items: its batch size in items.
            requests: the requests merged into it.
            input_ns, infer_ns, output_ns: the durations of its three phases.
        """
        c = self._counts
        c.last_inference_ms = time.time_ns() // 1_000_000
        c.execution_count += 1
        c.inference_count += items
        c.compute_count += requests
        c.compute_input_ns += requests * input_ns
        c.compute_infer_ns += requests * infer_ns
        c.compute_output_ns += requests * output_ns
        row = c.batches.get(items)
        if row is None:
            row = c.batches[items] = [0] * len(_BATCH_FIELDS)
        row[0] += 1
        row[1] += input_ns
        row[2] += infer_ns
        row[3] += output_ns

    # --- the reader -----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """The counts now, as plain integers (a copy)."""
        # Each row copied: the pipeline's thread may be adding to them meanwhile.
        batches = {k: list(v) for k, v in list(self._counts.batches.items())}
        return replace(self._counts, batches=batches)


class Statistics:
    """Every model version's :class:`ModelStats`, kept across reloads of the version (counts
    since the server started, as Prometheus counters expect) and dropped when its model is
    unloaded (as Triton drops an unloaded model's statistics and metrics)."""

    def __init__(self) -> None:
        self._stats: dict[tuple[str, str], ModelStats] = {}

    def for_version(self, name: str, version: str) -> ModelStats:
        """The counters of ``name`` version ``version``, created on first use."""
        stats = self._stats.get((name, version))
        if stats is None:
            stats = self._stats[(name, version)] = ModelStats(name, version)
        return stats

    def forget(self, name: str) -> None:
        """Drop every version's counters of model ``name``."""
        for key in [k for k in self._stats if k[0] == name]:
            del self._stats[key]

    def snapshots(self) -> list[Snapshot]:
        """Every version's counts, sorted by model name and version number."""
        stats = sorted(self._stats.values(), key=lambda s: (s.name, int(s.version)))
        return [s.snapshot() for s in stats]


def triton_metrics(snapshots: Iterable[Snapshot]) -> bytes:
    """Triton's per-model inference metrics in the Prometheus text format, from ``snapshots``.

    Counters are written under Triton's own names, without the ``_total`` suffix that
    ``prometheus_client`` would add (dashboards and ``perf_analyzer`` match the names
    exactly); durations are cumulative microseconds, as Triton reports them.
    """
    snaps = list(snapshots)
    families: tuple[tuple[str, str, Callable[[Snapshot], int]], ...] = (
        ("nv_inference_request_success", "Number of successful inference requests, all batch "
         "sizes", lambda s: s.success_count),
        ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes",
         lambda s: s.fail_count),
        ("nv_inference_count", "Number of inferences performed (does not include cached "
         "requests)", lambda s: s.inference_count),
        ("nv_inference_exec_count", "Number of model executions performed (does not include "
         "cached requests)", lambda s: s.execution_count),
        ("nv_inference_request_duration_us", "Cumulative inference request duration in "
         "microseconds (includes cached requests)", lambda s: s.success_ns // 1000),
        ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in "
         "microseconds (includes cached requests)", lambda s: s.queue_ns // 1000),
        ("nv_inference_compute_input_duration_us", "Cumulative compute input duration in "
         "microseconds (does not include cached requests)", lambda s: s.compute_input_ns // 1000),
        ("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in "
         "microseconds (does not include cached requests)", lambda s: s.compute_infer_ns // 1000),
        ("nv_inference_compute_output_duration_us", "Cumulative inference compute output "
         "duration in microseconds (does not include cached requests)",
         lambda s: s.compute_output_ns // 1000),
        ("nv_cache_num_hits_per_model", "Number of cache hits per model",
         lambda s: s.cache_hit_count),
        ("nv_cache_num_misses_per_model", "Number of cache misses per model",
         lambda s: s.cache_miss_count),
        ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in "
         "microseconds", lambda s: s.cache_hit_ns // 1000),
        ("nv_cache_miss_duration_per_model", "Total cache miss (insert + lookup) duration per "
         "model, in microseconds", lambda s: s.cache_miss_ns // 1000),
        ("bitserve_cache_num_not_stored_per_model", "Number of cache misses whose answer "
         "was not stored (a full cache stores only requests that missed before)",
         lambda s: s.cache_not_stored_count),
    )  # fmt: skip
    lines: list[str] = []
    for name, help_text, value in families:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} counter")
        for s in snaps:
            labels = f'model="{label_value(s.name)}",version="{label_value(s.version)}"'
            lines.append(f"{name}{{{labels}}} {value(s)}")
    return ("\n".join(lines) + "\n").encode()


def label_value(value: str) -> str:
    """A Prometheus label value, escaped (backslash, double quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
