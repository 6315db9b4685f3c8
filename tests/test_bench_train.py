"""lab/tools/bench/bench_train.py --tokens-per-step: the accumulation arithmetic, the refusal of a target
that is not a whole number of micro-batches, both arms accumulating alike, and the table's
tokens/step, ratio and Muon / AdamW columns at a toy size (no timing is asserted)."""
from __future__ import annotations


import pytest
import torch

from lab.tools.bench.bench_train import grad_accum_for, parse_args
from lab.tools.bench.reference_gpt import ReferenceConfig, ReferenceTrainer
from tests.prestarted import run_python
from tests.closeness import approx


def test_grad_accum_is_the_target_over_one_micro_batch():
    assert grad_accum_for(524288, 16, 1024) == 32  # 0.5M tokens: 32 x 16 x 1024
    assert grad_accum_for(16384, 16, 1024) == 1
    assert grad_accum_for(4096, 1, 256) == 16


@pytest.mark.parametrize("target", [1000, 256, 768])
def test_a_target_that_is_not_whole_micro_batches_is_refused(target):
    with pytest.raises(ValueError, match=r"^--tokens-per-step \d+ is not a whole number of micro-batches"):
        grad_accum_for(target, 2, 256)


def test_the_command_line_refuses_in_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(["--batch-size", "2", "--seq-len", "256", "--tokens-per-step", "512", "1000"])
    assert exit.value.code == 2  # bad input, as train.py
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "--tokens-per-step 1000" in message and "512 tokens" in message
    with pytest.raises(SystemExit) as exit:
        parse_args(["trainer.grad_accum=4"])
    assert exit.value.code == 2 and "--tokens-per-step" in capsys.readouterr().err


def test_the_command_line_gives_one_accumulation_per_target():
    assert parse_args(["--batch-size", "16", "--seq-len", "1024", "--tokens-per-step", "524288", "16384"]).grad_accums == [1, 32]
    assert parse_args([]).grad_accums == [1]


def test_the_reference_accumulates_its_micro_batches_before_one_optimizer_step():
    ref = ReferenceTrainer(ReferenceConfig(vocab_size=64, n_layers=1, d_model=32, n_heads=2, n_kv_heads=2,
                                           ffn_hidden=64, max_seq_len=16), 2, 8, "fp32", grad_accum=3)
    assert ref.tokens_per_step == 2 * 8 * 3
    before = [p.detach().clone() for p in ref.model.parameters()]
    steps = []
    ref.opt.step = (lambda step=ref.opt.step: steps.append(1) or step())  # count optimizer steps
    loss = ref.step()
    assert ref.n == 3 and len(steps) == 1 and torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, ref.model.parameters()))


def test_the_table_shows_each_target_with_its_ratios():
    """A toy run: every row carries its target tokens/step, ours its ratio to the reference at
    the same target, and the Muon / AdamW table one row per target."""
    out = run_python(
        ["lab/tools/bench/bench_train.py", "--models", "gpt_tiny", "--modes", "eager", "--precisions", "fp32",
         "--optims", "adamw", "muon", "--rounds", "1", "--warmup", "0", "--batch-size", "2", "--seq-len", "16",
         "--tokens-per-step", "32", "128", "--peak-size", "64", "--peak-repeats", "1", "--device", "cpu"],
        timeout=600, check=True,
    ).stdout
    assert "tokens per optimizer step: 32 (1 micro-batch), 128 (4 micro-batches)" in out
    tables, lines = [], out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| model |"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in row.strip("|").split("|")))))
            tables.append(rows)
    main, muon_vs_adamw = tables
    got = {(r["impl"], r["optim"], r["tokens/step"]) for r in main}
    assert got == {(impl, optim, tokens) for tokens in ("32", "128")
                   for impl, optim in (("ours", "adamw"), ("ours", "muon"), ("reference", "adamw"))}, out
    for r in main:
        assert float(r["tokens/s"].replace(",", "")) > 0
        assert (float(r["ours / reference"]) > 0) if r["impl"] == "ours" else r["ours / reference"] == ""
    assert [(r["tokens/step"], r["micro-batches"]) for r in muon_vs_adamw] == [("32", "1"), ("128", "4")]
    # The Newton-Schulz FLOPs are fixed per optimizer step: 4x the tokens, a quarter of the share.
    ns = {float(r["Newton-Schulz GFLOP/step"]) for r in muon_vs_adamw}
    shares = [float(r["NS / model"].rstrip("%")) for r in muon_vs_adamw]
    assert len(ns) == 1 and shares[1] == approx(shares[0] / 4, rel=0.05)


