"""Dynamic batcher semantics with a generic compute function (no device, no HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest

from service.batching.batcher import Batcher, BatchInfo
from service.errors import DeadlineExceeded, ModelNotReady, Overloaded, ServiceError
from service.models.devices import DeviceExecutors
from service.observability.metrics import Metrics


class Recorder:
    """A compute function that records its batches and can be held at a gate.

    With ``pace_s``, each batch takes at least that long (slept before the gate).
    """

    def __init__(self, *, gated: bool = False, pace_s: float = 0.0) -> None:
        self.pace_s = pace_s
        self.batches: list[list[Any]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        if not gated:
            self.gate.set()

    def __call__(self, payloads: list[Any]) -> Sequence[Any]:
        time.sleep(self.pace_s)
        self.entered.set()
        assert self.gate.wait(30), "test gate never opened"
        self.batches.append(list(payloads))
        if any(p == "boom" for p in payloads):
            raise RuntimeError("kaboom")
        return [("done", p) for p in payloads]


def flat(batches: list[list[Any]]) -> list[Any]:
    return [p for batch in batches for p in batch]


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(coro_fn())  # type: ignore[arg-type]


def make(rec: Recorder, **kw: Any) -> Batcher[Any, Any]:
    opts: dict[str, Any] = {"max_batch_size": 4, "max_queue_delay_us": 0, "max_queue_size": 16}
    opts.update(kw)
    b: Batcher[Any, Any] = Batcher("m", rec, **opts)
    b.start()
    return b


async def wait_entered(rec: Recorder) -> None:
    while not rec.entered.is_set():
        await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def one_running(
    **kw: Any,
) -> AsyncIterator[tuple[Recorder, Batcher[Any, Any], asyncio.Future[Any]]]:
    """A batcher of one-item batches computing ``"running"``, held at the gate until exit."""
    rec = Recorder(gated=True)
    b = make(rec, max_batch_size=1, **kw)
    try:
        running = asyncio.ensure_future(b.submit("running"))
        await wait_entered(rec)
        yield rec, b, running
    finally:
        rec.gate.set()


def test_concurrent_requests_merge_into_one_batch() -> None:
    async def main() -> None:
        rec = Recorder()
        b = make(rec, max_batch_size=5, max_queue_delay_us=60_000_000)
        outs = await asyncio.gather(*(b.submit(i) for i in range(5)))
        assert rec.batches == [[0, 1, 2, 3, 4]]
        assert [o[0] for o in outs] == [("done", i) for i in range(5)]
        assert all(o[1] == BatchInfo(batch_size=5, batch_requests=5) for o in outs)
        await b.stop()

    run(main)


def test_batch_waits_for_a_later_request_within_the_delay() -> None:
    async def main() -> None:
        rec = Recorder()
        # A long delay: the batch can only close because it fills up.
        b = make(rec, max_batch_size=2, max_queue_delay_us=60_000_000)
        first = asyncio.ensure_future(b.submit("a"))
        await asyncio.sleep(0.02)
        assert not first.done()
        second = await b.submit("b")
        assert second[1] == BatchInfo(2, 2)
        assert (await first)[0] == ("done", "a")
        assert rec.batches == [["a", "b"]]
        await b.stop()

    run(main)


def test_delay_closes_a_partial_batch() -> None:
    async def main() -> None:
        rec = Recorder()
        b = make(rec, max_batch_size=100, max_queue_delay_us=1000)
        out, info = await b.submit("only")
        assert out == ("done", "only")
        assert info == BatchInfo(1, 1)
        await b.stop()

    run(main)


def test_max_batch_size_splits_and_whole_requests_only() -> None:
    async def main() -> None:
        rec = Recorder()
        b = make(rec, max_batch_size=3, max_queue_delay_us=1000)
        await asyncio.gather(*(b.submit(i) for i in range(7)))
        assert [len(x) for x in rec.batches] == [3, 3, 1]
        assert flat(rec.batches) == list(range(7))  # FIFO
        rec.batches.clear()
        # sizes 2, 2, 1 with room 3: the second request does not fit and opens the next batch
        outs = await asyncio.gather(b.submit("x", 2), b.submit("y", 2), b.submit("z", 1))
        assert rec.batches == [["x"], ["y", "z"]]
        assert [o[1] for o in outs] == [BatchInfo(2, 1), BatchInfo(3, 2), BatchInfo(3, 2)]
        with pytest.raises(ValueError, match="outside"):
            await b.submit("too big", 4)
        await b.stop()

    run(main)


def test_no_batching_runs_each_request_alone() -> None:
    async def main() -> None:
        rec = Recorder()
        b = make(rec, max_batch_size=0, max_queue_delay_us=5_000_000)
        outs = await asyncio.gather(*(b.submit(i) for i in range(4)))
        assert rec.batches == [[0], [1], [2], [3]]
        assert all(o[1] == BatchInfo(1, 1) for o in outs)
        await b.stop()

    run(main)


def test_full_queue_is_overloaded_at_once() -> None:
    async def main() -> None:
        async with one_running(max_queue_size=2) as (rec, b, running):
            queued = [asyncio.ensure_future(b.submit(f"q{i}")) for i in range(2)]
            await asyncio.sleep(0)
            assert b.depth == 2
            with pytest.raises(Overloaded, match="max_queue_size 2") as err:
                await b.submit("rejected")
            assert err.value.status_code == 503
            assert err.value.headers["Retry-After"] == "1"
        await asyncio.gather(running, *queued)
        assert flat(rec.batches) == ["running", "q0", "q1"]
        await b.stop()

    run(main)


def test_deadline_expired_in_queue_is_never_computed() -> None:
    async def main() -> None:
        async with one_running() as (rec, b, running):
            with pytest.raises(DeadlineExceeded, match="not computed") as err:
                await b.submit("late", timeout_us=1000)
            assert err.value.status_code == 504
            assert b.depth == 0  # answered and gone from the queue
            # a generous timeout is honoured normally, and 0 means none (as in Triton)
            ok = asyncio.ensure_future(b.submit("ok", timeout_us=60_000_000))
            zero = asyncio.ensure_future(b.submit("zero", timeout_us=0))
            await asyncio.sleep(0.01)
            assert b.depth == 2
        await asyncio.gather(running, ok, zero)
        assert flat(rec.batches) == ["running", "ok", "zero"]
        await b.stop()

    run(main)


def test_queue_timeout_answers_503_and_never_computes() -> None:
    async def main() -> None:
        async with one_running(queue_timeout_us=50_000) as (rec, b, running):
            waiting = [asyncio.ensure_future(b.submit(f"w{i}")) for i in range(3)]
            own = asyncio.ensure_future(b.submit("own", timeout_us=10_000))  # shorter: its own
            longer = asyncio.ensure_future(b.submit("longer", timeout_us=60_000_000))
            errors = await asyncio.gather(*waiting, own, longer, return_exceptions=True)
        assert all(isinstance(e, Overloaded) for e in errors[:3] + errors[4:]), errors
        for e in errors[:3]:
            assert isinstance(e, Overloaded)
            assert e.status_code == 503
            assert e.headers["Retry-After"] == "1"
            assert "queue_timeout_us 50000" in e.message
            assert "not computed" in e.message
        assert isinstance(errors[3], DeadlineExceeded)  # the request's own timeout was shorter
        await running
        assert flat(rec.batches) == ["running"]
        assert b.depth == 0
        # With an idle queue, requests are computed as before.
        assert (await b.submit("after"))[0] == ("done", "after")
        await b.stop()

    run(main)


def test_queue_timeout_refuses_at_once_what_the_queue_ahead_would_delay_past_it() -> None:
    async def main() -> None:
        rec = Recorder(pace_s=0.1)
        b = make(rec, max_batch_size=2, max_queue_size=0, queue_timeout_us=1_000_000)
        assert b.expected_wait_s() == 0  # no pace known yet: admitted
        await b.submit("pace")  # one batch: the pace is at least 0.1 s a batch
        rec.gate.clear()
        rec.entered.clear()
        running = asyncio.ensure_future(b.submit("running"))
        await wait_entered(rec)
        queued = [asyncio.ensure_future(b.submit(i)) for i in range(2)]
        await asyncio.sleep(0)
        b.check_capacity()  # the running batch and one queued: about 0.2 s, admitted
        queued += [asyncio.ensure_future(b.submit(i)) for i in range(2, 40)]
        await asyncio.sleep(0)
        assert b.expected_wait_s() > 1.0
        with pytest.raises(Overloaded, match=r"would take about \d+ ms to start") as err:
            b.check_capacity()
        assert err.value.headers["Retry-After"] == "1"
        refused = [f for f in queued if f.done() and isinstance(f.exception(), Overloaded)]
        # 0.1 s a batch of 2, 1 s at most: about 20 are admitted (fewer if batches were
        # slower), the rest refused before they queued.
        assert 40 - 20 <= len(refused) < 40 - 2
        rec.gate.set()
        await asyncio.gather(running, *queued, return_exceptions=True)
        assert len(flat(rec.batches)) == 2 + 40 - len(refused)
        await b.stop()

    run(main)


def test_huge_timeouts_do_not_overflow() -> None:
    # timeout_us / 1e6 overflows a float past about 1.8e308 µs; callers other than the V2
    # decoder (which refuses past 2**63 - 1) reach the batcher too. Past a day: no deadline.
    async def main() -> None:
        async with one_running() as (rec, b, running):
            huge = [asyncio.ensure_future(b.submit(t, timeout_us=t)) for t in (10**400, 2**63)]
            await asyncio.sleep(0.01)
            assert b.depth == 2  # queued, without a deadline
        await asyncio.gather(running, *huge)
        assert flat(rec.batches) == ["running", 10**400, 2**63]
        await b.stop()

    run(main)


def test_exception_fails_only_its_batch() -> None:
    async def main() -> None:
        rec = Recorder()
        b = make(rec, max_batch_size=1)
        results = await asyncio.gather(
            b.submit("a"), b.submit("boom"), b.submit("c"), return_exceptions=True
        )
        assert results[0] == (("done", "a"), BatchInfo(1, 1))
        assert results[2] == (("done", "c"), BatchInfo(1, 1))
        err = results[1]
        assert isinstance(err, ServiceError)
        assert type(err) is ServiceError
        assert err.status_code == 500
        assert "inference failed (RuntimeError); request id -" in err.message
        assert "kaboom" not in err.message  # exception text stays in the log
        assert (await b.submit("after"))[0] == ("done", "after")
        await b.stop()

    run(main)


def test_exception_in_a_merged_batch_fails_all_of_its_requests() -> None:
    async def main() -> None:
        rec = Recorder()
        b = make(rec, max_batch_size=2, max_queue_delay_us=60_000_000)
        results = await asyncio.gather(b.submit("x"), b.submit("boom"), return_exceptions=True)
        assert all(isinstance(r, ServiceError) and r.status_code == 500 for r in results)
        await b.stop()

    run(main)


def test_cancelled_request_leaves_the_queue_and_is_not_computed() -> None:
    async def main() -> None:
        async with one_running() as (rec, b, running):
            gone = asyncio.ensure_future(b.submit("gone"))
            await asyncio.sleep(0)
            assert b.depth == 1
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            assert b.depth == 0
        await running
        assert (await b.submit("next"))[0] == ("done", "next")
        assert flat(rec.batches) == ["running", "next"]
        await b.stop()
        assert b.idle

    run(main)


def test_cancelled_while_computing_drops_the_result() -> None:
    async def main() -> None:
        rec = Recorder(gated=True)
        b = make(rec, max_batch_size=2, max_queue_delay_us=0)
        try:
            t = asyncio.ensure_future(b.submit("a"))
            await wait_entered(rec)
            t.cancel()
            await asyncio.sleep(0)
        finally:
            rec.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert (await b.submit("b"))[0] == ("done", "b")
        await b.stop()

    run(main)


def test_stop_drains_then_refuses() -> None:
    async def main() -> None:
        rec = Recorder(gated=True)
        b = make(rec, max_batch_size=2, max_queue_delay_us=60_000_000)
        tasks = [asyncio.ensure_future(b.submit(i)) for i in range(5)]
        await wait_entered(rec)
        stopping = asyncio.ensure_future(b.stop())
        await asyncio.sleep(0.01)
        with pytest.raises(ModelNotReady, match="unloading"):
            await b.submit("new")
        rec.gate.set()
        await stopping
        outs = await asyncio.gather(*tasks)
        assert [o[0] for o in outs] == [("done", i) for i in range(5)]
        assert b.idle

    run(main)


def test_stop_timeout_answers_everyone() -> None:
    async def main() -> None:
        rec = Recorder(gated=True)
        b = make(rec, max_batch_size=1)
        tasks = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        await wait_entered(rec)
        await b.stop(timeout_s=0.05)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, ModelNotReady) for r in results)
        rec.gate.set()

    run(main)


def test_metrics_are_recorded() -> None:
    async def main() -> None:
        rec = Recorder()
        metrics = Metrics()
        b: Batcher[Any, Any] = Batcher(
            "mm", rec, max_batch_size=3, max_queue_delay_us=60_000_000, max_queue_size=8,
            metrics=metrics,
        )  # fmt: skip
        b.start()
        await asyncio.gather(*(b.submit(i) for i in range(3)))
        value = metrics.registry.get_sample_value
        assert value("bitserve_batch_size_sum", {"model": "mm"}) == 3
        assert value("bitserve_batch_requests_count", {"model": "mm"}) == 1
        assert value("bitserve_queue_seconds_count", {"model": "mm"}) == 3
        assert value("bitserve_compute_seconds_count", {"model": "mm"}) == 1
        assert value("bitserve_queue_depth", {"model": "mm"}) == 0
        await b.stop()

    run(main)


def test_device_executors_share_one_thread_per_device() -> None:
    ex = DeviceExecutors()
    try:
        assert ex.get("cpu") is ex.get("cpu")
        assert ex.get("cpu") is not ex.get("cuda:0")
        names = {ex.get("cpu").submit(lambda: threading.current_thread().name).result()}
        names |= {ex.get("cpu").submit(lambda: threading.current_thread().name).result()}
        assert len(names) == 1
    finally:
        ex.shutdown()


class Fatal(BaseException):
    """Not an Exception: slips past ``except Exception``."""


def test_base_exception_in_a_batch_answers_everyone_and_closes() -> None:
    def compute(payloads: list[Any]) -> Sequence[Any]:
        if "fatal" in payloads:
            raise Fatal("deep trouble")
        return payloads

    async def main() -> None:
        b: Batcher[Any, Any] = Batcher(
            "m", compute, max_batch_size=1, max_queue_delay_us=0, max_queue_size=8
        )
        b.start()
        results = await asyncio.wait_for(
            asyncio.gather(b.submit("fatal"), b.submit("next"), return_exceptions=True), 5
        )
        assert isinstance(results[0], ServiceError)
        assert results[0].status_code == 500
        assert "inference failed (Fatal)" in results[0].message
        assert isinstance(results[1], ModelNotReady)  # queued behind a scheduler now gone
        with pytest.raises(ModelNotReady, match="not accepting requests"):
            await b.submit("later")
        await b.stop()

    run(main)


class _BrokenMetrics(Metrics):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def observe_queue(
        self, model: str, waits: list[float], levels: list[int] | None = None
    ) -> None:
        if self.where == "queue":
            raise RuntimeError("metrics broke")
        super().observe_queue(model, waits, levels)

    def observe_batch(self, model: str, items: int, requests: int, compute_seconds: float) -> None:
        if self.where == "batch":
            raise RuntimeError("metrics broke")
        super().observe_batch(model, items, requests, compute_seconds)


def test_error_after_the_batch_ran_still_answers_and_keeps_serving() -> None:
    async def main() -> None:
        b = make(Recorder(), metrics=_BrokenMetrics("batch"))
        assert (await asyncio.wait_for(b.submit("a"), 5))[0] == ("done", "a")
        assert (await asyncio.wait_for(b.submit("b"), 5))[0] == ("done", "b")
        await b.stop()

    run(main)


def test_scheduler_death_outside_the_batch_fails_requests_instead_of_hanging() -> None:
    async def main() -> None:
        b = make(Recorder(), metrics=_BrokenMetrics("queue"))
        with pytest.raises(ModelNotReady, match="stopped during this request"):
            await asyncio.wait_for(b.submit("a"), 5)
        await asyncio.sleep(0)  # the task's done-callback runs
        with pytest.raises(ModelNotReady, match="not accepting requests"):
            await b.submit("b")
        await b.stop()

    run(main)


def test_each_request_of_a_failed_batch_gets_its_own_error() -> None:
    async def main() -> None:
        rec = Recorder()
        b = make(rec, max_batch_size=3, max_queue_delay_us=60_000_000)
        errors = await asyncio.gather(
            b.submit("boom"), b.submit("x"), b.submit("y"), return_exceptions=True
        )
        assert len(rec.batches) == 1
        assert all(isinstance(e, ServiceError) for e in errors)
        assert len({id(e) for e in errors}) == 3
        for e in errors:  # each traceback is its own short chain, not an accumulated one
            depth, tb = 0, e.__traceback__
            while tb is not None:
                depth, tb = depth + 1, tb.tb_next
            assert depth <= 2
        await b.stop()

    run(main)


def test_retiring_batcher_does_not_drop_the_new_versions_queue_depth() -> None:
    async def main() -> None:
        metrics = Metrics()
        old = make(Recorder(), metrics=metrics)
        async with one_running(metrics=metrics) as (_, new, running):
            queued = asyncio.ensure_future(new.submit("queued"))
            await asyncio.sleep(0)

            def value(name: str, labels: dict[str, str]) -> float | None:
                metrics.flush()  # as a scrape does
                return metrics.registry.get_sample_value(name, labels)

            assert value("bitserve_queue_depth", {"model": "m"}) == 1
            await old.stop()  # the reload retires the old version
            assert value("bitserve_queue_depth", {"model": "m"}) == 1
        await asyncio.gather(running, queued)
        assert value("bitserve_queue_depth", {"model": "m"}) == 0
        await new.stop()

    run(main)


def test_a_batch_run_on_the_loop_first_takes_the_requests_arriving_this_turn() -> None:
    """With no queue delay, an inline batch still gathers requests whose tasks start in the
    turns right after the first one's (bytes already read): one batch, not three."""

    async def main() -> None:
        rec = Recorder()
        b = make(rec, max_batch_size=8, inline_below_s=1.0)
        await b.submit("warm")  # the first batch runs off the loop and sets the CPU average
        loop = asyncio.get_running_loop()
        late: list[asyncio.Future[Any]] = []
        first = asyncio.ensure_future(b.submit("a"))
        # As the protocol starts a request's task when its head is parsed: next turn.
        loop.call_soon(lambda: late.append(asyncio.ensure_future(b.submit("b"))))
        loop.call_soon(lambda: late.append(asyncio.ensure_future(b.submit("c"))))
        await asyncio.gather(first, *[asyncio.sleep(0)] * 3)
        await asyncio.gather(*late)
        assert rec.batches[1:] == [["a", "b", "c"]]
        await b.stop()

    run(main)
