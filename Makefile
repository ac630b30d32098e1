# The README's commands and CI's are these same targets.
# `make serve` and `make test` each create .venv and install what they need on a fresh machine.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The dev/test set-up pins torch; on a CUDA host use the image's torch (and its Triton) instead.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: system-deps venv serve test test-fast lint format typecheck grpc-proto bench bench-smoke client-isolated clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml clients/python/pyproject.toml
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[server,triton,data,onnx,tracing,test,bench,lint]" -e clients/python "$(TORCH_PIN)"
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/bitserve serve --host $(HOST) --port $(PORT)

# System packages the end-to-end tests use: nginx (the load balancer in front of replicas) and
# prometheus (promtool and a real scrape of the replicas for the dashboard queries).
system-deps:
	@{ command -v nginx || [ -x /usr/sbin/nginx ]; } >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends nginx prometheus >/dev/null; }

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not e2e and not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: $(STAMP)
	$(BIN)/mypy

# Regenerate service/grpc/proto/*_pb2.py(i) from the .proto files there.
grpc-proto: $(STAMP)
	$(BIN)/python -m service.grpc.proto.generate

# Full benchmarks: tables go to benchmarks/results/.
bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python -m benchmarks.$$(basename $$b .py) || exit 1; done

# A quick smoke run of each benchmark (tiny sizes, nothing written), as CI runs it.
bench-smoke: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python -m benchmarks.$$(basename $$b .py) --smoke || exit 1; done

# The client distribution alone, in a venv without torch or any server code.
client-isolated:
	rm -rf .venv-client
	$(PYTHON) -m venv .venv-client
	.venv-client/bin/pip install -q ./clients/python pytest pytest-timeout hypothesis
	.venv-client/bin/python -c "import bitserve_client, sys; assert 'torch' not in sys.modules"
	.venv-client/bin/python -m pytest -q -p no:cacheprovider tests/clients -m "not e2e"

clean:
	rm -rf $(VENV) .venv-client .pytest_cache .mypy_cache .ruff_cache .hypothesis
