"""The benchmarks' host checks (``benchmarks/_common.py``): CPU times and the quiet-host wait."""

from __future__ import annotations

import pytest

from benchmarks._common import CpuTimes, quiet_host

STAT = """cpu  100 5 40 800 20 3 2 30 0 0
cpu0 50 2 20 400 10 1 1 15 0 0
intr 12345
"""


def test_cpu_times_from_proc_stat() -> None:
    t = CpuTimes.parse(STAT)
    assert t == CpuTimes(busy=100 + 5 + 40 + 3 + 2, steal=30, total=150 + 800 + 20 + 30)


def test_a_kernel_without_a_steal_column() -> None:
    t = CpuTimes.parse("cpu  10 0 5 85\n")
    assert t == CpuTimes(busy=15, steal=0, total=100)


def test_the_share_stolen_between_two_readings() -> None:
    before = CpuTimes(busy=100, steal=10, total=1000)
    after = CpuTimes(busy=400, steal=60, total=2000)
    assert after.stolen_since(before) == pytest.approx(0.05)
    assert before.stolen_since(before) == 0.0


def test_this_machine_has_cpu_times() -> None:
    t = CpuTimes.now()
    if t is None:
        pytest.skip("no /proc/stat")
    assert 0 <= t.steal <= t.total
    assert 0 < t.busy < t.total


def test_quiet_host_waits_for_the_load_to_fall() -> None:
    loads = iter([2.0, 1.2, 0.4, 0.1])
    slept: list[float] = []
    quiet, line = quiet_host(max_load=0.5, wait_s=60, poll_s=5, load=lambda: next(loads),
                             sleep=slept.append)  # fmt: skip
    assert quiet
    assert slept == [5, 5]
    assert "load average 0.40" in line
    assert "after 10 s" in line
    assert "BUSY" not in line


def test_a_host_that_stays_busy_is_named_busy() -> None:
    slept: list[float] = []
    quiet, line = quiet_host(max_load=0.5, wait_s=12, poll_s=5, load=lambda: 3.0,
                             sleep=slept.append)  # fmt: skip
    assert not quiet
    assert slept == [5, 5, 5]
    assert line.startswith("BUSY HOST: load average 3.00")
    assert "after 15 s" in line


def test_no_wait_asked_for() -> None:
    slept: list[float] = []
    quiet, line = quiet_host(max_load=0.5, wait_s=0, load=lambda: 0.2, sleep=slept.append)
    assert not slept
    assert quiet
    assert line == "load average 0.20 when the run began (quiet: at most 0.5)"
