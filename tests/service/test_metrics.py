"""Metrics recorded per request reach the Prometheus series once per turn of the event loop,
and a render always sees every record made before it."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from service.observability.metrics import Metrics


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_records_reach_the_series_at_the_next_turn_of_the_loop() -> None:
    async def main() -> None:
        m = Metrics(nvml=None)
        for _ in range(5):
            m.request_started()
        for i in range(3):
            m.request_finished("demo", "success", 0.001 * (i + 1))
        m.request_finished("demo", "Overloaded", 0.0001)
        m.observe_queue("demo", [0.0005, 0.002])
        r = m.registry
        assert sample(r, "bitserve_requests_total", model="demo", outcome="success") == 0
        await asyncio.sleep(0)  # one turn
        assert sample(r, "bitserve_requests_total", model="demo", outcome="success") == 3
        assert sample(r, "bitserve_requests_total", model="demo", outcome="Overloaded") == 1
        assert sample(r, "bitserve_in_flight_requests") == 1
        count = "bitserve_request_latency_seconds_count"
        assert sample(r, count, model="demo") == 4
        assert abs(sample(r, "bitserve_request_latency_seconds_sum", model="demo") - 0.0061) < 1e-12
        assert sample(r, "bitserve_queue_seconds_count", model="demo") == 2
        m.request_finished("demo", "success", 0.5)
        text = m.render().decode()  # renders flush first
        assert 'bitserve_requests_total{model="demo",outcome="success"} 4.0' in text
        assert "bitserve_in_flight_requests 0.0" in text

    asyncio.run(main())


def test_without_an_event_loop_records_are_written_at_once() -> None:
    m = Metrics(nvml=None)
    m.request_started()
    m.request_finished("demo", "success", 0.01)
    assert sample(m.registry, "bitserve_requests_total", model="demo", outcome="success") == 1
