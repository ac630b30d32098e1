"""Issue 14's targets, short versions, against real ``bitserve serve`` processes.

The full runs are ``benchmarks/bench_hardening.py`` (results in
``benchmarks/results/hardening.md``); these check the same behaviour at a scale CI affords,
with the server's limits lowered to match (``max_inflight_bytes`` 48 MiB; for the tricklers,
a server of their own with ``max_connections`` 100 and ``head_timeout_s`` 2) and the demo
model given ``queue_timeout_us``. Timings are
printed, never asserted, except as hang guards far above the targets.

- hostile raw HTTP requests (hand-made and generated): no 5xx, no plain-text error, nothing
  the server could answer in JSON left unanswered (V2 bodies: ``test_fuzz.py``);
- ten times ``max_connections`` trickling their heads: the server's open files stay bounded,
  the tricklers are cut, a keep-alive client is served throughout;
- concurrent big uploads, with and without ``Content-Length``: the server's RSS grows by
  about ``max_inflight_bytes``, not by what was sent; refusals are 503 with Retry-After;
- open-loop 3x overload (from load-generator processes of their own): every request
  answered 200 or 503, the 200s right;
- hostile repositories: ``tests/service/test_hostile_repos.py`` and
  ``test_hostile_repos_e2e.py``;
- no traceback in the server's log.
"""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from harness import hostile
from harness.fuzzcases import RAW_CASES, examples, judge_raw, raw_requests
from harness.openloop import open_loop_procs
from harness.probes import write_repository
from harness.server import BitserveServer, start_server
from harness.workload import Pool

pytestmark = pytest.mark.e2e

MiB = 1 << 20
CAP = 100
BUDGET = 48 * MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BitserveServer]:
    hostile.raise_fd_limit()  # for the tricklers (the server inherits it, and lowers nothing)
    root = write_repository(tmp_path_factory.mktemp("repo"), queue_timeout_us=400_000)
    args = ["--no-access-log", "--max-inflight-bytes", str(BUDGET)]
    with start_server(root, args=args) as s:
        yield s
        log = s.log()
    assert "Traceback" not in log, log[-4000:]
    assert "Exception in ASGI" not in log, log[-4000:]


@pytest.fixture(scope="module")
def demo() -> hostile.DemoRequests:
    return hostile.DemoRequests(Pool.make(4))


def test_hostile_http_requests_get_json_answers_under_500(server: BitserveServer) -> None:
    cases = RAW_CASES + examples(raw_requests(), 200)
    stats = asyncio.run(hostile.send_all(server.port, cases, judge_raw))
    print(f"{stats.sent} raw requests: {dict(sorted(stats.statuses.items()))}")
    assert stats.sent == len(cases)
    assert stats.problems == []
    # Only requests the server cannot answer yet (it waits for more bytes) go unanswered.
    assert stats.statuses["none"] <= 2, stats.statuses


