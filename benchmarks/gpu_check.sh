#!/usr/bin/env bash
# One prepared call for a lent GPU host (see README "GPU checks"): the CUDA tests, then the
# GPU benchmarks. Runs under the host image's python3 (its CUDA torch and its Triton; no
# pins applied there). Output goes to stdout and, when $OUT is set, to $OUT/.
#
#   device run:  bash benchmarks/gpu_check.sh
#
# Optional wheels for the server tests (fastapi, uvicorn, pydantic-settings, tritonclient...)
# can travel in .whl/ (see the device tool's README); without them only gpu_ops is checked.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

# The device tool allows 10 minutes a call and 15 a session, start-up included: every step's
# timeout is capped by what is left of one budget, so the whole script ends inside one call.
BUDGET_S="${GPU_CHECK_BUDGET_S:-540}"
cap() { # cap STEP_S: the step's own limit, or what is left of the budget (at least 1 s)
  local left=$((BUDGET_S - SECONDS))
  ((left < 1)) && left=1
  echo $(($1 < left ? $1 : left))
}

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/device.txt"

# 1. CUDA tests of gpu_ops: the Triton kernels against the references, opcheck of every
#    torch.ops.bitserve op on CUDA tensors, compile/export, the CUDA staging pool; forward_bits'
#    three paths (band, event scatter, prefix sums) on CUDA against the float64 reference
#    (tests/gpu_ops/test_forward_bits.py, the "cuda" cases); a tabulated response on the fly,
#    every kernel and bits path on CUDA (tests/gpu_ops/test_tabulated_otf.py).
timeout "$(cap 170)" "$PY" -m pytest -q -x -p no:cacheprovider -o addopts="" \
  -W error -m "not e2e" tests/gpu_ops 2>&1 | tee "$OUT/tests.txt"
# The server's CUDA tests (the pipeline's CUDA timing, the NVML gauges) where its packages are.
if "$PY" -c "import fastapi, prometheus_client, pynvml, safetensors" 2>/dev/null; then
  timeout "$(cap 60)" "$PY" -m pytest -q -x -p no:cacheprovider -o addopts="" \
    -W error -m "needs_cuda" tests/service 2>&1 | tee "$OUT/tests_service.txt"
fi

# 2. GPU benchmarks (each writes benchmarks/results/<name>.md; copied to $OUT). bench_resample
#    ends with the demo workload from packed bits: unpackbits + band against forward_bits.
for b in bench_bits bench_resample bench_loader; do
  [ -f "benchmarks/$b.py" ] || continue
  timeout "$(cap 60)" "$PY" -m benchmarks.$b --device cuda 2>&1 | tee "$OUT/$b.txt"
  name="${b#bench_}"
  [ -f "benchmarks/results/$name.md" ] && cp "benchmarks/results/$name.md" "$OUT/${name}_gpu.md"
done

# 3. Workers per GPU for `--workers auto` (README "Workers"): the fingerprint MLP through
#    infer_many with 1, 2 and 4 workers per GPU, where the server's packages are.
if "$PY" -c "import fastapi, uvicorn, httptools, prometheus_client, safetensors, bitserve_client" 2>/dev/null; then
  timeout "$(cap 90)" "$PY" -m benchmarks.bench_mlp --workers-per-gpu 1,2,4 2>&1 | tail -20 | tee "$OUT/mlp_gpu.txt"
  [ -f benchmarks/results/mlp_gpu.md ] && cp benchmarks/results/mlp_gpu.md "$OUT/mlp_gpu.md"
fi

# 4. The Ray scorer's per-row cost on the GPU (no Ray needed: the model and pipeline alone),
#    for the scale-out model in benchmarks/results/ray.md.
if "$PY" -c "import pydantic_settings, safetensors" 2>/dev/null; then
  timeout "$(cap 40)" "$PY" -m benchmarks.bench_ray --scorer-only --device cuda 2>&1 | tee "$OUT/ray_scorer_gpu.txt"
fi
