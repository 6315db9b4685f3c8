"""FP8 matmuls for training (trainer.fp8), through torchao.

torchao's Float8Linear replaces a block's nn.Linear: its forward and backward cast the
input, the weight and the output gradient to float8 with dynamic scales and multiply with
torch._scaled_mm, while the parameter itself stays the high-precision (fp32 master) weight.
So the optimizers, Muon included, see the same fp32 weights and gradients as without FP8,
and checkpoints hold them: a checkpoint loads with trainer.fp8 on or off.

Recipes: "tensorwise" (one scale per tensor) and "rowwise" (one per row, more accurate,
slower on today's kernels). Under FSDP2 (parallel.dp_shard > 1) tensorwise also all-gathers
the weights in float8, half the bytes of bf16: each shard is cast with the scale of the whole
weight, which `refresh_weight_scales` computes once per step, with one all-reduce, after the
optimizers (and QK-clip) have written the weights.

Which linears (`converts`): those inside the blocks whose two dimensions are multiples of 16
(what _scaled_mm requires) and, under trainer.fp8_filter=auto, large enough that FP8 pays on
an H100, by torchao's per-recipe measurements: tensorwise leaves out a layer whose input is
at most 4096 and output at most 1024 features wide; rowwise keeps only layers with more than
2048 outputs and more than 1024 inputs, and not both at most 4096 outputs and at most 2048
inputs. trainer.fp8_filter=all converts every block linear of a valid shape (for tests and
experiments). The embedding, the LM head and the router stay in the run's precision (bf16
under autocast): they are not block linears, and the head's logits decide the loss's precision.

MoE experts: their grouped GEMMs (torch._grouped_mm) run in float8 rowwise through
torchao.prototype.moe_training where torchao has kernels for the device: CUDA compute
capability 9.x (H100, H200). Elsewhere they stay in the run's precision, and start-up says so.

TP: our tensor-parallel layers (parallel/tp_layers.py) are hand-written modules, not
nn.Linear, which is what torchao converts, and a tensorwise scale would then be one per shard:
trainer.fp8 with parallel.tp > 1 is refused at start (trainer/config.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from data.quiet_imports import quiet_library_noise
from model.moe import Experts, moe_layers
from parallel.comm import all_reduce

FP8_RECIPES = ("none", "rowwise", "tensorwise")
FP8_FILTERS = ("auto", "all")
# What torch._scaled_mm requires of both dimensions of a float8 matmul.
FP8_MULTIPLE = 16


def torchao_float8():
    """torchao.float8, imported on first use (a run without FP8 never imports torchao), without
    the noise its import prints (data/quiet_imports.py)."""
    quiet_library_noise()
    import torchao.float8 as float8

    return float8


def converts(recipe: str, fqn: str, module: nn.Module, filter_mode: str = "auto") -> bool:
    """Whether `module` at `fqn` runs its matmuls in float8 under `recipe` (the rule above)."""
    if recipe == "none" or type(module) is not nn.Linear or not fqn.startswith("blocks."):
        return False
    outputs, inputs = module.out_features, module.in_features
    if outputs % FP8_MULTIPLE or inputs % FP8_MULTIPLE:
        return False
    if filter_mode == "all":
        return True
    if recipe == "tensorwise":
        return not (inputs <= 4096 and outputs <= 1024)
    return outputs > 2048 and inputs > 1024 and not (outputs <= 4096 and inputs <= 2048)


def linear_config(recipe: str, fsdp_all_gather: bool, device: torch.device):
    """torchao's Float8LinearConfig for `recipe`; FP8 all-gather only where FSDP2 shards and
    the recipe is tensorwise (torchao supports it for no other). Off CUDA the matmuls are
    emulated: the same float8 casts, then the product in high precision, because a CPU has no
    float8 units, and torch's CPU _scaled_mm ran far slower than the emulation
    (lab/tools/bench/bench_fp8_cpu.py, lab/BENCHMARKS.md)."""
    config = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    return replace(config, enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise",
                   emulate=device.type != "cuda")


def fp8_unsupported(device: torch.device) -> Optional[str]:
    """Why `device` cannot run float8 matmuls (None: it can, or emulates them on a CPU)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"float8 matmuls need compute capability 8.9 or newer (Ada, Hopper); this GPU is {major}.{minor}"
    return None


def experts_unsupported(device: torch.device) -> Optional[str]:
    """Why the experts' grouped GEMMs cannot run in float8 on `device` (None: they can)."""
    if device.type != "cuda":
        return f"torchao's float8 grouped GEMM kernels need CUDA (this run is on {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return (f"torchao's float8 rowwise grouped GEMM needs compute capability 9.x (H100, H200); "
                f"this GPU is {major}.{minor}")
    return None


@dataclass(frozen=True)
class FP8Report:
    """What trainer.fp8 converted: the start-up line and the tests read it."""

    recipe: str
    linears: tuple[str, ...]  # the converted block linears, by name
    left_out: tuple[str, ...]  # block linears the rule left in the run's precision
    all_gather: bool  # FSDP2 all-gathers the converted weights in float8
    experts: str  # "float8 rowwise" or why they stay in the run's precision
    expert_layers: int = 0
    # What the linears left out compute in: trainer.precision as the run resolved it (bf16
    # under autocast, fp32 without).
    precision: str = "bf16"
    # Off CUDA torchao emulates the float8 matmuls (linear_config), which a user asking for
    # FP8 for speed must hear: the emulation is slower than no FP8 at all.
    emulated: bool = False

    def line(self) -> str:
        if self.recipe == "none":
            return "fp8: off"
        moe = f"; MoE experts ({self.expert_layers} layers): {self.experts}" if self.expert_layers else ""
        emulated = ("; emulated off CUDA (the same float8 casts, the products in fp32): several times slower than "
                    "trainer.fp8=none, for checking numerics, not for speed" if self.emulated else "")
        return (f"fp8 {self.recipe}: {len(self.linears)} block linears in float8, {len(self.left_out)} left in "
                f"{self.precision} by trainer.fp8_filter's rule"
                f"{'; float8 all-gather under FSDP2' if self.all_gather else ''}{moe}{emulated}")


