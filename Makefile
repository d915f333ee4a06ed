# dsv4ref: `make lab` to read, `make test` to test. Both set up .venv first if needed.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: lab test setup notebooks check bench demo clean

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh
	touch $@

setup: $(STAMP)

## Start JupyterLab on notebooks/ (headless: it prints the URL to open).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --no-browser --ip=127.0.0.1 --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

## Unit tests + nbval over every notebook (stored outputs must match a fresh run).
test: $(STAMP)
	$(PY) -m pytest

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
