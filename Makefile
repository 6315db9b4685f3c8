# `make run` and `make test` work on a fresh machine: they create the virtualenv if it is
# missing and install requirements.txt into it first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# What the targets below need first: the virtualenv. On a machine whose own python already has
# the requirements (e.g. a GPU image with its own torch), skip it: make test-gpu PY=python3 SETUP=
SETUP ?= $(STAMP)
# Extra Hydra overrides for `make run`, e.g. make run ARGS="model=gpt_small optim=adamw"
ARGS ?=

.PHONY: setup run test test-slow test-gpu test-all bench-gpu clean

setup: $(STAMP)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

run: $(SETUP)
	$(PY) train.py $(ARGS)

# The CPU suite: numerics on the CPU and gloo, whatever GPUs the machine has.
test: $(SETUP)
	$(PY) -m pytest -m "not slow and not gpu"

test-slow: $(SETUP)
	$(PY) -m pytest -m "slow and not gpu"

# The CUDA paths; each test says why it is skipped on a machine without (enough) GPUs.
test-gpu: $(SETUP)
	$(PY) -m pytest -m gpu

# The GPU benchmark: ours (AdamW, Muon) against scripts/reference_gpt.py at gpt_124m, then
# moe_1b with Muon (tokens/s, MFU, kernels and host syncs per step, GPU busy %, peak memory),
# then the Muon step at gpt_124m against its Newton-Schulz FLOP floor.
# On a GPU image with its own torch: make bench-gpu PY=python3 SETUP=
bench-gpu: $(SETUP)
	$(PY) scripts/bench_train.py --models gpt_124m --modes compiled --precisions bf16 \
		--optims adamw muon --batch-size 16 --seq-len 1024 --warmup 3 --rounds 5 --steps 10 --census
	$(PY) scripts/bench_train.py --models moe_1b --modes compiled --precisions bf16 \
		--optims muon --batch-size 8 --seq-len 2048 --warmup 3 --rounds 3 --steps 5 --census
	$(PY) scripts/bench_optimizer.py --model gpt_124m --dtypes bf16 --warmup 5 --repeats 20

test-all: $(SETUP)
	$(PY) -m pytest

clean:
	rm -rf outputs multirun .pytest_cache