def _swap_parameter(module: nn.Module, name: str, data: torch.Tensor) -> None:
    """Replace parameter `name` of `module` by one holding `data`, keeping the attributes the
    parallel layouts recorded on the old one (tp_split_dim, ep_split_dim, ...)."""
    old = getattr(module, name)
    new = nn.Parameter(data, requires_grad=old.requires_grad)
    for attribute, value in vars(old).items():
        setattr(new, attribute, value)
    setattr(module, name, new)


def convert_to_fp8(model: nn.Module, recipe: str, filter_mode: str, fsdp_all_gather: bool,
                   device: torch.device, precision: str = "bf16") -> FP8Report:
    """Convert `model` in place (on the meta device, before FSDP2 wraps it) for `recipe`;
    `precision`: the run's trainer.precision (resolved), what the rest computes in."""
    if recipe == "none":
        return FP8Report("none", (), (), False, precision, precision=precision)
    float8 = torchao_float8()
    config = linear_config(recipe, fsdp_all_gather, device)
    linears = [fqn for fqn, m in model.named_modules() if type(m) is nn.Linear and fqn.startswith("blocks.")]
    chosen = [fqn for fqn in linears if converts(recipe, fqn, model.get_submodule(fqn), filter_mode)]
    chosen_set = set(chosen)
    attributes = {fqn: dict(vars(model.get_submodule(fqn).weight)) for fqn in chosen}
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen_set)
    for fqn in chosen:  # torchao may wrap the weight in a new Parameter (FP8 all-gather)
        weight = model.get_submodule(fqn).weight
        for attribute, value in attributes[fqn].items():
            setattr(weight, attribute, value)
    layers = moe_layers(model)
    reason = experts_unsupported(device)
    if layers and reason is None:
        _convert_experts([layer.experts for _, layer in layers])
    experts = "float8 rowwise grouped GEMMs" if reason is None else f"left in {precision}: {reason}"
    return FP8Report(recipe, tuple(chosen), tuple(f for f in linears if f not in chosen_set),
                     config.enable_fsdp_float8_all_gather, experts, len(layers), precision, config.emulate)


def _convert_experts(experts: list[Experts]) -> None:
    """Wrap each expert stack's weights in torchao's training tensor, whose torch._grouped_mm
    runs the float8 rowwise grouped GEMM; every other op sees the fp32 weight."""
    quiet_library_noise()
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor
    config = Float8TrainingOpConfig()
    for stack in experts:
        for name in ("w_gate", "w_up", "w_down"):
            _swap_parameter(stack, name, Float8TrainingWeightWrapperTensor(getattr(stack, name).data, config))


def _all_gathered_in_float8(roots: list[nn.Module]) -> dict[object, list[nn.Module]]:
    """The Float8Linear modules whose weights FSDP2 all-gathers in float8, by the process group
    their rows are sharded over."""
    from torch.distributed.tensor import DTensor

    torchao_float8()
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    by_group: dict[object, list[nn.Module]] = {}
    for root in roots:
        for module in root.modules():
            weight = getattr(module, "weight", None)
            if not (isinstance(module, Float8Linear) and isinstance(weight, DTensor)
                    and isinstance(weight._local_tensor, WeightWithDynamicFloat8CastTensor)):
                continue
            shard_dim = next(i for i, placement in enumerate(weight.placements) if placement.is_shard())
            by_group.setdefault(weight.device_mesh.get_group(shard_dim), []).append(module)
    return by_group


@torch.no_grad()
def refresh_weight_scales(roots: list[nn.Module]) -> None:
    """Recompute the float8 scales of the weights FSDP2 all-gathers in float8, from the
    weights as they are now: after every write to them (the optimizer step, QK-clip, a
    checkpoint load) and once after they are built, before the next forward. One all-reduce
    (max) per shard group; nothing to do without FP8 all-gather.

    torchao's own precompute_float8_dynamic_scale_for_fsdp does this through DTensor, whose
    functional collective left the process group referenced after destroy_process_group; and
    its scale is not rounded to a power of 2 where the recipe rounds its own (tensorwise), so a
    sharded run would cast its weights unlike the single-process run. Here the scale is the
    recipe's, with the whole weight's amax: FSDP2 casts exactly what one process would."""
    from torchao.float8.float8_utils import amax_to_scale

    for group, modules in _all_gathered_in_float8(roots).items():
        shards = [m.weight._local_tensor._tensor for m in modules]  # this rank's rows, high precision
        # One multi-tensor kernel for every weight's max |w| (a rank without rows holds 0).
        held = [i for i, t in enumerate(shards) if t.numel()]
        amax = torch.zeros(len(shards), dtype=torch.float32, device=shards[0].device)
        if held:
            amax[held] = torch.stack(torch._foreach_norm([shards[i] for i in held], ord=math.inf)).float()
        all_reduce(amax, group, op=dist.ReduceOp.MAX)
        for module, weight_amax in zip(modules, amax):
            config = module.config
            module.weight._local_tensor._precomputed_scale = amax_to_scale(
                weight_amax, config.cast_config_weight.target_dtype, config.round_scales_to_power_of_2)
