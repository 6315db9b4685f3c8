"""The run configuration: typed schemas for every config group, and start-up validation.

Hydra composes conf/config.yaml on top of `TrainConfig` (registered below as
"train_schema"), so a misspelled key or a value of the wrong type fails at composition
with the key's full name. `validate` then checks what types cannot: values that do not fit
together. Both run before any data, model or process-group work.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from data.config import DataConfig
from model.config import CHECKPOINTING_MODES, ModelConfig
from model.fp8 import FP8_FILTERS, FP8_RECIPES
from optim.config import OptimConfig
from optim.muon.options import check_config_options
from optim.routing import ALL_KINDS
from parallel.pipeline import SCHEDULES


class ConfigError(ValueError):
    """A configuration problem, reported to the user as one line naming the key."""


@dataclass
class TrainerConfig:
    max_steps: int = 200
    # Sequences per data-parallel rank per micro-step.
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    # "bf16": autocast to bfloat16 with fp32 master weights; "fp32": no autocast; "auto": bf16
    # on CUDA (Ampere and newer) and on CPUs with AMX bf16 (amx_bf16 in the CPU flags), fp32
    # elsewhere: a fixed rule (optim/fast_dtype.py). The start-up log says which rule applied.
    precision: str = "auto"
    # Whether fp32 matmuls on CUDA (every matmul under precision=fp32; under bf16 those outside
    # autocast, e.g. fp32 Newton-Schulz) may run on TF32 tensor cores: about 3 decimal digits
    # instead of 7, several times faster on Ampere and newer. false gives true fp32. Set for
    # each job and put back after it, so a sweep's jobs do not inherit it. No effect on a CPU.
    tf32: bool = True
    compile: bool = False
    # "auto" picks CUDA when available, else CPU.
    device: str = "auto"
    # Deterministic kernels (torch.use_deterministic_algorithms, with the cuBLAS workspace
    # setting it needs): on CUDA, reruns and kill-and-resume give bit-identical losses, at some
    # speed cost; without it, atomics in attention backward make each run differ in the last
    # bits. CPU kernels are deterministic either way. An op with no deterministic kernel then
    # fails with torch's error naming it.
    deterministic: bool = False
    # A NaN/inf loss or gradient: "skip" drops that step's update and counts it
    # (train/skipped_steps); "stop" exits (code 3), keeping the last good checkpoint.
    nonfinite: str = "skip"
    # Under "skip": this many skipped steps in a row is divergence, not a bad batch; the run
    # stops (exit code 3) and names the last good checkpoint. A non-finite eval loss stops it too.
    nonfinite_max_consecutive: int = 10
    # Peak matmul TFLOP/s of one device, the denominator of perf/mfu. 0: measured once at
    # start-up (about a second of F.linear matmuls in trainer.precision on the training
    # device), since a CPU has no datasheet figure worth trusting; set it to compare runs
    # against a fixed figure (e.g. a GPU's dense bf16 peak).
    peak_tflops: float = 0.0
    # Recompute activations in the backward instead of keeping them (model/activation_checkpoint.py):
    # "none"; "full" keeps only each block's input and reruns the whole block; "selective" keeps
    # the outputs of attention, of every other matmul and of communication, and reruns the
    # pointwise work. Applied before compile and FSDP2, which wrap the checkpointed blocks.
    activation_checkpointing: str = "none"
    # FP8 matmuls in the blocks' linear layers, through torchao (model/fp8.py): "none",
    # "rowwise" or "tensorwise" (under FSDP2 also a float8 all-gather of the weights). The
    # weights, their gradients and the optimizers stay in high precision.
    fp8: str = "none"
    # Which block linears FP8 takes: "auto", those large enough for FP8 to pay on an H100 (the
    # rule in model/fp8.py); "all", every one whose dimensions are multiples of 16.
    fp8_filter: str = "auto"


@dataclass
class EvalConfig:
    # Evaluate every `interval` steps (and always at the end); 0 evaluates only at the end.
    interval: int = 100
    # Fixed batches per eval set: the same windows every time, so curves are comparable.
    batches: int = 8
    # Sequences per eval batch. Independent of the training batch and the DP size, so the
    # eval windows (and the numbers) are the same whatever the parallel layout.
    batch_size: int = 16
    # The metric train.py's main() returns, the score a Hydra sweeper optimises: its value at
    # the run's last step. "train/loss" or "val/<set>/loss", <set> being val, a data.eval_sets
    # name, or tune (with data.tune_fraction > 0): a tuning study scores val/tune/loss, so that
    # the val and OOD numbers it reports were not what picked its settings.
    objective: str = "val/val/loss"
    # The eval sets evaluated (val, tune, and each data.eval_sets name); null: every one. A
    # study's tuning trials evaluate only the tune set they are scored on: the others cost most
    # of a short run's time and say nothing there. The max attention logit reads val either way.
    sets: Optional[List[str]] = None


@dataclass
class WandbConfig:
    # "offline" writes under <run_dir>/wandb for a later `wandb sync`; "online"; "disabled".
    mode: str = "offline"
    project: str = "muon-trainer"
    entity: Optional[str] = None
    # Runs of one sweep share a group, so wandb shows them together; a sweep names it after its
    # dir (the last part: the sweep's name or date-time), a single run has none.
    group: Optional[str] = None
    # The run's name in wandb: null is the run's `name`, followed in a sweep by the overrides
    # that this job varies (optim.lr=0.001,optim=adamw), so the jobs of a sweep tell apart.
    name: Optional[str] = None
    # Seconds mode=online waits for wandb's server at start-up (wandb.Settings.init_timeout;
    # wandb's own default is 90). Then the run goes on offline, with one warning and the
    # `wandb sync` command in the log, so a flaky network never costs a long job.
    init_timeout_s: float = 60.0
    # true: a failed online start stops the run (exit code 2) instead of going on offline.
    require_online: bool = False


@dataclass
class LoggerConfig:
    # Log metrics every `interval` optimizer steps (and at the last step).
    interval: int = 10
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # "auto": a tqdm bar on a terminal, plain lines otherwise; "bar"; "lines"; "none".
    progress: str = "auto"
    # Starts every progress line; a sweep sets it to the job ("job 3") so that the lines of
    # jobs running side by side (hydra/launcher=local) tell apart.
    progress_prefix: Optional[str] = None
    # A run that stops early (preempted, diverged) prints the command that resumes it; a fair
    # study's runs turn it off: the study prints its own, which goes through its lock and report.
    resume_hint: bool = True
    # What the run is part of, kept in its config (and so in wandb's): a study's runs carry the
    # study's id, their stage, side, budget and trial here, for the records and the sweep view.
    run_info: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ParallelConfig:
    # The device mesh (parallel/mesh.py), outermost first: dp_replicate x dp_shard x tp ranks.
    # -1: the rest of the world (at most one key). The default is data parallel with ZeRO-1
    # over every rank that TP leaves; dp_shard > 1 shards the parameters too (FSDP2), and
    # dp_replicate x dp_shard with both > 1 is HSDP.
    dp_replicate: int = -1
    dp_shard: int = 1
    tp: int = 1
    # Expert parallelism for MoE models: the experts are spread over groups of `ep`
    # data-parallel ranks (each rank holds n_experts / ep of them, whole) and every routed token
    # goes to its expert's rank and back by all-to-all. It must divide the data-parallel ranks
    # (dp_shard under FSDP2, else dp_replicate) and model.n_experts. See docs/moe.md.
    ep: int = 1
    # Pipeline parallelism (parallel/pipeline.py, docs/distributed.md): `pp` stages, the
    # outermost mesh dimension; each stage holds whole layers and a whole dp x tp layout of
    # them. pp_schedule: gpipe, 1f1b, interleaved_1f1b, interleaved_zero_bubble or zbv (the
    # last three hold pp_stages_per_rank stages per rank; zbv exactly 2, in a V).
    # pp_microbatches: the pipeline's micro-batches per trainer.batch_size batch (0: one
    # sequence each); trainer.grad_accum runs the whole pipeline that many times per step.
    # pp_layers_per_stage: blocks per stage (pp x pp_stages_per_rank of them), instead of the
    # even split that counts the embedding and the head as a layer each.
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 1
    pp_layers_per_stage: list[int] = field(default_factory=list)
    # FSDP2 (dp_shard > 1): free each block's gathered parameters after its forward and gather
    # them again for its backward (less memory), or keep them to the backward (one all-gather
    # a block fewer per micro-batch). null (the default): true, but false under a pipeline
    # (parallel.pp > 1), which would otherwise gather each block again per micro-batch.
    reshard_after_forward: Optional[bool] = None
    # Process-group backend: "auto" (nccl on CUDA, gloo on CPU), "nccl" or "gloo".
    backend: str = "auto"
    # Seconds a collective waits for its peers before the job fails, so a dead rank ends the
    # run instead of hanging it. It also bounds how long the other ranks wait while rank 0
    # builds the tokenizer and token cache of a first run: raise it for a very large data=hf.
    timeout_s: float = 1800.0
    # A dry run: 0 trains for real. N > 1 runs this one process as rank `simulate_rank` of an
    # N-rank layout (the parallel.* keys above describe the whole N-rank mesh) over fake
    # process groups whose collectives move no data: the real shapes, sharding, optimizer
    # owner plan and memory of that rank, at full size on one device. Its losses mean nothing
    # and it writes no checkpoint (trainer/simulation/one_rank.py).
    simulate_world: int = 0
    simulate_rank: int = 0
    # A simulation whose planned memory for the rank (planning/memory_plan.py) exceeds this
    # machine's (a CPU's RAM, a GPU's memory) is refused at start, before anything is built: it
    # would swap or be killed minutes later. true runs it anyway (the plan leaves out what it
    # cannot count, and the process may fit where the plan says it does not).
    simulate_force: bool = False


def reshard_after_forward(parallel: ParallelConfig) -> bool:
    """parallel.reshard_after_forward as it runs: null means true, but false under a pipeline."""
    if parallel.reshard_after_forward is None:
        return parallel.pp == 1
    return parallel.reshard_after_forward


def layout_keys(parallel: ParallelConfig) -> dict[str, int]:
    """parallel.* as parallel.mesh.resolve_layout's arguments."""
    return {"tp": parallel.tp, "dp_replicate": parallel.dp_replicate, "dp_shard": parallel.dp_shard,
            "ep": parallel.ep, "pp": parallel.pp}


