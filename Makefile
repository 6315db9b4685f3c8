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
# The project's packages for every command below, also where nothing is installed (SETUP=): the
# virtualenv has them installed in editable mode (pyproject.toml), a bare GPU image does not.
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: setup run test test-slow test-gpu test-all bench-gpu check-gpu compare-gpu clean

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps --no-build-isolation -e .
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

# The GPU benchmark: ours (AdamW, Muon) against lab/tools/bench/reference_gpt.py at gpt_124m, at one
# micro-batch (16 x 1024 tokens) and at 0.5M tokens per optimizer step (32 accumulated
# micro-batches, as users train, where Newton-Schulz is amortised over 32x the tokens), then
# moe_1b with Muon (tokens/s, MFU, kernels and host syncs per step, GPU busy %, peak memory),
# then the Muon step at gpt_124m against its Newton-Schulz FLOP floor.
# On a GPU image with its own torch: make bench-gpu PY=python3 SETUP=
bench-gpu: $(SETUP)
	$(PY) lab/tools/bench/bench_train.py --models gpt_124m --modes compiled --precisions bf16 \
		--optims adamw muon --batch-size 16 --seq-len 1024 --warmup 3 --rounds 5 --steps 10 --census
	$(PY) lab/tools/bench/bench_train.py --models gpt_124m --modes compiled --precisions bf16 \
		--optims adamw muon --batch-size 16 --seq-len 1024 --tokens-per-step 524288 \
		--warmup 2 --rounds 3 --steps 1 --census
	$(PY) lab/tools/bench/bench_train.py --models moe_1b --modes compiled --precisions bf16 \
		--optims muon --batch-size 8 --seq-len 2048 --warmup 3 --rounds 3 --steps 5 --census
	$(PY) lab/tools/bench/bench_optimizer.py --model gpt_124m --dtypes bf16 --warmup 5 --repeats 20

# One GPU check that fits in 10 minutes on one H100/H200 (lab/tools/gpu/check_gpu.py; the steps, their
# limits and the budget's arithmetic: lab/tools/gpu/check_gpu.py --dry-run). Beside test-gpu's tests (on
# pytest-xdist workers where installed) run the fair study's tuned choice in bf16
# (compare-gpu's rerun, with its report) and gpt_1b's loss after 200 steps in bf16 and FP8;
# then, each alone on the GPU: the plain step of ../shared/bench/, bench-gpu's gpt_124m rows at
# 16k tokens per step, the Muon step, gpt_1b in bf16 and FP8 with AdamW and Muon at the batch the
# planner picks (tokens/s, MFU, peak memory), and moe_1b. summary.md states each goal against what
# was measured. Steps the budget no longer fits (gpt_124m at 0.5M tokens, the Newton-Schulz method
# table, the EP dispatch, the one-rank dry runs) run with lab/tools/gpu/check_gpu.py --only NAME.
# Each step has its own time limit and runs whatever became of the ones before; after each,
# $(OUT_DIR)/summary.md is rewritten beside each step's full log and the whole of $(OUT_DIR) is
# packed into $(OUT_DIR).tar.gz, the one file to copy back (a killed check still leaves one).
# FP8 needs torchao (bring its wheel as for Hydra: ../shared/GPU.md).
# On a GPU image with its own torch: make check-gpu PY=python3 SETUP= OUT_DIR=/path/to/out
# (PLAIN_STEP=/path/to/plain_gpt_step.py if it is neither in shared/bench/ nor ../shared/bench/).
OUT_DIR ?= check-gpu
PLAIN_STEP ?=
check-gpu: $(SETUP)
	$(PY) lab/tools/gpu/check_gpu.py --out $(OUT_DIR) $(if $(PLAIN_STEP),--plain $(PLAIN_STEP))

# The fair study's tuned choice in bf16 on one GPU, in about 4 minutes (lab/tools/gpu/reference_bf16.py):
# each side's settings from lab/results/fair's largest dense rung at every budget, on fresh seeds,
# 4 runs at a time, into lab/results/fair_bf16/<rung>/ (records/ to commit, report/ the same
# report as the fp32 study's: speedup, 95% interval, p-values). Run again, it trains what is missing.
compare-gpu: $(SETUP)
	$(PY) lab/tools/gpu/reference_bf16.py

test-all: $(SETUP)
	$(PY) -m pytest

clean:
	rm -rf outputs multirun .pytest_cache