def test_tricklers_are_cut_and_a_keep_alive_client_is_served(
    server_factory: Callable[..., BitserveServer], demo: hostile.DemoRequests
) -> None:
    server = server_factory(
        args=["--no-access-log", "--max-connections", str(CAP), "--head-timeout-s", "2"]
    )
    n = 10 * CAP
    cmd = [sys.executable, "-m", "harness.hostile", "trickle", "--port", str(server.port)]
    cmd += ["--connections", str(n), "--seconds", "7", "--ramp-s", "1"]
    request = demo.requests()[0]
    with hostile.Peak(hostile.open_files_of(server.process.pid), every_s=0.2) as files:
        tricklers = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)
        side = asyncio.run(
            hostile.side_client(server.port, request, 4.5, check=functools.partial(demo.right, 0))
        )
        out, _ = tricklers.communicate(timeout=120)
    stats = json.loads(out)
    lat = np.array(side.latencies_s)
    print(
        f"tricklers {stats}; side client {dict(side.statuses)}, p50 "
        f"{np.percentile(lat, 50) * 1e3:.0f} ms, p99 {np.percentile(lat, 99) * 1e3:.0f} ms; "
        f"server open files at most {files.peak}"
    )
    # None lost, all right: while tricklers hold every slot with a head under way, the cap
    # evicts none of them (issue 35: a connection holding unread bytes is never closed without
    # an answer), so a newcomer is told 503 (with Retry-After) until the head timeout cuts them.
    assert set(side.statuses) <= {"200", "503"}, side.statuses
    assert side.statuses["200"] >= 1, side.statuses
    assert sum(side.statuses.values()) == len(lat)
    assert len(lat) >= 5
    assert lat.max() < 10.0  # a hang guard, far above the target (p99 < 1 s)
    # Open files: the cap, the listening socket, the process's own files and threads.
    assert files.peak <= CAP + 60, files.peak
    assert stats["connects"] > n  # cut and reconnected
    refused = stats["cut_other"].get("503", 0)  # told to retry at the cap, never silently
    assert stats["cut_408"] + stats["cut_silent"] + stats["cut_reset"] + refused >= n - CAP
    assert set(stats["cut_other"]) <= {"503"}, stats["cut_other"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_concurrent_big_uploads_stay_within_the_budget(
    server: BitserveServer, chunked: bool
) -> None:
    with hostile.Peak(hostile.rss_of(server.process.pid)) as rss:
        results = asyncio.run(
            hostile.upload_crowd(
                server.port,
                16,
                24 * MiB,  # 384 MiB at once without the budget
                rate_bps=24e6,
                seconds=4.0,
                chunked=chunked,
                retry_s=0.5,
            )
        )
    growth = rss.peak - rss.start
    statuses = Counter(r.status for r in results)
    print(f"RSS +{growth / MiB:.0f} MiB (budget {BUDGET / MiB:.0f} MiB); answers {statuses}")
    assert set(statuses) <= {400, 503}, statuses  # 400: read whole, too big for the demo
    assert statuses[400] >= 1
    assert statuses[503] >= 1
    assert all(r.json_error for r in results)
    assert all(r.retry_after for r in results if r.status == 503)
    assert growth <= BUDGET + 120 * MiB


def test_open_loop_overload_answers_every_request_200_or_503(
    server: BitserveServer, demo: hostile.DemoRequests
) -> None:
    requests = demo.requests()
    asyncio.run(hostile.closed_loop(server.port, requests, 32, 1.0))  # warm-up
    capacity = asyncio.run(hostile.closed_loop(server.port, requests, 32, 2.0))
    # The load comes from two processes of its own (harness.openloop), as in the benchmark.
    outcomes = open_loop_procs(server.port, 3 * capacity, 5.0, processes=2, give_up_s=10.0).outcomes
    assert sorted(o.index for o in outcomes) == list(range(int(3 * capacity / 2 * 5.0) * 2))
    statuses = Counter(o.status for o in outcomes)
    lat = np.array([o.latency_s for o in outcomes])
    good = np.array([o.latency_s for o in outcomes if o.status == 200])
    print(
        f"capacity {capacity:.0f} req/s, offered {3 * capacity:.0f}: {dict(statuses)}; "
        f"within 2 s {np.mean(lat <= 2):.1%}, slowest {lat.max() * 1e3:.0f} ms, 200s p99 "
        f"{np.percentile(good, 99) * 1e3:.0f} ms"
    )
    assert set(statuses) <= {200, 503}, statuses  # 0 would be no answer at all
    assert statuses[200] > 0
    assert statuses[503] > 0, "3x capacity never shed"
    assert not any(o.wrong for o in outcomes)
    assert all(o.retry_after and o.json_error for o in outcomes if o.status == 503)
    assert lat.max() < 10.0  # a hang guard; the target is 2 s (queue_timeout_us is 0.4 s)