@dataclass
class CheckpointConfig:
    # Save every `interval` steps (0: only at the end of the run) into <run_dir>/checkpoints.
    interval: int = 500
    # Save at the end of the run too. A fair study's trials turn it off: their result is their
    # metrics, and each end checkpoint costs a second and the model's weights and optimizer state
    # on disk (154 MB for gpt_small). A preempted run still saves the step it stops at.
    at_end: bool = True
    # "auto": continue from the newest checkpoint in this run dir that verifies and is not
    # suspect (after a divergence stop: checkpoints/last_good), if any;
    # "none": always start fresh; or the path of a checkpoint (a step_<N> dir, or an older
    # single-file step_<N>.pt) to continue from, or of a run dir: its newest good checkpoint.
    resume: str = "auto"
    # Resume from a suspect checkpoint (checkpoints/suspect.json: saved after a non-finite step
    # and before a finite eval, or left unconfirmed by a divergence stop) all the same.
    allow_suspect: bool = False
    # Keep the newest `keep` checkpoints, and always the newest good one (checkpoints/last_good:
    # its weights went on to train a finite step), which a diverging run would otherwise rotate out.
    keep: int = 3
    # Write checkpoints in the background: the step pays only for copying the state to host
    # memory, the files are written while training goes on (torch.distributed.checkpoint's
    # async_save). The end-of-run and preemption checkpoints are always written at once.
    async_save: bool = False


