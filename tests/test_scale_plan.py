"""The scale planner: its bytes and Newton-Schulz loads against the real ZeroOptimizer, its
collective times against hand-computed cases, its activation count against autograd's. Its
memory at scale against the FakeTensor estimate: tests/test_memory_estimate.py."""
from __future__ import annotations


import pytest
import torch

from planning.collectives import Link, all_reduce_s, ring_all_gather_s, ring_all_reduce_s, tree_all_reduce_s
from planning.memory_plan import activation_bytes_per_token, planned_memory
from planning.scale_plan import Hardware, design_rows, local_params, predict, tp_sizes
from model.gpt import GPT
from lab.tools.bench.bench_comm import measure
from tests.distributed import run_distributed
from model.presets import preset_config
from tests.prestarted import run_python
from tests.test_model import tiny
from tests.closeness import approx

LINK = Link(bandwidth=100e9, latency=5e-6)


def test_ring_collectives_match_hand_computed_times():
    # 8 ranks gathering 800 MB: 7 steps of 5 us, and 7/8 of 800 MB at 100 GB/s
    assert ring_all_gather_s(800e6, 8, LINK) == approx(7 * 5e-6 + 0.007)
    assert ring_all_reduce_s(800e6, 8, LINK) == approx(2 * (7 * 5e-6 + 0.007))
    assert ring_all_gather_s(800e6, 1, LINK) == 0.0


def test_all_reduce_takes_the_tree_when_latency_dominates():
    # 1,024 ranks, 4 KB: ring 2 x 1023 x 5 us = 10.2 ms; tree 2 x 10 x 5 us + 2 x 4 KB / 100 GB/s
    tree = 2 * 10 * 5e-6 + 2 * 4096 / 100e9
    assert tree_all_reduce_s(4096, 1024, LINK) == approx(tree)
    assert all_reduce_s(4096, 1024, LINK) == approx(tree)
    # 8 ranks, 1 GB: the ring's 2 x 7/8 of the bytes beats the tree's 2 x all of them
    assert all_reduce_s(1e9, 8, LINK) == approx(ring_all_reduce_s(1e9, 8, LINK))
    assert ring_all_reduce_s(1e9, 8, LINK) < tree_all_reduce_s(1e9, 8, LINK)


@pytest.mark.parametrize("dp, tp", [(2, 1), (4, 1), (2, 2)])
def test_planned_bytes_and_newton_schulz_loads_equal_the_real_zero_optimizer(dp, tp):
    cfg = preset_config("gpt_tiny", 97)
    row = design_rows(local_params(cfg, tp), dp, tp)["muon-ours"]
    real = measure(cfg, dp, tp, launch=run_distributed)  # one step of ZeroOptimizer on gloo, bytes counted by parallel/comm.py
    assert real["dp_bytes"] == row.dp_bytes
    assert real["tp_bytes"] == row.tp_bytes
    assert real["plan_costs"] == row.plan_costs
    assert real["state"] == row.state
    # and the same DP traffic as AdamW ZeRO-1, plus nothing
    assert row.dp_bytes == design_rows(local_params(cfg, tp), dp, tp)["adamw-zero1"].dp_bytes


def test_newton_schulz_flops_count_five_quintic_steps_of_every_matrix():
    cfg = preset_config("gpt_tiny", 97)  # d_model 64, 4 heads (2 KV), ffn 192, 2 layers
    rows = design_rows(local_params(cfg, 1), 1, 1)
    per_layer = (5 * (4 * 64**2 * 64 + 2 * 64**3) * 2  # wq, wo: 64 x 64
                 + 5 * (4 * 32**2 * 64 + 2 * 32**3) * 2  # wk, wv: 32 x 64
                 + 5 * (4 * 64**2 * 192 + 2 * 64**3) * 3)  # w_gate, w_up, w_down
    assert rows["muon-ours"].ns_max == rows["megatron-poc"].ns_max == 2 * per_layer


