# dsv4ref: `make lab` to read, `make test` to test. Both set up .venv first if needed.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The interpreter's tl.dot is numpy matmul on tiny tiles: threaded BLAS only adds contention (2 test workers).
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1

.PHONY: lab test test-long lint setup notebooks check bench demo clean

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh
	touch $@

setup: $(STAMP)

## Start JupyterLab on notebooks/ (headless: it prints the URL to open).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --no-browser --ip=127.0.0.1 --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

## Lint (ruff check, ruff format --check), then unit tests + nbval over every notebook (stored outputs must match a fresh run).
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

## The long property-based run (hypothesis's 'long' profile); CI runs the small one inside `make test`.
test-long: $(STAMP)
	HYPOTHESIS_PROFILE=long $(PY) -m pytest -n 2 tests -k contract

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

## Rebuild notebooks/*.ipynb from notebooks/src/*.py and execute them on the CPU, in place.
notebooks: $(STAMP)
	DSV4REF_DEVICE=cpu $(PY) scripts/build_notebooks.py $(NB)

check: $(STAMP)
	$(PY) -m dsv4ref check

bench: $(STAMP)
	$(PY) -m dsv4ref bench

demo: $(STAMP)
	$(PY) -m dsv4ref demo

clean:
	rm -rf $(VENV)
