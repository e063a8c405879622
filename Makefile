# Two commands a fresh machine needs (see README): `make test` and `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.install-stamp

.PHONY: install test test-slow test-all demo notebooks clean

# (Re)install whenever the package metadata changes.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

## Whole default suite (excludes tests marked `slow`).
test: $(STAMP)
	$(PY) -m pytest

## Only the slow tests.
test-slow: $(STAMP)
	$(PY) -m pytest -m slow

## The main job: HFMCA-SS(*) on the embedded data set, offline, a few minutes on 2 CPU cores.
demo: $(STAMP)
	$(VENV)/bin/hfmca fit --config configs/demo.yaml

## Re-run the notebooks and save them with their outputs (figures show on GitHub; the tests run them too).
notebooks: $(STAMP)
	$(PY) tools/execute_notebooks.py

## Everything.
test-all: $(STAMP)
	$(PY) -m pytest -m ''

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
