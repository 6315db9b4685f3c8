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

.PHONY: setup run test test-slow test-gpu test-all bench-gpu check-gpu clean

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

# The GPU benchmark: ours (AdamW, Muon) against scripts/reference_gpt.py at gpt_124m, at one
# micro-batch (16 x 1024 tokens) and at 0.5M tokens per optimizer step (32 accumulated
# micro-batches, as users train, where Newton-Schulz is amortised over 32x the tokens), then
# moe_1b with Muon (tokens/s, MFU, kernels and host syncs per step, GPU busy %, peak memory),
# then the Muon step at gpt_124m against its Newton-Schulz FLOP floor.
# On a GPU image with its own torch: make bench-gpu PY=python3 SETUP=
bench-gpu: $(SETUP)
	$(PY) scripts/bench_train.py --models gpt_124m --modes compiled --precisions bf16 \
		--optims adamw muon --batch-size 16 --seq-len 1024 --warmup 3 --rounds 5 --steps 10 --census
	$(PY) scripts/bench_train.py --models gpt_124m --modes compiled --precisions bf16 \
		--optims adamw muon --batch-size 16 --seq-len 1024 --tokens-per-step 524288 \
		--warmup 2 --rounds 3 --steps 1 --census
	$(PY) scripts/bench_train.py --models moe_1b --modes compiled --precisions bf16 \
		--optims muon --batch-size 8 --seq-len 2048 --warmup 3 --rounds 3 --steps 5 --census
	$(PY) scripts/bench_optimizer.py --model gpt_124m --dtypes bf16 --warmup 5 --repeats 20

# One GPU check that fits in 10 minutes on one H100/H200 (scripts/check_gpu.py): the tests of
# test-gpu (on pytest-xdist workers where installed), bench-gpu's gpt_124m rows (also at 0.5M
# tokens per step) beside the plain step of ../shared/bench/, the Newton-Schulz method table, the
# Muon step, moe_1b, and one-rank dry runs of gpt_8b, moe_16b and gpt_1b beside the planner and the
# FakeTensor estimate (scripts/dry_run_layouts.py; alone: scripts/check_gpu.py --only dry-runs).
# Each step has its own time limit and runs whatever became of the ones
# before; $(OUT_DIR)/summary.md is rewritten after each, beside each step's full log.
# On a GPU image with its own torch: make check-gpu PY=python3 SETUP= OUT_DIR=/path/to/out
# (PLAIN_STEP=/path/to/plain_gpt_step.py if it is neither in shared/bench/ nor ../shared/bench/).
OUT_DIR ?= check-gpu
PLAIN_STEP ?=
check-gpu: $(SETUP)
	$(PY) scripts/check_gpu.py --out $(OUT_DIR) $(if $(PLAIN_STEP),--plain $(PLAIN_STEP))

test-all: $(SETUP)
	$(PY) -m pytest

clean:
	rm -rf outputs multirun .pytest_cache
