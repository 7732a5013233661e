# Fit the Model: one command each. Every target creates .venv first when it is missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup run test unit lab clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv and install labkit with its dependencies

run: $(STAMP)  ## execute every notebook (fast defaults) into build/, write build/results.json and build/report.html
	$(PY) -m labkit.runner --notebooks notebooks --out build

test: $(STAMP)  ## unit tests, then nbval over every notebook (checked cells' expected outputs from their source)
	$(PY) -m labkit.nbcheck notebooks build/nbval
	LABKIT_BATCH=1 $(PY) -m pytest tests build/nbval --nbval-lax --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider

unit: $(STAMP)  ## unit tests only (no notebooks)
	LABKIT_BATCH=1 $(PY) -m pytest tests -p no:cacheprovider

LAB_ARGS ?=
AS_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
lab: $(STAMP)  ## JupyterLab on notebooks/ (token authentication on); extra options: make lab LAB_ARGS="--port 9999"
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(AS_ROOT) $(LAB_ARGS)

clean:
	rm -rf build
