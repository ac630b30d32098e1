"""Priority levels in the batcher: level 1 first, FIFO within a level, whole requests only,
per-level queue bounds and metrics; the queue's batch order against a plain reference; and
requests dropped when their client goes away, counted."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from service.batching.batcher import Batcher
from service.batching.queue import LevelQueue, Pending
from service.errors import Overloaded
from service.observability.metrics import Metrics
from tests.service.test_batcher import Recorder, flat, run, wait_entered
from tests.service.test_batcher import make as make_batcher


def make(rec: Recorder, **kw: Any) -> Batcher[Any, Any]:
    """test_batcher's batcher, two items a batch and room for 64 unless ``kw`` says."""
    return make_batcher(rec, **{"max_batch_size": 2, "max_queue_size": 64, **kw})


async def queued_behind_a_running_batch(
    b: Batcher[Any, Any], rec: Recorder, requests: list[tuple[str, int, int]]
) -> list[asyncio.Future[Any]]:
    """Hold one batch at the gate, then queue ``(payload, size, level)`` requests in order."""
    first = asyncio.ensure_future(b.submit("running"))
    await wait_entered(rec)
    tasks = [first]
    for payload, size, level in requests:
        tasks.append(asyncio.ensure_future(b.submit(payload, size, level=level)))
        await asyncio.sleep(0)
    return tasks


def test_higher_levels_are_batched_first_fifo_within_a_level() -> None:
    async def main() -> None:
        rec = Recorder(gated=True)
        b = make(rec, level_limits=[0, 0, 0])
        requests = [("low1", 1, 3), ("mid1", 1, 2), ("high1", 1, 1), ("low2", 1, 3),
                    ("high2", 1, 1), ("mid2", 1, 2), ("high3", 1, 1)]  # fmt: skip
        tasks = await queued_behind_a_running_batch(b, rec, requests)
        assert b.depth == 7
        rec.gate.set()
        await asyncio.gather(*tasks)
        assert rec.batches == [
            ["running"],
            ["high1", "high2"],
            ["high3", "mid1"],
            ["mid2", "low1"],
            ["low2"],
        ]
        await b.stop()

    run(main)


def test_a_request_that_does_not_fit_is_not_passed_by_a_lower_level() -> None:
    async def main() -> None:
        rec = Recorder(gated=True)
        b = make(rec, max_batch_size=3, level_limits=[0, 0])
        tasks = await queued_behind_a_running_batch(
            b, rec, [("high-a", 2, 1), ("high-b", 2, 1), ("low", 1, 2)]
        )
        rec.gate.set()
        await asyncio.gather(*tasks)
        # high-b (2 items) does not fit next to high-a; the 1-item low request may not jump it
        assert rec.batches == [["running"], ["high-a"], ["high-b", "low"]]
        await b.stop()

    run(main)


def test_each_level_has_its_own_queue_bound_within_the_total() -> None:
    async def main() -> None:
        rec = Recorder(gated=True)
        b = make(rec, max_batch_size=1, max_queue_size=5, level_limits=[0, 2])
        tasks = await queued_behind_a_running_batch(b, rec, [("low1", 1, 2), ("low2", 1, 2)])
        with pytest.raises(Overloaded, match="2 requests of priority level 2 queued"):
            await b.submit("low3", level=2)
        with pytest.raises(Overloaded, match="priority level 2"):
            b.check_capacity(2)
        b.check_capacity()  # from the headers (level unknown): the total has room
        tasks += [asyncio.ensure_future(b.submit(f"high{i}", level=1)) for i in range(3)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="max_queue_size 5"):
            await b.submit("high4", level=1)
        rec.gate.set()
        await asyncio.gather(*tasks)
        assert flat(rec.batches) == ["running", "high0", "high1", "high2", "low1", "low2"]
        with pytest.raises(ValueError, match=r"level 3 outside 1\.\.2"):
            await b.submit("x", level=3)
        await b.stop()

    run(main)


def test_per_level_metrics_and_cancelled_requests_are_counted() -> None:
    async def main() -> None:
        rec = Recorder(gated=True)
        metrics = Metrics()
        b = make(rec, max_batch_size=1, level_limits=[0, 0], metrics=metrics, version="3")
        tasks = await queued_behind_a_running_batch(b, rec, [("low", 1, 2), ("high", 1, 1)])
        gone = asyncio.ensure_future(b.submit("gone", level=2))
        await asyncio.sleep(0)

        def value(name: str, labels: dict[str, str]) -> float | None:
            metrics.flush()  # as a scrape does
            return metrics.registry.get_sample_value(name, labels)

        assert value("bitserve_priority_queue_depth", {"model": "m", "priority": "2"}) == 2
        assert value("bitserve_priority_queue_depth", {"model": "m", "priority": "1"}) == 1
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert value("bitserve_requests_cancelled_total", {"model": "m", "version": "3"}) == 1
        assert value("bitserve_priority_queue_depth", {"model": "m", "priority": "2"}) == 1
        rec.gate.set()
        await asyncio.gather(*tasks)
        assert "gone" not in flat(rec.batches)
        for level, waited in (("1", 2), ("2", 1)):  # "running" is of the default level, 1
            labels = {"model": "m", "priority": level}
            assert value("bitserve_priority_queue_seconds_count", labels) == waited
            assert value("bitserve_priority_queue_depth", labels) == 0
        # A request whose batch is running is computed: it is not counted as dropped.
        rec.gate.clear()
        rec.entered.clear()
        running = asyncio.ensure_future(b.submit("running2"))
        await wait_entered(rec)
        running.cancel()
        await asyncio.sleep(0)
        rec.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert value("bitserve_requests_cancelled_total", {"model": "m", "version": "3"}) == 1
        await b.stop()

    run(main)


def _reference_batch(
    waiting: list[tuple[int, int, int]], capacity: int
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """The plain rule: order by (level, arrival); take whole requests while they fit."""
    order = sorted(waiting, key=lambda r: (r[1], r[0]))
    batch: list[int] = []
    items = 0
    for arrival, _, size in order:
        if batch and items + size > capacity:
            break
        batch.append(arrival)
        items += size
    return batch, [r for r in waiting if r[0] not in batch]


def test_level_queue_batches_match_the_plain_rule_on_random_queues() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        rng = random.Random(1234)
        for _ in range(200):
            levels, capacity = rng.randint(1, 4), rng.randint(1, 6)
            q: LevelQueue[int, Any] = LevelQueue([0] * levels)
            waiting = []
            for arrival in range(rng.randint(0, 20)):
                level, size = rng.randrange(levels), rng.randint(1, capacity)
                q.append(Pending(arrival, size, loop.create_future(), 0.0, None, level=level))
                waiting.append((arrival, level, size))
            gone = [r for r in waiting if rng.random() < 0.2]
            for arrival, _, _ in gone:  # cancelled clients leave from anywhere
                assert q.remove(next(p for p in q if p.payload == arrival))
            waiting = [r for r in waiting if r not in gone]
            while waiting:
                assert len(q) == len(waiting)
                assert q.items == sum(r[2] for r in waiting)
                expected, waiting = _reference_batch(waiting, capacity)
                assert [p.payload for p in q.take(capacity, 0.0, lambda p: None)] == expected
            assert len(q) == q.items == 0

    run(main)
