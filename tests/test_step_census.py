"""CPU guards for the GPU hot path (eval/step_census.py): a training step that is not a logging
step never makes the host wait, the optimizer's work does not grow with the number of
parameters, and a whole step stays within reach of the plain reference's operator count.
On a GPU each of these is time: a host sync idles the device, every op is a kernel launch."""
from __future__ import annotations

import pytest
import torch

from eval.step_census import census, count_events
from model.config import ModelConfig
from model.gpt import GPT
from optim.builder import build_optimizer
from optim.config import OptimConfig
from optim.muon.options import MuonOptions
from lab.tools.bench.reference_gpt import ReferenceConfig, ReferenceTrainer
from tests.test_checkpoint import make_trainer

CPU = torch.device("cpu")
# Logging steps (which read metrics back, by design) never come up in these.
QUIET = ["logger.interval=1000", "trainer.batch_size=2"]


def test_census_counts_work_and_value_reads_not_views():
    x, w = torch.randn(8, 8), torch.randn(4, 8)

    def step():
        y = x.view(64).reshape(8, 8).t()  # views: no work
        z = y.contiguous()  # a copy
        h = torch.nn.functional.linear(z, w)  # one op, however it is implemented inside
        s = (h * 2).sum()
        return s.item()  # a value read: one sync (and its transfer)

    result = census(step, CPU, steps=2)
    assert result.op_names == {"aten::contiguous": 2, "aten::linear": 2, "aten::mul": 2, "aten::sum": 2, "aten::item": 2}
    assert result.aten_ops == 5 and result.host_syncs == 1


def test_census_ignores_value_reads_inside_an_op():
    # The CPU grouped matmul reads its offsets inside its own kernel: no host sync of ours.
    x, w = torch.randn(6, 8), torch.randn(2, 8, 4)
    ends = torch.tensor([2, 6], dtype=torch.int32)
    with torch.profiler.profile() as prof, torch.profiler.record_function("ProfilerStep#1"):
        torch._grouped_mm(x, w, offs=ends)
    ops, syncs = count_events(list(prof.events()))
    assert ops == {"aten::_grouped_mm": 1} and syncs == 0


@pytest.mark.parametrize("model", ["gpt_tiny", "moe_tiny"])
@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_non_logging_steps_never_sync_the_host(tmp_path, model, optim):
    trainer = make_trainer(tmp_path, QUIET + [f"model={model}", f"optim={optim}"])
    step = lambda: trainer.train_step(measure=False)  # noqa: E731
    step()  # first-touch: optimizer state
    result = census(step, CPU, steps=2)
    reads = {k: v for k, v in result.op_names.items() if k in ("aten::item", "aten::is_nonzero")}
    assert result.host_syncs == 0, f"host syncs per step: {result.host_syncs} ({reads})"


def test_step_ops_stay_near_the_plain_reference(tmp_path):
    """Same shape, batch and precision, both eager with AdamW. The reference is nothing but the
    model and a fused-AdamW step; ours adds the on-device skip and MoE/metric hooks, which
    must stay small. (Before the for-each gradient norm, fused AdamW and chunked RoPE, ours
    was 1.8x the reference's count.)"""
    trainer = make_trainer(tmp_path, QUIET + ["optim=adamw"])
    m, t = trainer.model_cfg, trainer.cfg.trainer
    shape = ReferenceConfig(vocab_size=m.vocab_size, n_layers=m.n_layers, d_model=m.d_model, n_heads=m.n_heads,
                            n_kv_heads=m.n_kv_heads, ffn_hidden=m.ffn_hidden, max_seq_len=m.max_seq_len)
    reference = ReferenceTrainer(shape, t.batch_size, t.seq_len, "fp32")
    for step in (lambda: trainer.train_step(measure=False), reference.step):
        step()
    ours = census(lambda: trainer.train_step(measure=False), CPU, steps=2).aten_ops
    theirs = census(reference.step, CPU, steps=2).aten_ops
    assert ours <= 1.3 * theirs, f"ours {ours:.0f} ops per step, the reference {theirs:.0f}"


def _optimizer_phase_ops(cfg: ModelConfig, name: str) -> float:
    """Ops of the trainer's optimizer phase (gradient norm and clip, the on-device finite
    flag, the step) for a model of this shape."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = build_optimizer(model, OptimConfig(name=name, muon=MuonOptions(ns_dtype="fp32")), cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 9))
    model(x[:, :-1], x[:, 1:]).backward()

    def phase() -> None:
        norm = opt.prepare_grads(1.0)
        opt.step((~torch.isfinite(norm)).float())

    phase()  # first-touch: optimizer state
    return census(phase, CPU, steps=2).aten_ops


@pytest.mark.parametrize("name", ["muon", "adamw"])
@pytest.mark.parametrize("experts", [0, 4])
def test_optimizer_ops_do_not_grow_with_depth(name, experts):
    """Per-parameter loops in the optimizer show up as ops that grow with the layer count;
    batched Newton-Schulz and for-each updates keep them constant."""
    base = ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16,
                       vocab_size=61, n_experts=experts, top_k=2, n_shared_experts=1, expert_hidden=16,
                       n_dense_layers=1)
    shallow = _optimizer_phase_ops(base, name)
    deep = _optimizer_phase_ops(ModelConfig(**{**base.__dict__, "n_layers": 6}), name)
    assert deep == shallow, f"{shallow:.0f} ops with 2 layers, {deep:.0f} with 6"


def test_bench_train_census_prints_the_counts_per_row():
    """The benchmark behind `make bench-gpu`, at a toy size on CPU: every row of ours and the
    reference carries its op count and zero host syncs, so the GPU command is ready to run."""
    from tests.prestarted import run_python

    out = run_python(
        ["lab/tools/bench/bench_train.py", "--models", "gpt_tiny", "--modes", "eager",
         "--precisions", "fp32", "--optims", "adamw", "muon", "--census", "--rounds", "1", "--warmup", "1",
         "--batch-size", "2", "--seq-len", "32", "--peak-size", "128", "--peak-repeats", "1", "--device", "cpu"],
        timeout=600, check=True,
    ).stdout
    header = next(line for line in out.splitlines() if line.startswith("| model | impl |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| gpt_tiny |") and len(cells) == len(columns):
            row = dict(zip(columns, cells))
            rows[row["impl"], row["optim"]] = row
    assert set(rows) == {("ours", "adamw"), ("ours", "muon"), ("reference", "adamw")}, out
    for row in rows.values():
        assert int(row["aten ops/step"]) > 0 and float(row["host syncs/step"]) == 0.0, row
    assert float(rows["ours", "adamw"]["ours / reference"]) > 0
