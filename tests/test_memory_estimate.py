"""The memory plan (planning/memory_plan.py) against the FakeTensor estimate (trainer/simulation/memory_estimate.py):
the real model and optimizer of one rank of gpt_1b, gpt_8b and moe_16b layouts, measured without
memory, against the planner's formulas; and the estimate itself against a real gpt_tiny's tensors.

Every estimate of the module runs in one subprocess (fake process groups are global state),
started when the session's collection ends, so that it runs beside the tests before these."""
from __future__ import annotations

import json

import pytest
import torch

from model.presets import preset_config
from planning.memory_plan import Dtypes, activation_memory, planned_memory
from parallel.mesh import Layout
from tests.distributed import run_distributed
from tests.prestarted import Started, start_python
from tests.closeness import approx

# 1 x 4096 tokens a rank (one sequence of the presets' 4k context, the micro-batch a long-context
# run keeps on a GPU), bf16, Muon; each layout with checkpointing none and full.
SCALE = [dict(model="gpt_1b", dp_shard=8), dict(model="gpt_8b", dp_shard=8, tp=8),
         dict(model="moe_16b", dp_shard=8, ep=8)]
SCALE_ROWS = [dict(row, batch_size=1, seq_len=4096, activation_checkpointing=mode)
              for row in SCALE for mode in ("none", "full")]
# The checkpointing modes and the chunked loss on tiny FSDP2 models (whose ranks keep no bf16
# weight copies, so the forward's activations are the formula's alone).
TINY = dict(vocab_size=128, seq_len=256, dp_shard=2)
FORMULA_ROWS = [dict(TINY, model="gpt_tiny", tp=2, activation_checkpointing="selective"),
                dict(TINY, model="moe_tiny", activation_checkpointing="full"),
                dict(TINY, model="moe_tiny", activation_checkpointing="selective"),
                dict(TINY, model="gpt_tiny", vocab_size=4096, loss_chunks=4)]
# gpt_tiny as the real two-rank run below builds it, and in one process.
REAL = dict(model="gpt_tiny", vocab_size=128, batch_size=2, seq_len=64)
REAL_ROWS = [dict(REAL, dp_shard=2), dict(REAL, dp_shard=1)]

PROGRAM = """
import json, sys
from trainer.simulation.memory_estimate import EstimateSpec, estimate_memory
print(json.dumps([estimate_memory(EstimateSpec(**spec)).to_dict() for spec in json.loads(sys.argv[1])]))
"""


_started: Started | None = None


def start_beside_the_suite() -> None:
    """Every row's estimate, in the order of SCALE_ROWS + FORMULA_ROWS + REAL_ROWS, in one
    process (forked from one that has imported torch), started as the session's collection
    ends (tests/conftest.py): a minute of CPU that runs beside the tests before this module's,
    which leave part of the two cores idle, instead of holding up this module."""
    global _started
    if _started is None:
        _started = start_python(["-c", PROGRAM, json.dumps(SCALE_ROWS + FORMULA_ROWS + REAL_ROWS)])


@pytest.fixture(scope="module", autouse=True)
def estimates():
    start_beside_the_suite()  # already started, unless this module was collected some other way
    proc = _started
    box: list[list[dict]] = []

    def result() -> list[dict]:
        if not box:
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0, err[-4000:]
            box.append(json.loads(out.strip().splitlines()[-1]))
        return box[0]

    yield result
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def _real_step_worker(rank: int, world: int, spec: dict) -> list[dict[str, int]]:
    """One real training step of gpt_tiny as trainer/simulation/memory_estimate.py configures it, on the
    two-rank FSDP2 layout and (rank 0) in one process: the bytes of the rank's parameters,
    gradients after the backward, and optimizer state after the step, tensor by tensor."""
    from trainer.simulation.memory_estimate import EstimateSpec, train_config
    from optim.builder import build_optimizer
    from parallel.fsdp import local_rows
    from parallel.mesh import Mesh, build_mesh, release_subgroups
    from trainer import device as dev
    from trainer.build import build_model

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    torch.manual_seed(rank)
    out = []
    for mesh in ([build_mesh(1, dp_shard=2)] + ([Mesh()] if rank == 0 else [])):
        cfg = train_config(EstimateSpec(**spec, dp_shard=mesh.layout.dp_shard))
        model = build_model(cfg, cfg.model.vocab_size, mesh, torch.device("cpu"))
        optimizer = build_optimizer(model, cfg.optim, cfg.model, mesh)
        tokens = torch.randint(0, cfg.model.vocab_size, (spec["batch_size"], spec["seq_len"]))
        with dev.autocast(torch.device("cpu"), "bf16"):
            loss = model(tokens, tokens)
        loss.backward()
        row = {"params": nbytes(local_rows(p)[0] for p in model.parameters()),
               "grads": nbytes(local_rows(p.grad)[0] for p in model.parameters())}
        optimizer.prepare_grads(cfg.optim.grad_clip)
        optimizer.step()
        row["optimizer_state"] = nbytes(t for opt in optimizer.optimizers.values() for state in opt.state.values()
                                        for t in state.values() if torch.is_tensor(t))
        out.append(row)
        if mesh.world_size > 1:
            release_subgroups(mesh)
    return out


