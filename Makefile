# pl_dp — two commands: `make demo` and `make test` (each sets up .venv first; `make test-slow` runs the end-to-end
# tests `make test` leaves out); `make docs` builds the site,
# `make typecheck` checks pl_dp's annotations (mypy; settings in pyproject.toml).
VENV ?= .venv
PYTHON ?= python3
# CPU build from the local wheel cache; override for CUDA, e.g. TORCH_SPEC="torch==2.13.0" with your index.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# `make test` runs the suite in this many pytest-xdist workers, a file at a time each (one torch thread a worker)
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow test-gpu docs lint typecheck bench reproduce

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pl-dp fit --config configs/digits/pazo_m.yaml

test: $(STAMP)
	WANDB_MODE=offline HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile tests

test-slow: $(STAMP)
	WANDB_MODE=offline HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m slow tests

# the tests of methods, per-sample gradients, the zeroth-order engine, noise, the fit-start checks, data and checkpoints,
# with their trainers on a CUDA device (tests/conftest.py DEVICE); with no CUDA device every test skips, saying so
test-gpu: $(STAMP)
	PL_DP_TEST_DEVICE=cuda WANDB_MODE=offline HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "not slow" tests/methods \
		tests/per_sample tests/zo tests/privacy tests/step tests/callbacks tests/nets tests/data

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check pl_dp tests benchmarks examples docs

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) benchmarks/step_cost.py

reproduce: $(STAMP)
	$(PY) benchmarks/reproduce.py