@dataclass
class ProfileConfig:
    # Record torch.profiler Chrome traces of optimizer steps [a, b] (1-based, inclusive;
    # the default skips the first steps, which pay one-off allocation and warm-up costs)
    # into <run_dir>/traces/, one file per rank; scripts/analyze_trace.py reads them.
    enabled: bool = False
    steps: list[int] = field(default_factory=lambda: [3, 5])


@dataclass
class TrainConfig:
    # Names the run: outputs/<name>/<date-time>.
    name: str = "run"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_dataclass(cfg: DictConfig) -> TrainConfig:
    """The composed Hydra config as a plain, typed TrainConfig."""
    check_known_keys(cfg)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def check_known_keys(cfg: DictConfig, schema: type = TrainConfig, prefix: str = "") -> None:
    """Reject keys that no schema field has. Hydra refuses `trainer.foo=1`, but suggests
    `+trainer.foo=1`, which it then accepts and the typed config silently drops: a typo plus
    the suggested fix would give a run that ignores the value."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    types = typing.get_type_hints(schema)  # resolves the string annotations
    for key in cfg.keys():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"{name}: no such key{_hint(str(key), list(fields), prefix)}")
        sub = types[key]
        if dataclasses.is_dataclass(sub) and isinstance(cfg[key], DictConfig):
            check_known_keys(cfg[key], sub, f"{name}.")


def nearest(name: str, options: list[str]) -> Optional[str]:
    """The option `name` most likely misspells, if any is close: the one rule for every hint."""
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return close[0] if close else None


def _hint(key: str, known: list[str], prefix: str) -> str:
    close = nearest(key, known)
    return f" (did you mean {prefix}{close}?)" if close else f" (known: {', '.join(known)})"


def key_hint(section: str, key: str) -> str:
    """" (did you mean optim.lr?)" for an unknown `key` of the dotted `section` ("" for the top
    level): the nearest key of TrainConfig's schema there, or the keys there are."""
    schema: Any = TrainConfig
    for part in filter(None, section.split(".")):
        sub = typing.get_type_hints(schema).get(part)
        if not dataclasses.is_dataclass(sub):
            return ""  # a free-form dict (weight_decay_overrides) or a plain value
        schema = sub
    known = [f.name for f in dataclasses.fields(schema)]
    return _hint(key, known, f"{section}." if section else "")


