"""The command line, checked before Hydra runs.

Hydra writes the run dir (.hydra/, the job log) before train.py's main() starts, and reports
its own composition errors as a few lines of its text with exit 1. So train.py composes the
config here first, with Hydra's compose API, which writes nothing. Every value is checked
the way main() checks it, and any problem ends in one line naming the key, with exit 2,
before any run dir, cache, data or model work:
- Hydra's composition errors, turned into one line each: a value of the wrong type, an
  unknown key (with the nearest key, and never Hydra's `+key` advice, which the typed config
  would then drop), a missing preset (with the presets there are), an override that does not
  parse (naming it);
- every value of every job of a sweep, composed one by one (the command line's sweeps and the
  sweeper's `params` of an experiment), up to MAX_SWEEP_JOBS jobs.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from trainer.config import ConfigError, TrainConfig, key_hint, layout_keys, nearest, to_dataclass, validate

# A sweep with more jobs than this has its first MAX_SWEEP_JOBS checked here and the rest by
# each job's own main(): each check composes a config (tens of milliseconds).
MAX_SWEEP_JOBS = 256


@dataclass
class CommandLine:
    """What Hydra will do with argv: run one job (`multirun` False) or a sweep, with these
    overrides; `plain` is False for --help, --cfg, another config and the like, which are
    Hydra's to handle."""

    overrides: list[str]
    multirun: bool
    plain: bool


def read_command_line(argv: list[str]) -> Optional[CommandLine]:
    """None when Hydra's own argument parser refuses argv (it says why itself)."""
    from hydra._internal.utils import get_args_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = get_args_parser().parse_args(argv)
    except (SystemExit, Exception):
        return None
    plain = not any((args.help, args.hydra_help, args.cfg, args.info, args.shell_completion, args.config_path,
                     args.config_name, args.config_dir, args.experimental_rerun))
    return CommandLine(list(args.overrides), bool(args.multirun), plain)


def compose(overrides: list[str], config_dir: str, hydra_node: bool = False) -> DictConfig:
    """The config Hydra composes for these overrides (with its `hydra` node if asked), or
    ConfigError in one line."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=hydra_node)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(hydra_error_line(err, overrides)) from err


def hydra_error_line(err: Exception, overrides: list[str]) -> str:
    """One line for one of Hydra's composition errors, naming the key or override."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    text = str(err)
    if isinstance(err, OverrideParseException):
        return f"{_unparsable(overrides) or text.splitlines()[0]}: cannot parse this override ({text.splitlines()[0]})"
    not_default = re.match(r"Could not override '([^']+)'\. No match in the defaults list", text)
    if not_default:
        # `experiment=x`, as other templates spell it: conf/config.yaml does not select an
        # experiment, so one is added to the defaults list, which takes a plus.
        group = not_default.group(1)
        value = _override_value(group, overrides, text)
        return (f"{group}={value}: {group} is not in config.yaml's defaults list, so it is added, not overridden: "
                f"write +{group}={value}")
    ambiguous = re.match(r"Ambiguous value for argument '([^']*)'", text)
    if ambiguous:
        # Hydra's three lines of advice, of which the first fits most: a comma list is a sweep.
        key, _, value = ambiguous.group(1).partition("=")
        return (f"{key}={value}: a comma-separated value is a sweep: add --multirun (-m) to run one job per value "
                f"(for a list write {key}=[{value}], for a string quote it: {key}='{value}')")
    if isinstance(err, MissingConfigException):
        missing = re.search(r"Could not find '([^']+)/([^'/]+)'", text)
        if missing:
            group, name = missing.groups()
            options = re.findall(r"^\t(\S+)$", text.split(f"Available options in '{group}':", 1)[-1], re.M)
            close = nearest(name, options)
            hint = f"did you mean {group}={close}? " if close else ""
            return f"{group}={name}: no such preset ({hint}available: {', '.join(options) or 'none'})"
    cause = err.__cause__ if err.__cause__ is not None else err
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and full_key:
        prefix, _, key = str(full_key).rpartition(".")
        if prefix in FAMILY_DICTS:
            return _family_key_line(prefix, key, _override_value(str(full_key), overrides, text))
        return f"{full_key}: no such key{key_hint(prefix, key)}"
    if isinstance(cause, ValidationError) and full_key:
        return f"{full_key}: {str(cause).splitlines()[0]}"
    return text.strip().splitlines()[0] if text.strip() else type(err).__name__


