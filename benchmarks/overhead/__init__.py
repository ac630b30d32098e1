"""Serving overhead: bitserve against a hand-written FastAPI V2 endpoint and a raw ASGI floor.

The tiny model (:mod:`benchmarks.overhead.tiny`) makes the kernels free, so what is measured
is the serving layer: HTTP, V2 framing, validation, batching, metrics. Triton's perf_analyzer
(C++, ``../shared/tools/perf-analyzer.sh``) is the load generator. See
``benchmarks/bench_overhead.py``.
"""
