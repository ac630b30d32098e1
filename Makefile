# The README's commands and CI's are these same targets.
# `make serve` and `make test` each create .venv and install what they need on a fresh machine:
# `make serve` only the server and the client (its own stamp), `make test` everything.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The dev/test set-up pins torch; on a CUDA host use the image's torch (and its Triton) instead.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-serve
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: system-deps standin-images venv serve test test-unit test-in-process test-e2e test-fast test-uvicorn-floor lint format typecheck docs grpc-proto bench bench-smoke client-isolated clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml clients/python/pyproject.toml
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[server,triton,data,onnx,ray,tracing,test,bench,lint,docs]" -e clients/python "$(TORCH_PIN)"
	touch $(STAMP) $(SERVE_STAMP)

# What the demo needs and no more: the server and the client (no Ray, ONNX, test or lint extras).
$(SERVE_STAMP): $(BIN)/python pyproject.toml clients/python/pyproject.toml
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[server]" -e clients/python "$(TORCH_PIN)"
	touch $(SERVE_STAMP)

venv: $(STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/bitserve serve --host $(HOST) --port $(PORT)

# System packages the end-to-end tests use: nginx (the load balancer in front of replicas),
# prometheus (promtool and a real scrape of the replicas for the dashboard queries), and a
# Docker engine with debootstrap (the container tests build the Dockerfile on a stand-in base
# image made from Debian packages; they start dockerd themselves when none is running), and
# plink2 (the genotype tests and benchmark compare `bitserve genotypes` with plink2 --score).
system-deps:
	@{ command -v nginx || [ -x /usr/sbin/nginx ]; } >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 && \
		{ command -v dockerd || [ -x /usr/sbin/dockerd ]; } >/dev/null 2>&1 && \
		{ command -v debootstrap || [ -x /usr/sbin/debootstrap ]; } >/dev/null 2>&1 && \
		command -v plink2 >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends nginx prometheus docker.io debootstrap plink2 >/dev/null; }

# The container tests' stand-in base images (tests/deploy/_standin.py): built once per machine
# and set of pins; the tests build them too when missing. CI starts this early, in the
# background, so that the build overlaps the other tests.
standin-images: $(STAMP) system-deps
	$(BIN)/python -m tests.deploy._standin

# Every test, in tiers: unit and in-process first (they fail fast and cheaply), then end to end
# (real bitserve serve processes, nginx, Prometheus, Docker, Ray). Each tier prints its 25
# slowest tests. A tier's tests are the markers' selection; together they are the whole suite.
# Each tier runs in JOBS pytest-xdist workers (JOBS=0: one process, as pytest alone runs), a
# test module's tests in the same worker (--dist loadgroup, one group per module and one for
# tests/ray: tests/conftest.py; its module fixtures, its servers included, start once). The in-process tier is CPU-bound (two cores: two workers); the
# end-to-end tier mostly waits on the servers it starts (E2E_JOBS=3 overlaps that waiting); it
# hands out its groups in tests/conftest.py's order (the container tests and Ray's last).
JOBS ?= 2
E2E_JOBS ?= 3
PYTEST := $(BIN)/python -m pytest -q --durations=25
XDIST = $(if $(filter 0,$(1)),,-n $(1) --dist loadgroup)
# The inner loop: neither end-to-end nor slow tests (measured in docs/development.md).
UNIT_MARKERS ?= not e2e and not slow
test: $(STAMP) system-deps
	$(PYTEST) $(call XDIST,$(JOBS)) -m "not e2e"
	$(PYTEST) $(call XDIST,$(E2E_JOBS)) --no-loadscope-reorder -m e2e

test-unit: $(STAMP)
	$(PYTEST) $(call XDIST,$(JOBS)) -m "$(UNIT_MARKERS)"

# The two tiers of `make test` one at a time.
test-in-process: $(STAMP)
	$(PYTEST) $(call XDIST,$(JOBS)) -m "not e2e"

test-e2e: $(STAMP) system-deps
	$(PYTEST) $(call XDIST,$(E2E_JOBS)) --no-loadscope-reorder -m e2e

test-fast: test-unit

# The HTTP protocol at the oldest uvicorn of the range pyproject.toml pins (the venv holds the
# newest): installed beside the venv, first on the path, for the HTTP tests and a real server.
UVICORN_FLOOR ?= 0.29.0
test-uvicorn-floor: $(STAMP)
	rm -rf .uvicorn-floor
	$(BIN)/pip install -q --no-deps --target .uvicorn-floor "uvicorn==$(UVICORN_FLOOR)"
	PYTHONPATH=$(CURDIR)/.uvicorn-floor $(BIN)/python -c \
		"import uvicorn; assert uvicorn.__version__ == '$(UVICORN_FLOOR)', uvicorn.__version__"
	PYTHONPATH=$(CURDIR)/.uvicorn-floor $(BIN)/python -m pytest -q -p no:cacheprovider \
		tests/service/test_http_protocol.py tests/service/test_http_limits.py \
		tests/service/test_app_http.py tests/service/test_http_answers.py tests/e2e/test_server.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: $(STAMP)
	$(BIN)/mypy

# The documentation site (mkdocs.yml, docs/) into site/; --strict: any warning fails it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Regenerate service/grpc/proto/*_pb2.py(i) from the .proto files there.
grpc-proto: $(STAMP)
	$(BIN)/python -m service.grpc.proto.generate

# Full benchmarks: tables go to benchmarks/results/.
bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(BIN)/python -m benchmarks.$$(basename $$b .py) || exit 1; done

# A quick smoke run of each benchmark (tiny sizes, nothing written), as CI runs it: one
# interpreter imports torch once and forks each run from it, BENCH_JOBS at a time (most of
# them wait on the servers they start); a table of each run's wall and CPU seconds at the end.
BENCH_JOBS ?= 2
bench-smoke: $(STAMP)
	$(BIN)/python -m benchmarks.smoke --jobs $(BENCH_JOBS)

# The client distribution alone, in a venv without torch or any server code.
client-isolated:
	rm -rf .venv-client
	$(PYTHON) -m venv .venv-client
	.venv-client/bin/pip install -q ./clients/python pytest pytest-timeout hypothesis
	.venv-client/bin/python -c "import bitserve_client, sys; assert 'torch' not in sys.modules"
	.venv-client/bin/python -m pytest -q -p no:cacheprovider tests/clients -m "not e2e"

clean:
	rm -rf $(VENV) .venv-client .uvicorn-floor .pytest_cache .mypy_cache .ruff_cache .hypothesis site
