"""The model built on the meta device and materialised rank by rank (trainer/build.py,
model/init.py) holds, at every layout, exactly the weights of `GPT(cfg)` built whole in one
process with the same seed: each rank's parts, gathered back into the logical tensors, are
bit-identical to it. Start-up never holds more than one logical parameter beyond the shards.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import torch
from torch.profiler import ProfilerActivity, profile

from model.gpt import GPT
from model.init import parameter_seed
from parallel.fsdp import PARAM_ATTRIBUTES
from tests.conftest import compose
from tests.distributed import run_distributed
from trainer.config import TrainConfig, to_dataclass

VOCAB = 97  # odd: TP pads the vocabulary rows
SEED = 1234


@dataclass(frozen=True)
class Case:
    model: str
    tp: int = 1
    dp_shard: int = 1
    ep: int = 1


def train_cfg(model: str) -> TrainConfig:
    return to_dataclass(compose([f"model={model}", f"seed={SEED}", "trainer.precision=fp32"]))


def reference(cfg: TrainConfig) -> GPT:
    """The single-process model of the seed, built the plain way."""
    torch.manual_seed(cfg.seed)
    return GPT(replace(cfg.model, vocab_size=VOCAB))


def gather_logical(model: torch.nn.Module, mesh) -> dict[str, torch.Tensor]:
    """Every parameter's logical tensor, gathered from all ranks' parts by collectives."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def cat_over(t: torch.Tensor, group, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim)

    out = {}
    for name, p in model.named_parameters():
        t = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        if p.tp_split_dim is not None and mesh.tp > 1:
            t = cat_over(t, mesh.tp_group, p.tp_split_dim)
        if getattr(p, "ep_split_dim", None) is not None:
            t = cat_over(t, mesh.ep_group, p.ep_split_dim)
        out[name] = t
    return out


def split_attributes(model: torch.nn.Module) -> dict[str, dict]:
    return {n: {a: getattr(p, a) for a in PARAM_ATTRIBUTES if hasattr(p, a)} for n, p in model.named_parameters()}


def _layouts_worker(rank: int, world: int, cases: list[Case], cfgs: dict[str, TrainConfig]) -> list[dict]:
    from model.parallelize import parallelize_moe, parallelize_tp
    from parallel.mesh import build_mesh, release_subgroups
    from trainer.build import build_model

    results = []
    for case in cases:
        mesh = build_mesh(case.tp, dp_shard=case.dp_shard, ep=case.ep)
        model = build_model(cfgs[case.model], VOCAB, mesh, torch.device("cpu"))
        # The splits the plain path records (a whole model sharded on the host).
        plain = parallelize_moe(parallelize_tp(reference(cfgs[case.model]), mesh.tp_group, split_experts=mesh.ep == 1),
                                mesh.ep_group, mesh.tp_group, mesh.dp_group)
        results.append(dict(
            logical=gather_logical(model, mesh),
            attributes=split_attributes(model), plain_attributes=split_attributes(plain),
            devices={p.device.type for p in model.parameters()},
            buffers={n: b.clone() for n, b in model.named_buffers()},
            head_max_logit=[block.attn.head_max_logit for block in model.blocks],
        ))
        del model, plain
        release_subgroups(mesh)
    return results


def check_equal_to_single(case: Case, result: dict, ref: GPT) -> None:
    names = [n for n, _ in ref.named_parameters()]
    assert list(result["logical"]) == names, case
    for name, expected in ref.named_parameters():
        got = result["logical"][name]
        if name in ("embed.weight", "head.weight") and got.shape[0] > VOCAB:
            assert torch.equal(got[VOCAB:], torch.zeros_like(got[VOCAB:])), (case, name, "padding rows")
            got = got[:VOCAB]
        assert torch.equal(got, expected.detach()), (case, name)
    assert result["attributes"] == result["plain_attributes"], case
    assert result["devices"] == {"cpu"}, case
    buffers = dict(ref.named_buffers())
    assert list(result["buffers"]) == list(buffers), case
    for name, expected in buffers.items():
        assert torch.equal(result["buffers"][name], expected), (case, name)
    assert result["head_max_logit"] == [None] * len(ref.blocks), case


# Every layout on one set of 4 ranks (one spawn): what dp_shard does not use is dp_replicate.
# dp_shard 4 splits the 97 vocabulary rows unevenly (25, 25, 25, 22); dp_shard 2 is HSDP here.
LAYOUTS = [
    Case("gpt_tiny", tp=2), Case("gpt_tiny", dp_shard=4), Case("gpt_tiny", dp_shard=2),
    Case("gpt_tiny", tp=2, dp_shard=2),
    Case("moe_tiny", tp=2), Case("moe_tiny", ep=2), Case("moe_tiny", tp=2, ep=2),
    Case("moe_tiny", dp_shard=4, ep=2), Case("moe_tiny", tp=2, dp_shard=2, ep=2),
]