def _choice(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: unknown value {value!r} (expected one of {', '.join(allowed)})")


def _positive(key: str, value: float, minimum: int = 1) -> None:
    if not value >= minimum:  # also rejects NaN, which `value < minimum` lets through
        raise ConfigError(f"{key} must be >= {minimum}, got {value}")


def _finite(key: str, value: float, zero_allowed: bool = False, note: str = "") -> None:
    """A float that must be finite and > 0 (>= 0 with `zero_allowed`). Written as "not (what
    must hold)": every comparison with NaN is false, so NaN fails it, where `value <= 0` would
    let NaN through."""
    if not (0 <= value if zero_allowed else 0 < value) or not value < math.inf:
        raise ConfigError(f"{key} must be a finite number {'>=' if zero_allowed else '>'} 0{note}, got {value}")


def validate(cfg: TrainConfig) -> None:
    """Check values that must fit together; raise ConfigError naming the key."""
    t, m, o = cfg.trainer, cfg.model, cfg.optim
    _positive("trainer.max_steps", t.max_steps)
    _positive("trainer.batch_size", t.batch_size)
    _positive("trainer.grad_accum", t.grad_accum)
    _positive("trainer.seq_len", t.seq_len)
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len} "
            f"of model={m.name}"
        )
    _choice("trainer.precision", t.precision, ("auto", "bf16", "fp32"))
    if not isinstance(t.tf32, bool):  # Hydra checks the type; a config built in Python may not
        raise ConfigError(f"trainer.tf32 must be true or false, got {t.tf32!r}")
    _choice("trainer.device", t.device, ("auto", "cpu", "cuda"))
    _choice("trainer.nonfinite", t.nonfinite, ("skip", "stop"))
    _choice("trainer.activation_checkpointing", t.activation_checkpointing, CHECKPOINTING_MODES)
    _choice("trainer.fp8", t.fp8, FP8_RECIPES)
    _choice("trainer.fp8_filter", t.fp8_filter, FP8_FILTERS)
    if t.fp8 != "none" and cfg.parallel.tp > 1:
        raise ConfigError(
            f"trainer.fp8={t.fp8} does not apply under parallel.tp={cfg.parallel.tp}: torchao converts nn.Linear "
            "layers, and the TP layers are hand-written (parallel/tp_layers.py); use FSDP2 or ZeRO-1, or trainer.fp8=none"
        )
    _positive("model.loss_chunks", m.loss_chunks)
    _positive("trainer.nonfinite_max_consecutive", t.nonfinite_max_consecutive)
    _finite("trainer.peak_tflops", t.peak_tflops, zero_allowed=True, note=" (0 = measure at start-up)")

    # Checked on dense models too: a typo there is still a typo.
    _choice("model.score_func", m.score_func, ("sigmoid", "softmax"))
    _positive("model.n_layers", m.n_layers)
    _positive("model.d_model", m.d_model)
    _positive("model.ffn_hidden", m.ffn_hidden)
    _positive("model.n_heads", m.n_heads)
    _positive("model.n_kv_heads", m.n_kv_heads)
    if m.d_model % m.n_heads:
        raise ConfigError(f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}")
    if m.head_dim % 2:
        raise ConfigError(f"model head_dim={m.head_dim} must be even for RoPE")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not a multiple of model.n_kv_heads={m.n_kv_heads}"
        )
    _finite("model.rope_theta", m.rope_theta)
    _finite("model.norm_eps", m.norm_eps)
    _finite("model.init_std", m.init_std)
    _finite("model.bias_update_rate", m.bias_update_rate, zero_allowed=True)
    _finite("model.aux_loss_coef", m.aux_loss_coef, zero_allowed=True)

    _choice("optim.name", o.name, ("muon", "adamw"))
    try:
        check_config_options(o)  # every optim.muon.* value, where the optimizer checks them
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for key, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= value < 1:  # also rejects NaN
            raise ConfigError(f"{key} must lie in [0, 1), got {value}")
    _finite("optim.eps", o.eps)
    _finite("optim.weight_decay", o.weight_decay, zero_allowed=True)
    if not o.grad_clip >= 0:  # a negative value used to turn clipping off without a word
        raise ConfigError(f"optim.grad_clip={o.grad_clip} must be >= 0 (0 turns clipping off)")
    _choice("optim.schedule", o.schedule, ("cosine", "wsd", "constant"))
    _finite("optim.lr", o.lr)
    # A fraction set wins over its absolute key (optim/schedule.py), so only the one in use is
    # held to its range; both comparisons are false for NaN, which is refused too.
    if o.min_lr_ratio is not None and not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio must lie in [0, 1], got {o.min_lr_ratio}")
    if o.min_lr_ratio is None and not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} must lie in [0, optim.lr={o.lr}]")
    if o.warmup_fraction is not None and not 0 <= o.warmup_fraction < 1:
        raise ConfigError(f"optim.warmup_fraction must lie in [0, 1), got {o.warmup_fraction}")
    _positive("optim.warmup_steps", o.warmup_steps, minimum=0)
    _positive("optim.gather_buckets", o.gather_buckets)
    if not 0 < o.wsd_decay_fraction <= 1:
        raise ConfigError(f"optim.wsd_decay_fraction must lie in (0, 1], got {o.wsd_decay_fraction}")

    # Checked with the clip off too: turning it on later must not be when a typo surfaces.
    if not o.qk_clip.tau > 0:
        raise ConfigError(f"optim.qk_clip.tau must be > 0, got {o.qk_clip.tau}")
    if o.qk_clip.enabled:
        if m.qk_norm:
            # The norm divides out any scale on W_q / W_k rows, so the clip could not act.
            raise ConfigError(
                "optim.qk_clip.enabled=true with model.qk_norm=true: QK-norm already bounds the "
                "logits and undoes the clip's W_q / W_k scaling; turn one of them off"
            )

    for key, overrides in (("optim.weight_decay_overrides", o.weight_decay_overrides),
                           ("optim.lr_overrides", o.lr_overrides)):
        for kind, value in overrides.items():
            if kind not in ALL_KINDS:
                raise ConfigError(f"{key}.{kind}: unknown parameter family (expected one of "
                                  f"{', '.join(sorted(ALL_KINDS))})")
            if not 0 <= value < math.inf:  # also rejects NaN
                raise ConfigError(f"{key}.{kind} must be a finite value >= 0, got {value}")

    _positive("eval.batches", cfg.eval.batches)
    _positive("eval.interval", cfg.eval.interval, minimum=0)
    _positive("eval.batch_size", cfg.eval.batch_size)
    _eval_sets(cfg)
    _objective(cfg)
    _positive("logger.interval", cfg.logger.interval)
    _choice("logger.wandb.mode", cfg.logger.wandb.mode, ("offline", "online", "disabled"))
    _positive("logger.wandb.init_timeout_s", cfg.logger.wandb.init_timeout_s)
    if cfg.logger.wandb.mode == "online" and not wandb_credentials_found():
        raise ConfigError(
            "logger.wandb.mode=online: no wandb credentials (WANDB_API_KEY unset, no api.wandb.ai entry in "
            "~/.netrc); run `wandb login`, or use logger.wandb.mode=offline (and `wandb sync` later)"
        )
    _choice("logger.progress", cfg.logger.progress, ("auto", "bar", "lines", "none"))
    _positive("parallel.tp", cfg.parallel.tp)
    for key in ("dp_replicate", "dp_shard"):
        value = getattr(cfg.parallel, key)
        if value != -1:
            _positive(f"parallel.{key}", value)
    _choice("parallel.backend", cfg.parallel.backend, ("auto", "nccl", "gloo"))
    # Checked without a pipeline too (parallel.pp=1 reads no other pp_* key): a typo there is
    # still a typo, and it would surface only on the run that turns the pipeline on.
    _choice("parallel.pp_schedule", cfg.parallel.pp_schedule, tuple(SCHEDULES))
    _positive("parallel.simulate_world", cfg.parallel.simulate_world, minimum=0)
    if cfg.parallel.simulate_world and not 0 <= cfg.parallel.simulate_rank < cfg.parallel.simulate_world:
        raise ConfigError(f"parallel.simulate_rank={cfg.parallel.simulate_rank} must lie in [0, "
                          f"parallel.simulate_world={cfg.parallel.simulate_world})")
    _finite("parallel.timeout_s", cfg.parallel.timeout_s)
    _positive("checkpoint.interval", cfg.checkpoint.interval, minimum=0)
    _positive("checkpoint.keep", cfg.checkpoint.keep)
    _profile_steps(cfg.profile, t.max_steps)


