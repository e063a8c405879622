# Two commands a fresh machine needs (see README): `make test` and `make demo`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.install-stamp

.PHONY: install test test-slow test-all demo notebooks gpu-check gpu-wheels clean

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

## Measure a GPU: docs/benchmarks/gpu-<device>.md (benchmarks/gpu_check.py; exits 2 without CUDA). Uses the
## venv's Python where there is one, else python3 (GPU machines with torch preinstalled, nothing from the network).
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

## Wheels that a GPU machine without network needs for `make gpu-check` (kornia for the device-augmentation rows;
## 7 MB), into the git-ignored .whl/ that the device tool carries (see README, "Measuring a GPU").
gpu-wheels:
	$(PY) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl kornia==0.9.0 kornia_rs==0.2.0

## Everything.
test-all: $(STAMP)
	$(PY) -m pytest -m ''

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
