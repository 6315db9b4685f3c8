# `make run` and `make test` work on a fresh machine: they create the virtualenv if it is
# missing and install requirements.txt into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Extra Hydra overrides for `make run`, e.g. make run ARGS="model=gpt_small optim=adamw"
ARGS ?=

.PHONY: setup run test test-slow test-all clean

setup: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

run: $(STAMP)
	$(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

test-all: $(STAMP)
	$(PY) -m pytest

clean:
	rm -rf outputs multirun .pytest_cache
