# Two commands from a fresh clone:  `make train`  and  `make test`.
# Overrides:  make setup TORCH="torch==2.13.0"   (e.g. TORCH=torch for the default CUDA build)
#             make setup MPI=                     (use the cluster's MPI: skip the mpich wheel)
#             make train NP=8 TRAIN_ARGS="--grid 2x2x2 --epochs 50"
#             make train DEVICE=auto               (one GPU per rank where there are enough)
#             make test TEST_WORKERS=1             (one pytest process; default 2 xdist workers,
#                                                   each pinned to its share of the cores)
#             make test-cpus                       (the suite under other CPUs' code paths)
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
MPI    ?= mpich
NP     ?= 4
TRAIN_ARGS ?=
DEVICE ?= cpu
TEST_WORKERS ?= 2
PYTEST_WORKERS := $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup,-p no:xdist)
BIN    := $(VENV)/bin
# the mpich wheel's mpiexec when installed, else the system's (clusters)
MPIEXEC ?= $(if $(wildcard $(BIN)/mpiexec),$(BIN)/mpiexec,mpiexec)
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-fast test-cpus lint gpu-check clean
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "$(TORCH)"
	$(if $(MPI),$(BIN)/pip install $(MPI))
	$(BIN)/pip install -e ".[test]"
	touch $(STAMP)

train: $(STAMP)
	$(MPIEXEC) -n $(NP) $(BIN)/python -m plexus.train --device $(DEVICE) $(TRAIN_ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy common
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS)

# the edit-test loop: lint, types, and every test not marked slow (no multi-rank launches)
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy common
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "not slow"

# the suite again under each of the other CPUs' code paths that this CPU can take (MKL, oneDNN
# and ATen switches; tests/cpu_variants.py, docs/testing.md): one full run per variant
test-cpus: $(STAMP)
	$(BIN)/python -m tests.cpu_variants
	$(BIN)/python -m tests.cpu_variants --run -- -q $(PYTEST_WORKERS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy common

# on a lent GPU: every `pytest -m gpu` test and the benches' GPU variants in 10 minutes, one
# table (bench/gpu_check.py); without a GPU it says so and exits 0
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .mypy_cache
