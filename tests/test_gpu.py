"""The CUDA paths: bf16 training eager and compiled, kill -9 and resume, torchrun on NCCL,
and the HF export of a checkpoint trained on the GPU.

`make test-gpu` runs these (and every other `gpu`-marked test, e.g. Newton-Schulz in bf16 on
CUDA in tests/test_newton_schulz.py). Without CUDA each is skipped, with the reason in the
summary; the two-process NCCL tests also need two GPUs.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, compose
from tests.matmul_precision import true_fp32_matmuls  # noqa: F401 (a fixture, requested by name)
from tests.test_faults import final_losses, launch, wait_for_step
from tests.test_parallel_training import assert_tracks, read_metrics
from tests.closeness import approx, assert_close, check
from trainer.config import to_dataclass

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="needs CUDA: torch sees no GPU"),
]
two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs for NCCL between processes, {GPUS} visible")

QUIET = ["logger.wandb.mode=disabled", "logger.tensorboard=false", "logger.progress=none"]


def train_in_process(run_dir: Path, overrides: list[str]):
    from trainer.loop import Trainer

    trainer = Trainer(to_dataclass(compose(QUIET + overrides)), run_dir)
    try:
        trainer.train()
    finally:
        torch._dynamo.reset()  # the next test compiles its own model
    return trainer, [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]


def test_auto_precision_is_bf16_on_a_gpu_with_bf16_tensor_cores():
    from optim.fast_dtype import fast_precision

    major, _ = torch.cuda.get_device_capability()
    choice = fast_precision(torch.device("cuda", 0))
    assert choice.precision == ("bf16" if major >= 8 else "fp32"), choice
    assert "compute capability" in choice.reason


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("model", ["gpt_tiny", "moe_tiny"])
def test_bf16_training_on_cuda_has_finite_falling_losses(tmp_path, model, compiled):
    trainer, losses = train_in_process(tmp_path, [
        f"model={model}", "optim=muon", "trainer.device=cuda", "trainer.precision=bf16",
        "optim.muon.ns_dtype=bf16", f"trainer.compile={compiled}", "trainer.max_steps=30",
        "trainer.batch_size=16", "trainer.seq_len=128", "logger.interval=1", "eval.interval=0",
        "eval.batches=2", "checkpoint.interval=0", "optim.warmup_steps=5",
    ])
    assert trainer.device.type == "cuda"
    # bf16 autocast over fp32 master weights: a projection's output is bf16, its weight fp32.
    wq = trainer.model.blocks[0].attn.wq
    with trainer.autocast():
        out = wq(torch.randn(2, trainer.model_cfg.d_model, device="cuda"))
    assert out.dtype == torch.bfloat16 and wq.weight.dtype == torch.float32
    assert all(p.is_cuda for p in trainer.model.parameters())
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses), losses
    # From ln(vocab) = 9.0: 30 steps of 2048 tokens take gpt_tiny below 7.5.
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses


# Deterministic kernels: without them flash attention's backward (atomics) makes every run
# differ in the last bits, and "bit-identical" would compare two different runs.
ON_CUDA = ["trainer.device=cuda", "trainer.precision=bf16", "optim.muon.ns_dtype=bf16", "trainer.deterministic=true"]


@pytest.mark.parametrize("model", ["gpt_tiny", "moe_tiny"])
def test_deterministic_kernels_rerun_to_bit_identical_losses_on_cuda(tmp_path, model):
    """Every op of both models' CUDA training step has a deterministic kernel (an op without
    one raises here), and with them two runs of the same config agree to the last bit."""
    args = [f"model={model}", *ON_CUDA, "trainer.max_steps=6", "trainer.batch_size=4", "trainer.seq_len=64",
            "logger.interval=1", "eval.interval=0", "eval.batches=1", "checkpoint.interval=0"]
    try:
        _, first = train_in_process(tmp_path / "first", args)
        _, second = train_in_process(tmp_path / "second", args)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(first) == 6 and all(math.isfinite(x) for x in first)
    assert first == second


def test_kill_9_and_resume_on_cuda_gives_bit_identical_losses(tmp_path):
    straight = launch(tmp_path / "straight", *ON_CUDA)
    assert straight.wait(timeout=600) == 0, straight.stderr.read()[-3000:]
    run_dir = tmp_path / "killed"
    proc = launch(run_dir, *ON_CUDA)
    wait_for_step(run_dir, proc, 8)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    resumed = launch(run_dir, *ON_CUDA)  # checkpoint.resume=auto
    assert resumed.wait(timeout=600) == 0, resumed.stderr.read()[-3000:]
    expected = final_losses(tmp_path / "straight")
    assert len(expected) == 16
    assert final_losses(run_dir) == expected


# fp32 on the GPU without TF32 (the trainer enables it; this driver variable overrides it), so
# a parallel run differs from the single-process one only by reduction order, as on CPU.
TRACK = QUIET + [
    "model=gpt_tiny", "optim=muon", "optim.muon.ns_dtype=fp32", "trainer.precision=fp32",
    "trainer.device=cuda", "trainer.max_steps=10", "trainer.seq_len=64", "logger.interval=1",
    "eval.interval=0", "eval.batches=2", "optim.warmup_steps=3", "checkpoint.interval=0",
]
# The CPU tests hold parallel runs to 1e-5; GPU reductions (atomics in some backward kernels,
# other blockings per shape) add a little.
GPU_TOL = 1e-4


def run_train(run_dir: Path, args: list[str], nproc: int = 0) -> list[float]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    proc = subprocess.run(
        [sys.executable, *launcher, "train.py", f"hydra.run.dir={run_dir}", *args],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "NVIDIA_TF32_OVERRIDE": "0", "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r]


def test_torchrun_at_world_size_1_on_cuda_matches_the_python_launch(tmp_path):
    """What a one-GPU user runs. At world size 1 no process group is created (nothing to
    reduce), so this checks the torchrun launch on CUDA; NCCL itself is the 2-GPU tests'."""
    single = run_train(tmp_path / "python", TRACK + ["trainer.batch_size=4"])
    launched = run_train(tmp_path / "torchrun", TRACK + ["trainer.batch_size=4"], nproc=1)
    assert_tracks(launched, single, 1e-6)


