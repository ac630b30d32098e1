"""``--workers``: the setting, ``auto`` sizing, torch threads and device assignment."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from service.cli import main
from service.cluster.supervisor import available_cores, gpu_count, plan_workers, worker_device
from service.settings import Settings


@pytest.mark.parametrize(("value", "parsed"), [("auto", "auto"), ("1", 1), (" 3 ", 3), (16, 16)])
def test_workers_setting_accepts_auto_and_positive_integers(value: object, parsed: object) -> None:
    assert Settings(workers=value).workers == parsed  # type: ignore[arg-type]


def test_workers_default_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().workers == "auto"
    monkeypatch.setenv("BITSERVE_WORKERS", "4")
    assert Settings().workers == 4


@pytest.mark.parametrize("value", ["0", "-1", "-0", "two", "1.5", "", "auto4", True, 0, -3])
def test_workers_setting_refuses_everything_else(value: object) -> None:
    with pytest.raises(ValidationError, match=r"workers must be an integer >= 1 or 'auto'"):
        Settings(workers=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["0", "-2", "lots"])
def test_bad_workers_flag_or_env_exits_2_naming_the_setting(
    value: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["serve", "--workers", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bitserve serve: workers: ")
    assert "integer >= 1 or 'auto'" in err
    monkeypatch.setenv("BITSERVE_WORKERS", value)
    assert main(["serve"]) == 2
    assert "workers must be" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cores", "gpus", "workers", "threads"),
    [
        (1, 0, 1, 1),  # a single core: serve in one process
        (2, 0, 1, 1),  # a small host: one worker's loop, one torch thread (issue 23)
        (3, 0, 3, 1),
        (6, 0, 6, 1),
        (64, 0, 8, 7),  # capped: each worker holds its own models; a core for each loop
        (16, 1, 2, 7),  # two per GPU...
        (16, 8, 16, 1),
        (64, 8, 16, 3),
        (12, 8, 12, 1),  # ...bounded by the cores...
        (4, 8, 8, 1),  # ...but every GPU gets a worker
        (1, 1, 1, 1),
    ],
)
def test_auto_sizing(cores: int, gpus: int, workers: int, threads: int) -> None:
    plan = plan_workers("auto", cores=cores, gpus=gpus)
    assert (plan.workers, plan.torch_threads, plan.interop_threads) == (workers, threads, 1)
    assert f"{workers} worker(s) (auto" in plan.reason
    assert f"{cores} core(s), {gpus} GPU(s)" in plan.reason
    # workers x threads never oversubscribes, unless there are more GPUs than cores
    assert plan.workers * plan.torch_threads <= max(cores, gpus)


def test_explicit_count_and_threads() -> None:
    plan = plan_workers(3, cores=8, gpus=0)
    assert (plan.workers, plan.torch_threads) == (3, 1)
    assert "as set" in plan.reason
    assert plan_workers(5, cores=2, gpus=0).torch_threads == 1  # never 0
    # The user's OMP_NUM_THREADS is theirs to choose.
    kept = plan_workers(2, cores=8, gpus=0, omp_threads="3")
    assert kept.torch_threads is None
    assert "OMP_NUM_THREADS=3" in kept.reason


@pytest.mark.parametrize(
    ("device", "gpus", "devices"),
    [
        ("auto", 0, ["auto"] * 4),  # resolve_device then picks the CPU
        ("auto", 1, ["cuda:0"] * 4),
        ("auto", 3, ["cuda:0", "cuda:1", "cuda:2", "cuda:0"]),
        ("cuda", 2, ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]),
        ("cuda:1", 2, ["cuda:1"] * 4),  # a named device pins every worker
        ("cpu", 8, ["cpu"] * 4),
    ],
)
def test_worker_device_spreads_auto_over_the_gpus(
    device: str, gpus: int, devices: list[str]
) -> None:
    assert [worker_device(device, i, gpus) for i in range(4)] == devices


def _cgroup(tmp_path: Path, own: str, files: dict[str, str]) -> dict[str, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(own)
    return {"cgroup_root": root, "own_cgroup": proc}


def test_available_cores_honours_a_cgroup_quota(tmp_path: Path) -> None:
    import os

    affinity = len(os.sched_getaffinity(0))
    none = _cgroup(tmp_path / "a", "0::/\n", {"cpu.max": "max 100000\n"})
    assert available_cores(**none) == affinity
    # docker --cpus 1.5 -> 2 whole cores (when the affinity allows that many)
    own = "0::/kubepods/pod1/c1\n"
    limited = _cgroup(
        tmp_path / "b",
        own,
        {"kubepods/pod1/c1/cpu.max": "150000 100000\n", "kubepods/cpu.max": "max 100000\n"},
    )
    assert available_cores(**limited) == min(affinity, 2)
    # The tightest limit on the way up counts; never fewer than one core.
    parent = _cgroup(
        tmp_path / "c",
        own,
        {"kubepods/pod1/c1/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "10000 100000\n"},
    )
    assert available_cores(**parent) == 1
    v1 = _cgroup(
        tmp_path / "d",
        "4:cpu:/x\n",
        {"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"},
    )
    assert available_cores(**v1) == 1


def test_workers_share_a_port_only_on_linux() -> None:
    # SO_REUSEPORT balances connections only on Linux: elsewhere auto is one process...
    plan = plan_workers("auto", cores=8, gpus=0, linux=False)
    assert plan.workers == 1
    assert "only on Linux" in plan.reason
    assert plan_workers(1, cores=8, gpus=0, linux=False).workers == 1
    # ...and asking for more is an error at start.
    with pytest.raises(ValueError, match="more than one worker needs Linux"):
        plan_workers(2, cores=8, gpus=0, linux=False)


def test_gpus_counted_for_the_device_setting() -> None:
    import torch

    assert gpu_count("cpu") == 0  # models pinned to the CPU: size as a CPU host
    assert gpu_count("cuda:3") == 1  # every worker on that one GPU
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert gpu_count("auto") == gpu_count("cuda") == seen


def test_only_run_directories_no_supervisor_holds_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl
    import os
    import tempfile

    from service.cluster.supervisor import _remove_stale_run_dirs

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    live, dead, other = tmp_path / "bitserve-live", tmp_path / "bitserve-dead", tmp_path / "x"
    for d in (live, dead, other, tmp_path / "bitserve-e2e-logs"):
        d.mkdir()
        (d / "supervisor.pid").write_text("1")
    (tmp_path / "bitserve-e2e-logs" / "supervisor.pid").unlink()  # not a run directory
    held = os.open(live / "supervisor.pid", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a running supervisor holds its own
    try:
        _remove_stale_run_dirs()
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bitserve-e2e-logs", "bitserve-live", "x"]
