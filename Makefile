# The commands of the README. run and test create .venv and install what they need on a fresh clone.
#   make run    train the default config with two elastic torchrun agents on this host, print EM/F1
#   make test   ruff, mypy and the test suite (unit and real-torchrun integration tests)
#   make test-loaded  the same beside two busy processes (a loaded machine)
#   make gpu-check  on a machine with one GPU: nccl, bf16/fp16, a killed worker resumed; figures and checks
# Bring your own torch (e.g. a CUDA build): install it into .venv first, or set TORCH_SPEC.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
RUN_DIR ?= runs/default-$(shell date +%Y%m%d-%H%M%S)
ARGS ?=
BIN := $(VENV)/bin

.PHONY: run test test-bench test-loaded test-long gpu-check lint install dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# torch is a range in pyproject.toml; installing it first keeps pip from resolving that range to a
# multi-GB CUDA download when no torch is present.
$(VENV)/.torch: | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	touch $@

$(VENV)/.installed: pyproject.toml $(VENV)/.torch
	$(BIN)/python -m pip install --quiet -e .
	touch $@

# The dev extra includes the hf extra (transformers): the tests cover that family too. `make run` does not.
$(VENV)/.dev: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(VENV)/.installed
dev: $(VENV)/.dev

run: $(VENV)/.installed
	PYTHON=$(BIN)/python launch/local.sh start --agents 2 run.dir=$(RUN_DIR) $(ARGS)

# mypy reads its settings (files included) from pyproject.toml's [tool.mypy].
lint: $(VENV)/.dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy

# Three pytest processes (pytest-xdist) on a 2-core machine: most tests wait on real torchrun jobs,
# rendezvous heartbeats, quorum and collective timeouts and chaos timers, which leave a core idle meanwhile.
# Measured here, the same 1817 tests: 10:55 with three, 12:34 with two; 1827 tests, 2026-12-06: 14:41 with
# three (the order pytest collects them in and xdist's default chunks: the long tests put first and handed
# out one at a time took 16:30, the two tests sharing a module's fixture then trained it twice, and the
# long tests ran beside each other). TEST_WORKERS=0 runs them in this one process. The benchmark runs and the loaded suite keep two (their own variables).
# The benchmark commands' end-to-end runs (marker `bench`) have a target of their own, run by CI after this.
TEST_WORKERS ?= 3
BENCH_WORKERS ?= 2
LOADED_WORKERS ?= 2
SUITE_MARKS ?= not long and not bench
test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "$(SUITE_MARKS)" $(ARGS)

# Every `elastic-qa bench ...` command run end to end on a tiny job (3 min 7 s in two processes here).
test-bench: $(VENV)/.dev
	$(BIN)/python -m pytest -q -n $(BENCH_WORKERS) -m "bench and not long" $(ARGS)

# `make test` beside two busy processes (tests/under_load.py): a test that waits on luck instead of an
# event fails here, not on a loaded CI box. The burners end with the run, Ctrl-C included.
# Then `ckpt verify` over every run directory the suite left there (tests.leftovers): what a killed,
# faulted or stopped job left must verify.
LOADED_BASETEMP ?= /tmp/elastic-qa-test-loaded
test-loaded: lint
	$(BIN)/python -m tests.under_load --burners 2 -- \
	  $(BIN)/python -m pytest -q -n $(LOADED_WORKERS) -m "$(SUITE_MARKS)" --basetemp=$(LOADED_BASETEMP) $(ARGS)
	$(BIN)/python -m tests.leftovers $(LOADED_BASETEMP)

# The scenarios marked `long` (minutes each), kept out of `make test`'s time budget.
test-long: $(VENV)/.dev
	$(BIN)/python -m pytest -q -m long $(ARGS)

# No venv of its own: it runs on the Python that has the CUDA build of torch (.venv's when there is one,
# else $(PYTHON); GPU_PYTHON=... to choose), with this checkout first on the path. $OUT, when set, gets the
# figures (gpu-check.json) and the runs' logs.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 $(GPU_PYTHON) -m elastic_qa.bench.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
