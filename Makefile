PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.install-stamp

.PHONY: install test test-fast test-extended test-slow test-all lint format typecheck docs docs-serve demo notebooks \
	gpu-check clean

# (Re)install whenever the package metadata changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

## The default suite (every test not marked `slow` or `extended`).
test: $(STAMP)
	$(PY) -m pytest

## The longer runs CI adds after the default suite (marked `extended`).
test-extended: $(STAMP)
	$(PY) -m pytest -m "extended and not slow"

## The unit tests, for the edit-test loop: no subprocess runs, DDP, notebooks or training runs.
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not extended and not integration"

## Only the slow tests.
test-slow: $(STAMP)
	$(PY) -m pytest -m slow

## Everything.
test-all: $(STAMP)
	$(PY) -m pytest -m ''

## ruff (lint, import order, format) over the repository.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

## mypy over the packages listed in pyproject.toml ([tool.mypy] files).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

## The documentation site, strict: a broken link, a missing reference or any warning fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve

## HFMCA-SS(*) on the embedded data set, offline, a few minutes on 2 CPU cores.
demo: $(STAMP)
	$(VENV)/bin/hfmca fit --config configs/demo.yaml

## Re-run the notebooks and save them with their outputs (the tests run them too).
notebooks: $(STAMP)
	$(PY) tools/execute_notebooks.py

## Measure a GPU: the cuda tests, then step rows, compiled rows, precision, data paths and training runs, into
## docs/benchmarks/gpu-<device>.md (benchmarks/gpu_check; 480 s, or GPU_CHECK_ARGS="--time-budget N"; exits 2
## without CUDA). Uses the venv's Python where there is one, else python3 (GPU machines with torch and pytest
## preinstalled, nothing from the network).
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) benchmarks/gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache build site *.egg-info