def test_more_owners_than_matrices_leaves_ranks_idle_and_the_largest_matrix_sets_the_pace():
    cfg = preset_config("gpt_tiny", 97)
    params = local_params(cfg, 1)
    n_matrices = sum(p.muon for p in params)
    row = design_rows(params, 64, 1)["muon-ours"]
    assert row.idle_ranks == 64 - n_matrices
    assert row.ns_max == max(p.ns_flops for p in params if p.muon)


def test_each_design_holds_its_own_zero_buffers():
    """The ZeRO buffers a rank holds are its design's flat buffer: ours padded to whole-matrix
    segments, the even splits padded only to a multiple of dp."""
    cfg = preset_config("gpt_tiny", 97)
    params = local_params(cfg, 1)
    total = sum(p.numel for p in params)
    dp = 64  # far more ranks than matrices: our segments pad to the largest matrix
    steps = predict(cfg, Hardware.load("h100_sxm"), dp, 1, tokens_per_step=64 * 256, seq_len=256, micro_batch=1, params=params)

    def buffers(flat_elements: int) -> float:
        return 4 * flat_elements * (1 + 2 / dp)  # the flat fp32 buffer, a segment, a send buffer

    even = -(-total // dp) * dp
    ours = design_rows(params, dp, 1)["muon-ours"].dp_bytes // 8  # two fp32 collectives
    assert ours > even
    for design, flat in (("adamw-zero1", even), ("moonlight", even), ("megatron-poc", even), ("muon-ours", ours)):
        assert steps[design].memory["grads"] == approx(4 * total + buffers(flat)), design


def saved_activation_bytes(model: GPT, batch: int, seq: int) -> int:
    """Bytes of the distinct storages autograd saves in one bf16-autocast forward pass."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    vocab = model.cfg.vocab_size
    idx, targets = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, targets)
    return sum(storages.values())


@pytest.mark.parametrize("overrides", [
    dict(n_kv_heads=4),
    dict(n_kv_heads=2),
    dict(n_experts=4, top_k=2, n_shared_experts=1, expert_hidden=32, n_dense_layers=1),
    dict(n_experts=8, top_k=3, expert_hidden=16, n_layers=3),
], ids=["mha", "gqa", "moe_shared", "moe_top3"])
def test_activation_formula_counts_what_autograd_saves(overrides):
    torch.manual_seed(0)
    model = GPT(tiny(**overrides))
    # The slope over the batch: the per-token bytes, without the weights' bf16 copies.
    per_token = (saved_activation_bytes(model, 6, 32) - saved_activation_bytes(model, 2, 32)) / (4 * 32)
    # The CPU's RMSNorm is not one fused kernel: it also keeps the normalised product.
    assert per_token == activation_bytes_per_token(model.cfg, tp=1, fused_norm=False)


def test_tp_sizes_stay_in_a_node_and_divide_every_split_dimension():
    hw = Hardware.load("h100_sxm")
    assert tp_sizes(preset_config("gpt_8b", 128256), 1024, hw) == [1, 2, 4, 8]
    assert tp_sizes(preset_config("gpt_124m", 50304), 64, hw) == [1, 2, 4]  # 12 heads: not 8
    assert tp_sizes(preset_config("gpt_8b", 128256), 4, hw) == [1, 2, 4]


def test_a_job_inside_one_node_talks_over_nvlink_and_beyond_it_over_infiniband():
    hw = Hardware.load("h100_sxm")
    cfg = preset_config("gpt_124m", 50304)
    one_node = predict(cfg, hw, 8, 1, 2**19, 1024, 1)["adamw-zero1"]
    two_nodes = predict(cfg, hw, 16, 1, 2**19, 1024, 1)["adamw-zero1"]
    flat = one_node.row.dp_bytes / 2
    assert one_node.times["opt_dp_all_gather"] == approx(ring_all_gather_s(flat, 8, hw.nvlink))
    flat16 = two_nodes.row.dp_bytes / 2
    assert two_nodes.times["opt_dp_all_gather"] == approx(ring_all_gather_s(flat16, 16, hw.ib))
    # compute halves with twice the GPUs at the same global batch
    assert two_nodes.times["compute"] == approx(one_node.times["compute"] / 2)


def test_a_missing_hardware_profile_names_the_file_and_the_known_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"h200_nvl.*known: a100_sxm, h100_sxm"):
        Hardware.load("h200_nvl")
    broken = tmp_path / "x.yaml"
    broken.write_text("name: x\nmatmul_tflops: 1\n")
    with pytest.raises(ValueError, match=r"x\.yaml: missing hbm_gb"):
        Hardware.load(str(broken))


def test_the_cli_writes_every_row_and_the_overhead_plot(tmp_path):
    proc = run_python(
        ["scripts/plan/plan_scale.py", "--model", "gpt_124m", "n_layers=4", "--tokens-per-step", "65536",
         "--seq-len", "1024", "--gpus", "8", "64", "--out", str(tmp_path), "--all"],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    plan = (tmp_path / "plan.md").read_text()
    # 8 GPUs: tp 1, 2, 4 (12 heads); 64 GPUs: the same; four designs each
    assert plan.count("| muon-ours |") == 6 and plan.count("| megatron-poc |") == 6
    assert "| 8 | 8 x 1 | muon-ours |" in plan and "| 64 | 16 x 4 | adamw-zero1 |" in plan
    assert (tmp_path / "overhead.png").stat().st_size > 5000
    assert "| 64 | muon-ours |" in proc.stdout  # the fastest layout per design
    assert "| 64 | 16 x 4 | adamw-zero1 |" in proc.stdout  # --all: every row
    bad = run_python(["scripts/plan/plan_scale.py", "dmodel=5", "--out", str(tmp_path)], timeout=120)
    assert bad.returncode != 0 and "dmodel=5" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_fsdp_and_hsdp_designs_use_the_formulas_the_counted_run_checks():
    """The planner's FSDP2 rows are fsdp_dp_bytes + the Muon exchange (bytes), the formulas
    tests/test_fsdp_training.py meets on a counted run, and planned_memory of their layout
    (memory); HSDP shards within a node and all-reduces its gradient shards across nodes."""
    from planning.scale_plan import fsdp_dp_bytes, fsdp_memory, muon_exchange_bytes_per_rank
    from model.config import ModelConfig
    from parallel.mesh import Layout

    cfg = ModelConfig(n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, ffn_hidden=512, vocab_size=1000)
    hw = Hardware.load("h100_sxm")
    dp, tp, seq, micro = 32, 2, 256, 2
    params = local_params(cfg, tp)
    steps = predict(cfg, hw, dp, tp, tokens_per_step=dp * seq * micro * 3, seq_len=seq, micro_batch=micro,
                    checkpointing="full", loss_chunks=2)
    gathers = fsdp_dp_bytes(params, dp, micro_batches=3, param_bytes=2)
    adamw, muon = steps["adamw-fsdp"], steps["muon-fsdp"]
    assert adamw.row.dp_bytes == gathers["all_gather"] + gathers["reduce_scatter"]
    assert muon.row.dp_bytes - adamw.row.dp_bytes == muon.row.extra_dp_bytes == muon_exchange_bytes_per_rank(params, dp)
    planned = planned_memory(cfg, Layout(dp_shard=dp, tp=tp), "muon", micro, seq, "full", 2)
    assert muon.memory["optimizer_state"] == planned["optimizer_state"] == fsdp_memory(params, dp, "muon")["optimizer_state"]
    assert muon.memory["params"] == planned["params"]
    # three micro-batches: FSDP2 holds the unsharded fp32 gradients between them, at the peak too
    accumulated = 4 * sum(p.numel for p in params)
    assert muon.memory["grads"] == planned["grads"] + accumulated
    assert muon.memory_total == planned["total"] + accumulated
    # HSDP: shards of the node's 8 / tp = 4 GPUs, 8 replicas; the all-reduce of the shards' gradients
    hsdp = steps["muon-hsdp"]
    node = fsdp_dp_bytes(params, 4, micro_batches=3, param_bytes=2)
    shard_grads = fsdp_memory(params, 4, "muon")["grads"]
    assert hsdp.row.dp_bytes == (node["all_gather"] + node["reduce_scatter"] + 2 * shard_grads
                                 + muon_exchange_bytes_per_rank(params, 4))
    assert hsdp.memory_total == planned_memory(cfg, Layout(dp_replicate=8, dp_shard=4, tp=tp), "muon", micro, seq,
                                               "full", 2)["total"] + accumulated
    # FSDP2's own collectives overlap compute: only what compute cannot hide is on the clock
    assert set(adamw.times) >= {"compute", "dp_not_overlapped"} and adamw.optimizer_s < muon.optimizer_s


def test_checkpointing_and_loss_chunks_lower_the_planned_peak_by_what_they_drop():
    """gpt_1b on 8 GPUs (FSDP2): full checkpointing keeps one residual-sized input per block
    instead of each block's activations, and N loss chunks divide the loss's vocabulary-sized
    tensors by N; neither changes parameters, gradients or state."""
    from model.presets import preset_config
    from planning.memory_plan import activation_memory, head_bytes_per_token, Dtypes
    from parallel.mesh import Layout

    cfg = preset_config("gpt_1b")
    layout, tokens, bf16 = Layout(dp_shard=8), 4096, Dtypes(2, 2)
    plans = {(mode, n): planned_memory(cfg, layout, "muon", 1, tokens, mode, n)
             for mode in ("none", "full", "selective") for n in (1, 8)}
    full = activation_memory(cfg, 1, tokens, "full", dt=bf16)
    # each block's bf16 input (2h), and the head: its norm (4h + 4), bf16 input (2h), fp32 log-softmax (4V), ids (16)
    h, V = cfg.d_model, cfg.vocab_size
    assert full["kept"] == tokens * (cfg.n_layers * 2 * h + (4 * h + 4) + 2 * h + 4 * V + 16)
    assert head_bytes_per_token(cfg, 1, 1, bf16)[0] == (4 * h + 4) + 2 * h + 4 * V + 16
    for (mode, n), plan in plans.items():
        assert {k: plan[k] for k in ("params", "grads", "optimizer_state")} == \
            {k: plans["none", 1][k] for k in ("params", "grads", "optimizer_state")}
    assert plans["none", 1]["total"] > plans["selective", 1]["total"] > plans["full", 1]["total"]
    # the whole loss's [tokens, V] fp32 gradients (8V a token) shrink eightfold with 8 chunks
    assert plans["full", 1]["total"] - plans["full", 8]["total"] > 0.8 * (7 / 8) * 8 * cfg.vocab_size * tokens


@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_ep_designs_hold_and_move_what_the_real_zero_optimizer_does_under_ep(optim):
    """At dp 4 x ep 2: the planner's DP bytes (the dense ZeRO-1 over DP plus the experts' over
    the 2 ranks that hold the same ones) and the busiest rank's optimizer state equal one
    counted step of ZeroOptimizer with EP on gloo."""
    from planning.scale_plan import predict_ep

    cfg = preset_config("moe_tiny", 97)
    dp, ep = 4, 2
    real = measure(cfg, dp, 1, ep, optim, launch=run_distributed)
    step = predict_ep(cfg, Hardware.load("h100_sxm"), dp, 1, ep, tokens_per_step=dp * 64, seq_len=64,
                      micro_batch=1)[f"{optim}-ep"]
    assert real["dp_bytes"] == step.row.dp_bytes
    assert real["state"] == step.row.state
    # each rank holds half of every expert stack
    experts = [p for p in local_params(cfg, 1, ep) if p.expert]
    assert experts and all(p.shape[0] == cfg.n_experts // ep for p in experts)
