"""optim.lr_overrides: a learning-rate multiplier per parameter family multiplies exactly the
families it names, under one process, DP=2 (ZeRO-1), TP=2 and FSDP2, and survives a resume."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from optim.routing import kind_of
from tests.conftest import compose
from tests.distributed import run_distributed
from tests.test_checkpoint import make_trainer
from tests.closeness import assert_close
from trainer.config import to_dataclass

COMMON = [
    "model=gpt_tiny", "trainer.precision=fp32", "trainer.device=cpu", "trainer.max_steps=4", "trainer.seq_len=32",
    "trainer.batch_size=2", "logger.interval=1", "eval.interval=0", "eval.batches=1", "eval.batch_size=2",
    "logger.wandb.mode=disabled", "logger.tensorboard=false", "logger.progress=none", "optim.warmup_steps=0",
    "optim.muon.ns_dtype=fp32", "checkpoint.interval=0", "optim.grad_clip=0",
]
# The AdamW side slower, one Muon family faster, and one family left alone (every other).
SCALES = {"embed": 0.1, "head": 0.1, "norm": 0.3, "attn_o": 2.0}
OVERRIDES = [f"+optim.lr_overrides.{kind}={scale}" for kind, scale in SCALES.items()]


def _one_step_deltas(rank: int, world: int, layout: list[str], optim: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each parameter's change over one optimizer step, as a single process holds it, without
    and with the overrides, from the same weights and batch."""
    from parallel.mesh import Mesh, build_mesh
    from trainer.loop import Trainer

    out = {}
    for name, extra in (("plain", []), ("overridden", OVERRIDES)):
        cfg = to_dataclass(compose(COMMON + layout + [f"optim={optim}"] + extra))
        mesh = build_mesh(cfg.parallel.tp, dp_shard=cfg.parallel.dp_shard) if world > 1 else Mesh()
        trainer = Trainer(cfg, Path(tempfile.mkdtemp(prefix="lr_overrides_")), mesh)
        before = _full_params(trainer)
        trainer.train_step(measure=False)
        after = _full_params(trainer)
        out[name] = {k: after[k] - before[k] for k in before}
    return out


def _full_params(trainer) -> dict[str, torch.Tensor]:
    """Every parameter whole: FSDP2's DTensors gathered, TP's shards joined."""
    from trainer.checkpoint.state import logical_state

    if trainer.sharded:
        return {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}
    return logical_state(trainer)["params"]


def check_scaled(deltas: dict[str, dict[str, torch.Tensor]]) -> None:
    plain, overridden = deltas["plain"], deltas["overridden"]
    assert set(plain) == set(overridden)
    kinds = set()
    for name, delta in plain.items():
        kind = kind_of(name)
        kinds.add(kind)
        assert delta.abs().max() > 0, name  # the step moved it: a zero would pass any scale
        # atol: the weights are stored in fp32, so each delta carries the rounding of p + delta,
        # up to an ulp of p (1.2e-7 for the norms' gammas at 1.0): two ulps. The deltas
        # themselves are 1e-4 and more, so a wrong scale misses by orders of magnitude.
        assert_close(overridden[name], SCALES.get(kind, 1.0) * delta, rtol=1e-5, atol=2.5e-7,
                                   msg=lambda m: f"{name} ({kind}): {m}")
    assert set(SCALES) <= kinds and kinds - set(SCALES)  # named families and unnamed ones both seen


@pytest.mark.parametrize("optim", ["muon", "adamw"])
def test_the_overrides_multiply_exactly_the_families_they_name(optim):
    check_scaled(_one_step_deltas(0, 1, [], optim))


# The same global batch of 2 sequences as the single process: one per DP rank under DP=2.
@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.tp=1", "trainer.batch_size=1"], id="dp2_zero1", marks=pytest.mark.slow),
    pytest.param(["parallel.tp=2"], id="tp2"),
    pytest.param(["parallel.dp_shard=2", "trainer.batch_size=1"], id="fsdp2", marks=pytest.mark.slow)])
def test_the_overrides_multiply_the_same_families_under_dp_and_tp(layout):
    deltas = run_distributed(_one_step_deltas, 2, layout, "muon")
    check_scaled(deltas[0])
    single = _one_step_deltas(0, 1, [], "muon")
    # And the layout changes nothing beyond summation order: TP and DP reduce the gradients in
    # other orders, which moves a few of AdamW's embedding updates (tiny sqrt(v)) by ~5e-7,
    # against updates of 1e-4 and more.
    for name, delta in single["overridden"].items():
        assert_close(deltas[0]["overridden"][name], delta, rtol=1e-4, atol=1e-6)


def test_an_unknown_family_is_refused_in_one_line():
    from trainer.config import ConfigError, validate

    with pytest.raises(ConfigError, match=r"^optim\.lr_overrides\.embd: unknown parameter family \(expected one "
                                          r"of attn_k, attn_o, .*embed, .*norm, router\)$"):
        validate(to_dataclass(compose(COMMON + ["+optim.lr_overrides.embd=0.1"])))


def test_a_resume_keeps_the_overrides(tmp_path):
    """Interrupted at step 4 and resumed, the run equals an uninterrupted one bit for bit."""
    overrides = ["trainer.batch_size=2", *OVERRIDES]
    make_trainer(tmp_path / "straight", overrides).train()
    first = make_trainer(tmp_path / "resumed", overrides)
    for _ in range(4):
        first.train_step(measure=False)
    first.save_checkpoint()
    second = make_trainer(tmp_path / "resumed", overrides)
    assert second.step == 4
    assert {kind: g["lr_scale"] for g in second.optimizer.param_groups for kind in g["kind"].split("+")}["embed"] == 0.1
    second.train()
    saved = json.loads((tmp_path / "resumed" / "checkpoints" / "step_00000008" / "trainer.json").read_text())
    assert saved["config"]["optim"]["lr_overrides"] == SCALES

    def losses(run: Path) -> dict[int, float]:
        return {r["step"]: r["train/loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}

    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [5, 6, 7, 8] and all(resumed[s] == straight[s] for s in resumed)