def objective_choices(cfg: TrainConfig) -> list[str]:
    """The metrics eval.objective may name: the losses every run logs at its last step."""
    tune = ["tune"] if cfg.data.tune_fraction > 0 else []
    return [f"val/{name}/loss" for name in ("val", *tune, *cfg.data.eval_sets)] + ["train/loss"]


def _eval_sets(cfg: TrainConfig) -> None:
    """eval.sets names sets the run has, at least one, and keeps the one eval.objective reads."""
    chosen = cfg.eval.sets
    if chosen is None:
        return
    known = [key.split("/")[1] for key in objective_choices(cfg) if key.startswith("val/")]
    if not chosen:
        raise ConfigError(f"eval.sets: empty; list the sets to evaluate ({', '.join(known)}), or null for all")
    for name in chosen:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"eval.sets: no eval set {name!r} ({hint}known: {', '.join(known)})")
    parts = cfg.eval.objective.split("/")
    if len(parts) == 3 and parts[0] == "val" and parts[1] not in chosen:
        raise ConfigError(f"eval.sets={list(chosen)} leaves out {parts[1]}, which eval.objective={cfg.eval.objective} reads")


def _objective(cfg: TrainConfig) -> None:
    """A sweeper handed the NaN of a metric the run never logs would rank every trial alike."""
    key, known = cfg.eval.objective, objective_choices(cfg)
    if key in known:
        return
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "val" and parts[2] == "loss":
        why = f'no eval set "{parts[1]}"' + (" (data.tune_fraction is 0)" if parts[1] == "tune" else "")
    else:
        why = "not a loss the run logs (train/loss or val/<set>/loss)"
    raise ConfigError(f"eval.objective={key}: {why}; known: {', '.join(known)}")


def _profile_steps(p: ProfileConfig, max_steps: int) -> None:
    steps = list(p.steps)
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1]:
        raise ConfigError(
            f"profile.steps must be two steps [a, b] with 1 <= a <= b, got {steps}"
        )
    if p.enabled and steps[0] > max_steps:
        raise ConfigError(
            f"profile.steps={steps} starts after trainer.max_steps={max_steps}: nothing would be profiled"
        )


def wandb_credentials_found() -> bool:
    """Whether `wandb.init(mode="online")` will find an API key, checked without importing
    wandb: the environment, or the netrc file `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        return True
    import netrc

    path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        hosts = netrc.netrc(path).hosts
    except (OSError, netrc.NetrcParseError):
        return False
    base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].rstrip("/")
    return base in hosts