@two_gpus
@pytest.mark.parametrize("layout, overrides", [
    ("dp2", ["parallel.tp=1", "trainer.batch_size=2"]),  # ZeRO-1: reduce-scatter + all-gather
    ("tp2", ["parallel.tp=2", "trainer.batch_size=4"]),  # TP collectives in forward/backward
], ids=["dp2", "tp2"])
def test_two_ranks_on_nccl_track_the_single_process_run(tmp_path, layout, overrides):
    single = run_train(tmp_path / "single", TRACK + ["trainer.batch_size=4"])
    parallel = run_train(tmp_path / layout, TRACK + ["parallel.backend=nccl", *overrides], nproc=2)
    assert_tracks(parallel, single, GPU_TOL)
    last = read_metrics(tmp_path / layout)[-1]
    group = "dp" if layout == "dp2" else "tp"
    assert any(k.startswith(f"comm/{group}/") and k.endswith("_bytes") and v > 0 for k, v in last.items())


def test_torchrun_asking_for_more_ranks_than_gpus_stops_with_one_line(tmp_path):
    nproc = GPUS + 1
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
         "train.py", f"hydra.run.dir={tmp_path}", *QUIET],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"{nproc} processes on this node" in errors[0] and f"{GPUS} visible GPU" in errors[0]
    assert "trainer.device=cpu" in errors[0]
    assert not (tmp_path / "checkpoints").exists()


def test_hf_export_of_a_checkpoint_trained_on_cuda_computes_our_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from model.gpt import GPT
    from scripts import export_hf

    run_dir = tmp_path / "run"
    train_in_process(run_dir, [
        "model=gpt_tiny", "optim=muon", "trainer.device=cuda", "trainer.precision=bf16",
        "trainer.max_steps=4", "trainer.batch_size=4", "trainer.seq_len=64", "eval.interval=0",
        "eval.batches=1", "logger.interval=1", "checkpoint.interval=0",
    ])
    cfg, tensors, config = export_hf.load_run(run_dir)
    # Saved from the GPU, loaded on the CPU: full fp32 master weights.
    assert all(t.device.type == "cpu" for t in tensors.values())
    assert all(t.dtype == torch.float32 for t in tensors.values() if t.is_floating_point())
    assert export_hf.main([str(run_dir), str(tmp_path / "hf")]) == 0

    ours = GPT(cfg).eval()
    ours.load_state_dict(tensors)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(idx) - hf(idx).logits).abs().max().item()
    check("difference", diff, 1e-4)
    # The trained weights, not the initial ones: the export differs from the seed's model.
    torch.manual_seed(config["seed"])
    fresh = GPT(cfg).eval()
    with torch.no_grad():
        assert (fresh(idx) - hf(idx).logits).abs().max().item() > 1e-2


@pytest.mark.parametrize("model", ["gpt_tiny", "moe_tiny"])
@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_compiled_non_logging_steps_never_make_the_host_wait(tmp_path, model, optim):
    """No cudaStreamSynchronize / cudaEventSynchronize / blocking cudaMemcpy inside a step
    that does not log: the host keeps queueing work while the GPU runs (the non-finite check
    is decided on the device, batches come from pinned memory)."""
    from eval.step_census import census
    from tests.test_checkpoint import make_trainer

    trainer = make_trainer(tmp_path, [
        f"model={model}", f"optim={optim}", "trainer.device=cuda", "trainer.precision=bf16",
        "optim.muon.ns_dtype=bf16", "trainer.compile=true", "trainer.batch_size=8", "logger.interval=1000",
    ])
    try:
        step = lambda: trainer.train_step(measure=False)  # noqa: E731
        for _ in range(3):  # compilation, optimizer state
            step()
        result = census(step, trainer.device, steps=3)
    finally:
        torch._dynamo.reset()
    # MoE without torch._grouped_mm (bf16 on compute capability 9.0+) loops over experts and
    # reads their boundaries to the host: one sync per MoE layer, none anywhere else.
    from model.moe import moe_layers

    grouped = torch.cuda.get_device_capability() >= (9, 0) and hasattr(torch, "_grouped_mm")
    expected = 0 if grouped else len(moe_layers(trainer.model))
    assert result.host_syncs == expected, result
    assert result.kernels and result.kernels > 0


