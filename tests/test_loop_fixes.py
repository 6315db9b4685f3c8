"""Training-loop fixes: a skipped step leaves no statistics behind, the preemption flag
travels on the training device, and token / skipped-step counts survive a resume."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from model.moe import moe_layers
from tests.test_checkpoint import make_trainer
from tests.test_faults import poison_step
from tests.closeness import approx
from trainer.checkpoint import state as checkpoint_state
from trainer.run import preemption
from trainer.run.preemption import PreemptionFlag
from parallel.mesh import Mesh

# Smaller than tests/test_checkpoint.py's runs: these tests need a few steps, not a model.
SMALL = ["trainer.seq_len=32", "eval.batches=1", "eval.batch_size=2"]


def test_skipped_step_discards_routing_counts_and_output_sums(tmp_path):
    trainer = make_trainer(tmp_path, SMALL + ["model=moe_tiny", "trainer.batch_size=2", "trainer.nonfinite=skip"])
    layers = moe_layers(trainer.model)
    assert layers
    poison_step(trainer, 2)
    trainer.train_step(measure=False)
    bias = [layer.expert_bias.clone() for _, layer in layers]
    stats = trainer.train_step(measure=True)  # NaN: skipped, after routing and output tracking
    assert stats["train/skipped_steps"] == 1.0
    for (_, layer), before in zip(layers, bias):
        assert torch.equal(layer.expert_bias, before)  # no bias update from a dropped step
        assert not layer.load.any() and not layer.entropy_sum.any()
    assert not trainer.model.output_sq_sum.any()

    # The next step's statistics are its own: its load counts exactly its routed slots.
    t = trainer.cfg.trainer
    slots = t.batch_size * t.seq_len * trainer.model_cfg.top_k
    seen = {}
    original = layers[0][1].update_bias
    layers[0][1].update_bias = lambda load, rate: (seen.setdefault("load", load.clone()), original(load, rate))
    stats = trainer.train_step(measure=True)
    assert seen["load"].sum().item() == slots
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in stats.values())


class _Seen(Exception):
    pass


def test_preemption_flag_is_reduced_on_the_training_device(monkeypatch):
    # NCCL reduces only tensors on the process group's device; stand in for it with a
    # collective that records the device. "meta" is a device no CPU default would match.
    seen = {}

    def all_reduce(tensor, group, op=None, label=None):
        seen.update(device=tensor.device, group=group, label=label)
        raise _Seen

    # Through the counted collectives, over the default group.
    world = object()
    monkeypatch.setattr(preemption, "all_reduce", all_reduce)
    monkeypatch.setattr(preemption, "world", lambda: world)
    flag = PreemptionFlag(torch.device("meta"))
    try:
        with pytest.raises(_Seen):
            flag.raised(Mesh(rank=0, world_size=2))
    finally:
        flag.restore()
    assert seen == {"device": torch.device("meta"), "group": world, "label": "preemption"}


def test_preemption_flag_goes_over_the_host_group_where_there_is_one(monkeypatch):
    # With NCCL as the default backend the mesh holds a gloo group over all ranks: the flag
    # is a CPU tensor reduced there, so reading it never waits for the GPU's queue.
    seen = {}

    def all_reduce(tensor, group, op=None, label=None):
        seen.update(device=tensor.device, group=group, label=label)
        raise _Seen

    monkeypatch.setattr(preemption, "all_reduce", all_reduce)
    host_group = object()
    flag = PreemptionFlag(torch.device("meta"))
    try:
        with pytest.raises(_Seen):
            flag.raised(Mesh(rank=0, world_size=2, host_group=host_group))
    finally:
        flag.restore()
    assert seen == {"device": torch.device("cpu"), "group": host_group, "label": "preemption"}


def logged_tokens(run_dir: Path) -> dict[int, int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["tokens"] for r in records}


def test_tokens_and_skipped_steps_survive_a_resume_with_a_new_batch(tmp_path):
    first = make_trainer(tmp_path, SMALL + ["trainer.batch_size=2", "trainer.max_steps=2"])
    first.train()
    first.skipped_steps = 1  # as if one of those steps had been dropped
    first.save_checkpoint()
    resumed = make_trainer(tmp_path, SMALL + ["trainer.batch_size=4", "trainer.max_steps=3"])
    assert resumed.step == 2 and resumed.skipped_steps == 1
    resumed.train()
    seq = resumed.cfg.trainer.seq_len
    assert logged_tokens(tmp_path)[3] == 2 * (2 * seq) + 1 * (4 * seq)


def test_checkpoints_without_the_counts_still_load(tmp_path):
    trainer = make_trainer(tmp_path, SMALL + ["trainer.batch_size=2"])
    trainer.train_step(measure=False)
    state = checkpoint_state.logical_state(trainer)
    del state["tokens"], state["skipped_steps"]  # a checkpoint from before they were saved
    trainer.tokens, trainer.skipped_steps = -1, -1
    checkpoint_state.restore(trainer, state)
    assert trainer.tokens == trainer.tokens_per_step and trainer.skipped_steps == 0


@pytest.mark.parametrize("model", ["gpt_tiny", "moe_tiny"])
def test_deterministic_kernels_train_every_model(tmp_path, model):
    """trainer.deterministic raises on any op without a deterministic kernel: none may be in
    the models' training step (the CUDA kernels are checked by tests/test_gpu.py)."""
    try:
        trainer = make_trainer(tmp_path, SMALL + [f"model={model}", "trainer.batch_size=2", "trainer.deterministic=true"])
        assert torch.are_deterministic_algorithms_enabled()
        losses = [float(trainer.train_step(measure=True)["train/loss"]) for _ in range(2)]
        assert all(torch.isfinite(torch.tensor(losses)))
    finally:
        torch.use_deterministic_algorithms(False)
    # The next trainer (the next job of a sweep) does not inherit it.
    make_trainer(tmp_path / "next", SMALL + [f"model={model}", "trainer.batch_size=2"])
    assert not torch.are_deterministic_algorithms_enabled()


def logged(run_dir: Path, key: str) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in records if key in r}


def test_train_loss_is_the_mean_over_the_logging_interval_and_loss_last_the_step(tmp_path):
    """Before: train/loss was the one step's loss every logger.interval steps. The same seed
    logged every step gives each step's loss to average."""
    every = ["trainer.batch_size=2", "checkpoint.interval=0", "eval.interval=0"]
    make_trainer(tmp_path / "every", SMALL + every + ["logger.interval=1"]).train()
    make_trainer(tmp_path / "fourth", SMALL + every + ["logger.interval=4"]).train()
    steps = logged(tmp_path / "every", "train/loss_last")
    assert logged(tmp_path / "every", "train/loss") == steps  # a window of one step
    means = logged(tmp_path / "fourth", "train/loss")
    assert sorted(means) == [4, 8]
    for end, mean in means.items():
        window = [steps[s] for s in range(end - 3, end + 1)]
        assert mean == approx(sum(window) / 4, rel=1e-6)
        assert logged(tmp_path / "fourth", "train/loss_last")[end] == steps[end]
    assert means[8] != steps[8]


def test_a_skipped_step_is_left_out_of_the_interval_mean(tmp_path):
    trainer = make_trainer(tmp_path, SMALL + ["trainer.batch_size=2", "logger.interval=4", "checkpoint.interval=0",
                                              "eval.interval=0", "trainer.nonfinite=skip"])
    poison_step(trainer, 6)
    trainer.train()
    assert math.isfinite(logged(tmp_path, "train/loss")[8])