# Config dicts keyed by parameter family, empty by default: a family is added to them with `+`.
FAMILY_DICTS = ("optim.lr_overrides", "optim.weight_decay_overrides")


def _family_key_line(prefix: str, family: str, value: str) -> str:
    """The one place where Hydra's `+key` advice is right: a family missing from an overrides dict."""
    from optim.routing import ALL_KINDS

    if family in ALL_KINDS:
        return (f"{prefix}.{family}: not set yet: {prefix} lists only the families it changes, so add one with a "
                f"plus: write +{prefix}.{family}={value}")
    close = nearest(family, sorted(ALL_KINDS))
    hint = f"did you mean +{prefix}.{close}={value}? " if close else ""
    return f"{prefix}.{family}: unknown parameter family ({hint}families: {', '.join(sorted(ALL_KINDS))})"


def _override_value(key: str, overrides: list[str], text: str) -> str:
    """The value the command line gave `key`: from Hydra's advice ("use +key=value"), else from
    the override itself."""
    advised = re.search(rf"use \+{re.escape(key)}=(\S*)", text)
    if advised:
        return advised.group(1)
    for override in overrides:
        written, _, value = override.lstrip("+~").partition("=")
        if written == key:
            return value
    return "..."


def _unparsable(overrides: list[str]) -> Optional[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except Exception:
            return override
    return None


def sweep_jobs(overrides: list[str], sweeper_params: dict[str, str]) -> list[list[str]]:
    """The override lists of a sweep's jobs, as Hydra's basic sweeper forms them: the sweeper's
    `params` (from an experiment config), then the command line, whose keys win."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    by_key: dict[str, list[str]] = {}
    for text in [f"{k}={v}" for k, v in sweeper_params.items()] + overrides:
        override = parser.parse_overrides([text])[0]
        key = override.get_key_element()
        if override.is_sweep_override():
            by_key[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
        else:
            by_key[key] = [text]
    return [list(job) for job in itertools.islice(itertools.product(*by_key.values()), MAX_SWEEP_JOBS)]


def check_config(cfg: DictConfig, world_size: int, devices_here: bool = True) -> TrainConfig:
    """Every check of a job's config that needs no data, model or network, in one place for the
    preflight and for main(): the values, the layout for `world_size` ranks (the launched
    processes, or parallel.simulate_world in a simulation), the model's fit with it, a
    simulation's fit with this machine's memory, the data source, the optional packages it
    switches on, this node's devices (unless `devices_here` is False: the job runs on another
    machine), the checkpoint to resume (a run dir becomes its newest good checkpoint)."""
    from data.source_checks import check_data_config, check_data_packages
    from model.moe import check_moe_config
    from model.parallelize import check_ep, check_tp_divisibility
    from parallel.mesh import check_layout
    from trainer.device import check_device
    from trainer.pipeline import check_pipeline
    from trainer.simulation.one_rank import check_simulated_memory, check_simulation
    from trainer.run.sinks import check_sink_packages

    typed = to_dataclass(cfg)
    validate(typed)
    check_layout(check_simulation(typed, world_size), layout_keys(typed.parallel))
    if devices_here:
        check_device(typed.trainer.device)
    check_moe_config(typed.model)
    check_tp_divisibility(typed.model, typed.parallel.tp, split_experts=typed.parallel.ep == 1)
    check_ep(typed.model, typed.parallel.ep)
    check_pipeline(typed)
    # Before any data or model work, which for a layout too large for this machine would run for
    # minutes, printing nothing, and then be killed.
    check_simulated_memory(typed)
    check_data_config(typed.data)
    # Optional packages the config switches on: missing, they would stop the run only
    # after the corpus is built.
    check_data_packages(typed.data)
    check_sink_packages(typed.logger)
    typed.checkpoint.resume = check_resume(typed)
    return typed


def config_warnings(cfg: TrainConfig) -> list[str]:
    """Values that are allowed but rarely meant: one line each, logged at the start of the job."""
    from optim.schedule import lr_at, warmup_steps, warmup_words

    t, o = cfg.trainer, cfg.optim
    lines = []
    # A warmup_fraction (< 1, checked) never outlasts the run; a warmup_steps it overrides does not count.
    if t.max_steps < warmup_steps(o, t.max_steps):
        peak = max(lr_at(step, o, t.max_steps) for step in range(t.max_steps))
        lines.append(f"trainer.max_steps={t.max_steps} < {warmup_words(o, t.max_steps)}: the run ends inside "
                     f"its warmup, so its lr peaks at {peak:.3g}, not optim.lr={o.lr:g}")
    if t.fp8 != "none" and not t.compile:
        lines.append(f"trainer.fp8={t.fp8} without trainer.compile: each float8 cast is a kernel of its own, "
                     "so the step is slower than in bf16; set trainer.compile=true")
    return lines


# The model keys that set its parameters' shapes (and what they mean): a checkpoint saved with
# other values does not fit this run's model.
ARCHITECTURE_KEYS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "qk_norm", "n_experts",
                     "n_shared_experts", "expert_hidden", "n_dense_layers")


def check_resume(cfg: TrainConfig) -> str:
    """checkpoint.resume as the run reads it: auto, none, or the checkpoint it names. A run dir
    (or its checkpoints/ dir) names its newest good checkpoint, as scripts/export_hf.py and
    scripts/generate.py read it. Refused in one line, before Hydra writes the run dir: a path
    that is not there, a dir without a checkpoint, a checkpoint with files missing, a suspect
    one (unless checkpoint.allow_suspect), one of the other optimizer or of another model.
    Its digests are verified later, by the ranks together (trainer/checkpoint/store.py)."""
    from trainer.checkpoint.files import CheckpointError, read_saved_run, resolve_checkpoint

    resume = cfg.checkpoint.resume
    if resume in ("auto", "none"):
        return resume
    if not Path(resume).exists():
        raise ConfigError(f"checkpoint.resume={resume}: no such checkpoint (expected auto, none, a run dir, or the "
                          "path of a step_<N> dir or step_<N>.pt)")
    try:
        path = resolve_checkpoint(Path(resume), cfg.checkpoint.allow_suspect, "checkpoint.allow_suspect=true")
        saved = read_saved_run(path).get("config", {})
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.resume: {err}") from err
    optim = saved.get("optim", {}).get("name")
    if optim is not None and optim != cfg.optim.name:
        raise ConfigError(f"checkpoint.resume: {path}: trained with optim={optim}, but this run has "
                          f"optim={cfg.optim.name}; resume it with optim={optim}, or start fresh with "
                          "checkpoint.resume=none")
    model = saved.get("model", {})
    differing = [f"model.{key} {model[key]} there, {getattr(cfg.model, key)} here" for key in ARCHITECTURE_KEYS
                 if key in model and model[key] != getattr(cfg.model, key)]
    if differing:
        raise ConfigError(f"checkpoint.resume: {path}: a checkpoint of another model ({', '.join(differing)}); "
                          f"resume it with model={model.get('name')} and its values, or start fresh with "
                          "checkpoint.resume=none")
    return str(path)


def preflight(argv: list[str], config_dir: str, world_size: int) -> Optional[DictConfig]:
    """Check the command line's every job; raise ConfigError (or the ValueError of a check) in
    one line. Returns the composed config of a single run (None for a sweep, or for what Hydra
    handles itself: --help, --cfg, a command line its parser refuses)."""
    line = read_command_line(argv)
    if line is None or not line.plain:
        return None
    if not line.multirun:
        cfg = compose(line.overrides, config_dir)
        check_config(cfg, world_size)
        return cfg
    base = compose([_first_of_sweep(o) for o in line.overrides], config_dir, hydra_node=True)
    params = OmegaConf.to_container(base.hydra.sweeper, resolve=False).get("params") or {}
    # The submitit launcher runs each job on a SLURM node, whose GPUs its main() checks.
    devices_here = "submitit" not in str(OmegaConf.select(base, "hydra.launcher._target_", default=""))
    for job in sweep_jobs(line.overrides, {str(k): str(v) for k, v in params.items()}):
        check_config(compose(job, config_dir), world_size, devices_here)
    return None


def _first_of_sweep(text: str) -> str:
    """`key=a,b` as `key=a`: enough to compose the sweep's base config and read its sweeper."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_overrides([text])[0]
    except Exception:
        return text  # compose() names it
    if not override.is_sweep_override():
        return text
    return f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}"