def test_muon_compiled_updates_on_cuda_equal_the_eager_ones(true_fp32_matmuls):
    """In true fp32: TF32 rounds Newton-Schulz's matmul inputs to 10 mantissa bits, so a
    last-bit difference between the fused and the eager momentum can flip that rounding and
    grow through the iterations (80% of elements off by up to 6.4e-5 on an H200)."""
    from optim.muon.optimizer import Muon
    from tests.test_muon import _step_with

    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(768, 768), (2048, 768), (768, 2048), (8, 512, 1024)]
    fused = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02) for s in shapes]
    eager = [torch.nn.Parameter(p.detach().clone()) for p in fused]
    # fp32 Newton-Schulz: in bf16 a last-bit difference in the momentum could flip a rounding.
    kw = dict(lr=0.02, weight_decay=0.1, ns_dtype="fp32")
    opt_fused, opt_eager = Muon(fused, compile_updates=True, **kw), Muon(eager, **kw)
    try:
        for found_inf in (None, torch.ones((), device="cuda"), torch.zeros((), device="cuda")):
            grads = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
            if found_inf is not None and found_inf.item():
                grads[0][0, 0] = float("nan")
            for opt, params in ((opt_fused, fused), (opt_eager, eager)):
                _step_with(opt, params, grads, found_inf)
            for a, b in zip(fused, eager):
                assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_attention_head_max_equals_the_explicit_logits_on_cuda(dtype, true_fp32_matmuls):
    """QK-clip's CUDA path: FlexAttention's in-kernel row maxima, output and gradients against
    the explicit-logit attention that the CPU path (and CI) runs.

    No fixed tolerance: in bf16 both paths round to 8 mantissa bits at several places, and 3 of
    a gradient's 131,072 elements once came out up to 0.0598 from the explicit path's where 0.05
    was allowed, draws from the error's tail rather than a bug. Instead both are measured against
    float64 attention from the same inputs, and FlexAttention must be about as close to it as
    the explicit path is (tests/test_attention_accuracy.py: the bounds, and why). In fp32 with
    TF32 off the same check holds both to fp32's own rounding, which TF32 would miss by far.
    """
    from model.attention_logits import explicit_attention_with_head_max, flex_attention_with_head_max
    from tests.test_attention_accuracy import assert_no_less_accurate, attention_fp64

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 128, 64, device="cuda", dtype=dtype, requires_grad=True) for h in (8, 2, 2))
    with torch.no_grad():
        q.mul_(3.0)  # logits of order 10, as where the clip matters
    out, head_max = flex_attention_with_head_max(q, k, v)
    ref, ref_max = explicit_attention_with_head_max(q, k, v)
    truth, true_max, leaves = attention_fp64(q, k, v)
    assert head_max.shape == (8,) and out.dtype == dtype
    assert_no_less_accurate("head max", head_max, ref_max, true_max)
    assert_no_less_accurate("output", out, ref, truth)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    true_grads = torch.autograd.grad(truth.square().sum(), leaves)
    for name, g, r, t in zip(("dq", "dk", "dv"), grads, ref_grads, true_grads):
        assert_no_less_accurate(name, g, r, t)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_qk_clip_training_on_cuda_clips_and_keeps_its_logits_at_tau(tmp_path, compiled):
    _, train_losses = train_in_process(tmp_path, [
        "model=gpt_tiny", "optim=muon", "trainer.device=cuda", "trainer.precision=bf16",
        f"trainer.compile={str(compiled).lower()}", "checkpoint.interval=0",
        "trainer.max_steps=20", "trainer.batch_size=4", "trainer.seq_len=128", "logger.interval=1",
        "eval.interval=0", "optim.qk_clip.enabled=true", "optim.qk_clip.tau=1", "model.init_std=0.3",
    ])
    records = [r for r in read_metrics(tmp_path) if "optim/qk_clip/heads_clipped" in r]
    assert len(records) == 20 and all(math.isfinite(x) for x in train_losses)
    assert records[0]["optim/qk_clip/heads_clipped"] == 8  # every head of gpt_tiny at step 1
    for r in records:
        assert r["optim/qk_clip/max_logit_after"] == approx(min(r["optim/qk_clip/max_logit"], 1.0), rel=1e-4)