def test_the_estimate_counts_the_tensors_of_a_real_step(estimates):
    """The FakeTensor estimate of gpt_tiny's parameters, gradients and optimizer state equals,
    byte for byte, what a real step holds: rank 0 of FSDP2 over two ranks (both ranks hold the
    same bytes, as the real run shows), and one process."""
    real = run_distributed(_real_step_worker, 2, REAL)
    assert real[0][0] == real[1][0]
    fake = estimates()[len(SCALE_ROWS) + len(FORMULA_ROWS):]
    for got, want in zip(fake, [real[0][0], real[0][1]], strict=True):
        assert {k: got[k] for k in want} == want, got["spec"]
        assert want["params"] > 0 and want["grads"] > 0 and want["optimizer_state"] > 0
    # the state is there through the forward and backward of a steady step
    assert fake[0]["phase_peaks"]["forward_backward"]["OptState"] == real[0][0]["optimizer_state"]
    # FSDP2 halves the parameters (gpt_tiny's rows all divide by two)
    assert 2 * fake[0]["params"] == fake[1]["params"]


def test_the_activation_formula_matches_the_estimate_under_checkpointing_and_chunked_loss(estimates):
    """What the forward keeps (activation_memory's "kept") against the activations the estimate
    finds alive when the forward returns, on tiny FSDP2 models: selective (dense with TP, MoE),
    full (MoE: its routing decisions), and the loss in four chunks."""
    rows = estimates()[len(SCALE_ROWS):len(SCALE_ROWS) + len(FORMULA_ROWS)]
    for spec, got in zip(FORMULA_ROWS, rows, strict=True):
        cfg = preset_config(spec["model"], spec["vocab_size"])
        kept = activation_memory(cfg, spec.get("tp", 1), spec["seq_len"], spec.get("activation_checkpointing", "none"),
                                 spec.get("loss_chunks", 1), Dtypes.of("bf16", fsdp=True))["kept"]
        # what the chunked loss keeps, it makes inside its own backward: the tracker calls that "Temp"
        alive = got["after_forward"].get("Activation", 0) + got["after_forward"].get("Temp", 0)
        assert alive == approx(kept, rel=0.01), spec


def test_the_planned_memory_is_within_ten_percent_of_the_estimate_at_scale(estimates):
    """gpt_1b at dp_shard 8, gpt_8b at dp_shard 8 x tp 8, moe_16b at ep 8 x dp_shard 8, one
    4096-token sequence a rank, checkpointing none and full: the planner's peak, and each of
    its parts, within 10% of the estimate's (parameters, gradients and state within 1%)."""
    for spec, got in zip(SCALE_ROWS, estimates()[:len(SCALE_ROWS)], strict=True):
        layout = Layout(dp_shard=spec["dp_shard"], tp=spec.get("tp", 1), ep=spec.get("ep", 1))
        plan = planned_memory(preset_config(spec["model"]), layout, "muon", spec["batch_size"], spec["seq_len"],
                              spec["activation_checkpointing"])
        assert plan["total"] == approx(got["peak"], rel=0.10), spec
        for part in ("params", "grads", "optimizer_state"):
            assert plan[part] == approx(got[part], rel=0.01), (spec, part)
        for part in ("activations", "gathered"):
            assert plan[part] == approx(got[part], rel=0.10), (spec, part)
