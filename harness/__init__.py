"""What the tests and the benchmarks share: real ``bitserve serve`` processes (``server``), the
end-to-end workload and its wire forms (``workload``, ``wire``), probes of a running server
(``probes``), a load generator (``loadgen``), hostile clients and fuzz cases (``hostile``,
``fuzzcases``), model repositories on disk (``repo_utils``, ``model_formats``) and memory
measurements (``memory``). Neither a test nor a benchmark itself: tests import no benchmark,
benchmarks import no test."""