def test_newton_schulz_flops_of_a_gpt_124m_muon_step():
    """48 square 768 x 768 attention matrices and 36 SwiGLU matrices of 768 x 2048, 5 steps of
    X X^T, A A and B X each: 17% of the model FLOPs of a 16 x 1024-token step, 0.5% at 0.5M."""
    from eval.flops import train_flops_per_token
    from model.gpt import GPT
    from optim.muon.options import MuonOptions
    from model.presets import preset_config
    from planning.newton_schulz_cost import newton_schulz_flops

    cfg = preset_config("gpt_124m", vocab_size=8192)
    with torch.device("meta"):
        model = GPT(cfg)
    d, h = 768, 2048
    expected = 2 * 5 * (48 * 3 * d**3 + 36 * (2 * d * d * h + d**3))
    flops = newton_schulz_flops(model, MuonOptions())
    assert flops == expected
    per_token = train_flops_per_token(cfg, 1024)
    assert flops / (per_token * 16384) == approx(0.170, abs=0.001)
    assert flops / (per_token * 524288) == approx(0.0053, abs=0.0001)
    assert newton_schulz_flops(model, MuonOptions(ns_method="gram")) < flops  # Gram on the 36 SwiGLU matrices


def test_newton_schulz_flops_count_what_muon_orthogonalises_under_split_heads_and_auto():
    """The shapes are Muon's own (optim.builder.muon_ns_shapes): under split_heads wq, wk and
    wv are 12 heads of 64 x 768 each, and ns_method=auto looks those head shapes up."""
    from model.gpt import GPT
    from optim.muon.options import MuonOptions
    from optim.muon.ns_method import gram_macs, standard_macs
    from model.presets import preset_config
    from planning.newton_schulz_cost import newton_schulz_flops

    with torch.device("meta"):
        model = GPT(preset_config("gpt_124m", vocab_size=8192))
    d, h, heads = 768, 2048, 12 * 3 * 12  # 12 layers x (wq, wk, wv) x 12 heads
    split = newton_schulz_flops(model, MuonOptions(split_heads=True))
    assert split == 2 * 5 * (heads * (2 * 64 * 64 * d + 64**3) + 12 * 3 * d**3 + 36 * (2 * d * d * h + d**3))
    chosen = {"64x768": "gram", "768x768": "standard", "768x2048": "gram", "2048x768": "standard"}
    auto = newton_schulz_flops(model, MuonOptions(split_heads=True, ns_method="auto", ns_by_shape=chosen))
    assert auto == 2 * (heads * gram_macs(64, d, 5) + 12 * standard_macs(d, d, 5)
                        + 12 * gram_macs(d, h, 5) + 24 * standard_macs(d, h, 5))
    with pytest.raises(ValueError, match="no choice for 64x768 matrices"):
        newton_schulz_flops(model, MuonOptions(split_heads=True, ns_method="auto", ns_by_shape={"768x768": "gram"}))


def test_batch_size_plan_leaves_the_batch_to_the_planner_and_refuses_an_accumulation(capsys):
    args = parse_args(["--batch-size", "plan", "--seq-len", "4096", "--fp8", "none", "tensorwise", "--one-at-a-time"])
    assert args.batch_size == 0 and args.grad_accums == [1] and args.fp8 == ["none", "tensorwise"]
    with pytest.raises(SystemExit) as exit:
        parse_args(["--batch-size", "plan", "--tokens-per-step", "65536"])
    assert exit.value.code == 2 and "--tokens-per-step needs a --batch-size in sequences" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--batch-size", "plam"])


def test_the_planner_picks_gpt_1b_s_micro_batch_for_one_gpu():
    """The largest batch whose planned peak fits the profile's memory for both optimizers (AdamW,
    with its two moments, is the larger): 15 sequences of 4096 on an H200, 8 on an H100."""
    from model.presets import preset_config
    from planning.memory_plan import planned_memory
    from planning.scale_plan import Hardware
    from parallel.mesh import Layout
    from lab.tools.bench.bench_common import hardware_for_device, planned_batch

    cfg = preset_config("gpt_1b", 8192)  # the embedded corpus's vocabulary, what bench_train trains on
    assert hardware_for_device("NVIDIA H200") == "h200_sxm" and hardware_for_device("NVIDIA H100 80GB HBM3") == "h100_sxm"
    for device, expected in (("NVIDIA H200", 15), ("NVIDIA H100 80GB HBM3", 8)):
        memory = Hardware.load(hardware_for_device(device)).hbm_gb * 1e9
        batch, peaks = planned_batch(cfg, ["adamw", "muon"], 4096, memory)
        assert batch == expected and max(peaks.values()) == peaks["adamw"] <= memory
        assert planned_memory(cfg, Layout(), "adamw", batch + 1, 4096)["total"] > memory
    assert planned_batch(cfg, ["adamw"], 4096, 1e9)[0] == 0  # not one sequence fits
    with pytest.raises(ValueError, match="no conf/hardware profile"):
        hardware_for_device("cpu")