def test_every_layout_holds_the_single_process_weights():
    cfgs = {name: train_cfg(name) for name in {c.model for c in LAYOUTS}}
    per_rank = run_distributed(_layouts_worker, 4, LAYOUTS, cfgs)
    refs = {name: reference(cfg) for name, cfg in cfgs.items()}
    for rank_results in per_rank:
        for case, result in zip(LAYOUTS, rank_results, strict=True):
            check_equal_to_single(case, result, refs[case.model])


def test_single_process_build_is_gpt_of_the_seed():
    from parallel.mesh import single_process_mesh
    from trainer.build import build_model

    for name in ("gpt_tiny", "moe_tiny"):
        cfg = train_cfg(name)
        model = build_model(cfg, VOCAB, single_process_mesh(), torch.device("cpu"))
        ref = reference(cfg)
        for (n, p), (rn, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            assert n == rn and torch.equal(p, r), n
        for (n, b), (rn, r) in zip(model.named_buffers(), ref.named_buffers(), strict=True):
            assert n == rn and torch.equal(b, r), n


def test_the_rule_is_the_documented_one():
    """Each parameter from its own generator, seeded by sha256 of (seed, name); ones for 1-D;
    the residual outputs' std scaled by 1/sqrt(2 n_layers). Computed here from the description."""
    cfg = replace(train_cfg("moe_tiny").model, vocab_size=VOCAB)
    model = GPT(cfg, init_seed=7)
    # attention's output projection, every MLP's (dense, shared experts) and the experts' down stack
    residual = ("attn.wo.weight", "mlp.w_down.weight", "shared.w_down.weight", "experts.w_down")
    for name, p in model.named_parameters():
        if p.ndim == 1:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        seed = int.from_bytes(hashlib.sha256(f"7:{name}".encode()).digest()[:8], "little") & (2**63 - 1)
        assert parameter_seed(7, name) == seed
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(residual) else cfg.init_std
        expected = torch.empty(p.shape).normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(p, expected), name
    # The default seed is the global generator's: seeding then building is "the model of seed s".
    torch.manual_seed(7)
    assert all(torch.equal(a, b) for a, b in zip(GPT(cfg).parameters(), model.parameters()))
    torch.manual_seed(8)
    assert not torch.equal(GPT(cfg).embed.weight, model.embed.weight)


def _allocated_peak(prof: profile) -> int:
    """Peak of host bytes allocated (net of frees) over the profiled region."""
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    live = peak = 0
    for _, change in events:
        live += change
        peak = max(peak, live)
    return peak


def test_start_up_holds_one_logical_parameter_beyond_the_shards(monkeypatch):
    """Rank 0 of dp_shard 4 (fake process groups): the model is built on meta, and host
    memory peaks at this rank's quarter plus about one logical parameter, not the model."""
    import trainer.build as build
    from parallel.mesh import destroy_mesh, init_simulated_mesh

    cfg = train_cfg("gpt_tiny")
    cfg = replace(cfg, model=replace(cfg.model, n_layers=4, d_model=128, ffn_hidden=512))
    real = build.materialize
    seen_devices: set[str] = set()

    def spy(model, *args, **kwargs):
        seen_devices.update(p.device.type for p in model.parameters())
        return real(model, *args, **kwargs)

    monkeypatch.setattr(build, "materialize", spy)
    mesh = init_simulated_mesh({"tp": 1, "dp_shard": 4, "dp_replicate": -1, "ep": 1}, 4, 0, torch.device("cpu"))
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = build.build_model(cfg, 512, mesh, torch.device("cpu"))
        local = sum(p.to_local().numel() * 4 for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
        del model
    finally:
        destroy_mesh()
    with torch.device("meta"):
        sizes = [p.numel() * 4 for p in GPT(replace(cfg.model, vocab_size=512)).parameters()]
    peak = _allocated_peak(prof)
    assert seen_devices == {"meta"}
    assert sum(sizes) > 3 * (local + max(sizes))  # the bound separates this from building the whole model
    # 16 KiB for incidental small tensors (the shards' metadata, the buffers' temporaries).
    assert peak <= local + buffers + max(sizes) + 16 * 1024, (peak, local, buffers, max(sizes))
