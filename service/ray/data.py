"""Ray Data: score any Dataset of packed rows with a model of a repository.

:func:`score` adds one ``map_batches`` stage of :class:`~service.ray.scorer.BatchScorer` actors
to a Dataset: the model resident once per actor, one actor per GPU on a GPU cluster
(``num_gpus=1``), CPU actors otherwise. Each Ray batch is a whole number of the model's
``max_batch_size`` (:func:`batch_rows`), which the scorer runs ``max_batch_size`` rows at a
time, in Ray's Arrow batch format: the scorer reads the packed bytes in place as NumPy (no
copy), and every other column stays as Arrow has it (no pandas, no Python object per row;
Ray's NumPy batches would turn each ``binary`` and ``string`` cell into one, and back)::

    import ray
    from service.ray import score

    ds = ray.data.read_parquet("s3://library/fingerprints/")   # id, fp (256 B a row)
    score(ds, "models/", "fingerprint").write_parquet("s3://library/scores/")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.ray.scorer import BatchScorer, read_config

if TYPE_CHECKING:
    import ray.data

    from service.models.config import ModelConfig


@dataclass(frozen=True)
class Actors:
    """How the scoring actors are placed.

    Attributes:
        min_actors, max_actors: the actor pool's size (Ray Data grows it with the work).
        num_gpus: GPUs per actor (1 on a GPU cluster; 0 on CPUs).
        num_cpus: CPUs per actor (what Ray reserves for it).
        threads: torch's intra-op threads per actor.
    """

    min_actors: int
    max_actors: int
    num_gpus: float
    num_cpus: float
    threads: int


def plan_actors(
    resources: Mapping[str, float],
    *,
    node_cpus: float | None = None,
    actors: int | None = None,
    num_gpus: float | None = None,
    num_cpus: float | None = None,
    threads: int | None = None,
) -> Actors:
    """The actors for a cluster of ``resources`` (``ray.cluster_resources()``).

    On a cluster with GPUs: one actor per GPU (``num_gpus=1``, ``num_cpus=1``), a fixed pool.
    Without: CPU actors of ``num_cpus`` (default 1) each, a pool of 1 up to the cluster's CPUs
    less one per actor-sized share for the reads and writes (at least 1).

    Threads: an actor runs ``num_cpus`` torch threads, except a CPU actor alone on its node
    (a node of at most ``num_cpus + 1`` CPUs, such as a 2-core machine, and no fixed pool of
    more than one actor): it runs one thread per CPU of the node. The reads and writes
    beside it take a fraction of the CPU the scoring does (4 µs a row against 17 µs for the
    2048-bit MLP, ``benchmarks/results/ray.md``), so the CPU kept for them would otherwise
    idle most of the time.

    Args:
        resources: the cluster's total resources.
        node_cpus: the CPUs of the smallest node (None: the cluster's, one node).
        actors: a fixed number of actors instead.
        num_gpus, num_cpus: per actor, instead of the defaults.
        threads: torch threads per actor instead of the rule above.

    Raises:
        ValueError: a negative or zero count.
    """
    gpus = float(resources.get("GPU", 0))
    cpus = float(resources.get("CPU", 1))
    if num_gpus is None:
        num_gpus = 1.0 if gpus >= 1 else 0.0
    if num_cpus is None:
        num_cpus = 1.0
    if num_gpus < 0 or num_cpus <= 0:
        raise ValueError(f"num_gpus must be >= 0 and num_cpus > 0 (got {num_gpus}, {num_cpus})")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1 (got {threads})")
    if actors is not None and actors < 1:
        raise ValueError(f"actors must be at least 1 (got {actors})")
    own = max(1, int(num_cpus))
    if threads is None:
        node = cpus if node_cpus is None else float(node_cpus)
        alone = num_gpus == 0 and node - 1 < 2 * num_cpus and actors in (None, 1)
        threads = max(own, int(node)) if alone else own
    if actors is not None:
        return Actors(actors, actors, num_gpus, num_cpus, threads)
    if num_gpus > 0:
        n = max(1, int(gpus // num_gpus))
        return Actors(n, n, num_gpus, num_cpus, threads)
    # Keep a share of the CPUs for the read and write tasks that feed and drain the actors.
    n = max(1, int((cpus - 1) // num_cpus))
    return Actors(1, n, 0.0, num_cpus, threads)


def smallest_node_cpus() -> float | None:
    """The CPUs of the cluster's smallest live node that has any (None: no such node)."""
    import ray

    cpus = [
        float(node["Resources"]["CPU"])
        for node in ray.nodes()  # type: ignore[no-untyped-call]
        if node.get("Alive") and node.get("Resources", {}).get("CPU")
    ]
    return min(cpus) if cpus else None


BATCH_ROWS = 8192
"""About the rows of one Ray batch. The actor's idle time between two batches (Ray Data
slicing blocks, converting, bookkeeping) measured 3.2 µs a row at batches of 1024 rows on
the 2-core benchmark host, 1.3 µs at 8192 (a 1M-row ``bitserve score``)."""
BATCH_BYTES = 32 << 20
"""The most input bytes of one Ray batch (a model with wide inputs gets fewer rows)."""


def batch_rows(cfg: ModelConfig, most: int | None = None) -> int:
    """Rows of one Ray batch for a model: the multiple of its ``max_batch_size`` (1 without
    batching) nearest :data:`BATCH_ROWS` from below, at most :data:`BATCH_BYTES` of input
    and ``most`` rows (at least one ``max_batch_size``).

    Ray Data gives each actor task at least a batch's rows: a job whose blocks are smaller
    (``bitserve score --rows-per-task``) caps the batch at a block, so that its tasks, its
    output files and the work a lost node takes with it stay a block each."""
    from service.ray.scorer import ColumnForm

    unit = max(cfg.max_batch_size, 1)
    row_bytes = max(sum(ColumnForm.of(spec).row_bytes for spec in cfg.inputs), 1)
    rows = min(BATCH_ROWS, BATCH_BYTES // row_bytes, most if most is not None else BATCH_ROWS)
    return unit * max(1, rows // unit)


def score(
    ds: ray.data.Dataset,
    repository: str | Path,
    model: str,
    *,
    version: str | None = None,
    bitorder: str | None = None,
    parameters: Mapping[str, Any] | None = None,
    keep_inputs: bool = False,
    device: str = "auto",
    actors: int | None = None,
    num_gpus: float | None = None,
    num_cpus: float | None = None,
    batch_size: int | None = None,
    threads: int | None = None,
    **ray_remote_args: Any,
) -> ray.data.Dataset:
    """``ds`` with every row scored by ``model`` (lazily, as every Dataset transform).

    Args:
        ds: rows with one column per model input (one item's packed bytes a row; see
            :mod:`service.ray.scorer`) and any others, which pass through.
        repository: the model repository folder; every node must see it at this path.
        model: the model's name.
        version: the version; None: the highest (read once, here, so every actor loads the
            same one).
        bitorder: the packed columns' bit order; None: the model's.
        parameters: the request parameters of every batch (an index's ``k`` and
            ``threshold``).
        keep_inputs: keep the input columns in the result.
        device: the device for a config that says ``auto`` (each actor's own GPU by default).
        actors, num_gpus, num_cpus, threads: see :func:`plan_actors`.
        batch_size: rows of one Ray batch; None: :func:`batch_rows` (best a multiple of the
            model's ``max_batch_size``: the scorer runs that many rows at a time).
        ray_remote_args: passed on to ``map_batches`` (``resources``, ``scheduling_strategy``,
            ``memory``, ...).

    Returns:
        the pass-through columns and one column per model output (see
        :meth:`BatchScorer.__call__`).

    Raises:
        ScoringError: no such model or version, or an invalid config (checked here, before
            any actor starts).
    """
    import ray
    from ray.data import ActorPoolStrategy

    root = Path(repository).resolve()
    version, cfg = read_config(root, model, version)
    resources = ray.cluster_resources()  # type: ignore[no-untyped-call]
    plan = plan_actors(resources, node_cpus=smallest_node_cpus(), actors=actors,
                       num_gpus=num_gpus, num_cpus=num_cpus, threads=threads)  # fmt: skip
    return ds.map_batches(
        BatchScorer,
        fn_constructor_kwargs={
            "repository": str(root),
            "model": model,
            "version": version,
            "device": device,
            "bitorder": bitorder,
            "parameters": dict(parameters or {}),
            "keep_inputs": keep_inputs,
            "torch_threads": plan.threads,
        },
        batch_size=batch_size if batch_size is not None else batch_rows(cfg),
        batch_format="pyarrow",
        zero_copy_batch=True,
        compute=ActorPoolStrategy(min_size=plan.min_actors, max_size=plan.max_actors),
        num_gpus=plan.num_gpus,
        num_cpus=plan.num_cpus,
        udf_modifying_row_count=False,
        **ray_remote_args,
    )
