"""The plan of a fair Muon-vs-AdamW study (scripts/fair_compare.py): the study config composed
from conf/study/, every check of it made before anything trains, the runs and tokens it will
spend on each side, and an estimate of the time it takes here.

Every bad input is a PlanError in one line naming what is wrong (fair_compare.py prints it and
exits 2): an empty or inverted range or an unknown field in a search space, spaces of unequal
shape, a budget of 0, fewer than 2 or reused seeds, a train.py override that the study sets
itself, or a value a run would refuse.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from scripts import REPO

CONF = REPO / "conf"

# The study's own groups of keys; any other override is train.py's.
STUDY_KEYS = ("target", "baseline", "train", "tuning", "compare", "stats", "spaces")
# What the study sets on every run itself: a command line that sets one too would be overridden.
CONTROLLED = ("optim", "seed", "trainer.max_steps", "eval.objective", "eval.interval", "data.tune_fraction",
              "optim.warmup_steps", "optim.min_lr", "checkpoint.interval", "hydra.sweep.dir", "hydra.sweep.subdir",
              "hydra/sweeper")
# What every run of a study starts from, whatever the base config says.
PLAN_FORMAT = 1


class PlanError(ValueError):
    """A study that cannot run, in one line."""


@dataclass
class Plan:
    """Everything a study runs and reports from, as plan.json holds it (no path, no clock)."""

    name: str
    target: str
    baseline: str
    train: list[str]
    spaces: dict[str, dict]
    tuning: dict[str, Any]
    compare: dict[str, Any]
    stats: dict[str, Any]
    tokens_per_step: int
    budget_per_side: dict[str, Any]
    model: dict[str, Any]
    data: dict[str, Any]
    format: int = PLAN_FORMAT
    notes: list[str] = field(default_factory=list)
    # {side: {budget ("1", "1.5", ...): the settings}}: a rerun of a tuned study's choice
    # (scripts/fair/rerun.py), which runs the final stage only; empty for a study that tunes.
    chosen: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @property
    def sides(self) -> tuple[str, str]:
        return self.target, self.baseline

    def to_json(self) -> str:
        # Keys in their own order, not sorted: a space's dimensions are tuned in file order.
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = json.loads(text)
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"plan format {data.get('format')} is not {PLAN_FORMAT}")
        return cls(**data)

    def steps(self, budget: float) -> int:
        return steps_of(self.compare["steps_1x"], budget)


def steps_of(steps_1x: int, budget: float) -> int:
    return max(1, int(math.floor(steps_1x * budget + 0.5)))


def override_key(text: str) -> str:
    """`+optim.lr_overrides.embed=0.3` -> optim.lr_overrides.embed; `hydra/launcher=slurm` -> hydra/launcher."""
    return text.lstrip("+~").split("=", 1)[0]


def route(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the study's overrides, train.py's), by the first part of each key."""
    study, train = [], []
    for text in overrides:
        head = override_key(text).split(".", 1)[0].split("/", 1)[0]
        (study if head in STUDY_KEYS else train).append(text)
    return study, train


def compose_study(name: str, overrides: list[str]) -> dict:
    """conf/study/<name>.yaml with `overrides`, as a plain dict; PlanError in one line."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name=f"study/{name}", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise PlanError(_study_error_line(err, overrides)) from err
    node = OmegaConf.to_container(cfg, resolve=True)
    return node.get("study", node) if isinstance(node, dict) else {}


def _study_error_line(err: Exception, overrides: list[str]) -> str:
    import re

    text = str(err).strip()
    missing = re.search(r"Could not override '([^']+)'", text) or re.search(r"Key '([^']+)' is not in struct", text)
    if missing:
        key = missing.group(1)
        parts = key.split(".")
        if parts[0] == "spaces" and len(parts) >= 3:
            return f"{'.'.join(parts[:3])}: no such dimension or field (see conf/tuning/; add one with +{key}=...)"
        return f"{key}: no such study key (the study's keys: {', '.join(STUDY_KEYS)}; conf/study/fair.yaml)"
    first = text.splitlines()[0] if text else type(err).__name__
    return f"{' '.join(overrides)}: {first}" if overrides else first


def _is_sweep(text: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides([text])[0].is_sweep_override()
    except Exception:
        return False


def _int(node: dict, key: str, minimum: int) -> int:
    value = node.get(key.rsplit(".", 1)[-1])
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise PlanError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def seed_list(values: Any, key: str) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in values):
        raise PlanError(f"{key} must be a list of integer seeds, got {values!r}")
    if len(set(values)) != len(values):
        raise PlanError(f"{key}: a seed listed twice ({values}): a repeat is not a second seed")
    return list(values)


def check_settings(study: dict) -> None:
    """The study's own numbers: sides, budgets, seeds, the bootstrap (PlanError in one line)."""
    target, baseline = study.get("target"), study.get("baseline")
    spaces = study.get("spaces") or {}
    for key, side in (("target", target), ("baseline", baseline)):
        if side not in spaces:
            raise PlanError(f"{key}={side}: no search space of that name (spaces: {', '.join(sorted(spaces))})")
    if target == baseline:
        raise PlanError(f"target={target} and baseline={baseline}: compare two different spaces")
    tuning, compare, stats = study["tuning"], study["compare"], study["stats"]
    _int(tuning, "tuning.trials", 1)
    _int(tuning, "tuning.extend_max", 0)
    if not 0 < float(tuning["split_fraction"]) < 0.5:
        raise PlanError(f"tuning.split_fraction must lie in (0, 0.5), got {tuning['split_fraction']}")
    tune_seeds = seed_list(tuning["seeds"], "tuning.seeds")
    if not tune_seeds:
        raise PlanError("tuning.seeds: no seed; the tuning runs need at least one")
    seeds = seed_list(compare["seeds"], "compare.seeds")
    if len(seeds) < 2:
        raise PlanError(f"compare.seeds: {len(seeds)} seed(s); a comparison needs at least 2 (5 or more recommended)")
    reused = sorted(set(seeds) & set(tune_seeds))
    if reused:
        raise PlanError(f"compare.seeds: seed {reused[0]} is also a tuning seed; the reported runs need fresh seeds")
    budgets = compare["budgets"]
    if not isinstance(budgets, list) or not all(isinstance(b, (int, float)) for b in budgets):
        raise PlanError(f"compare.budgets must be a list of multiples of the 1x steps, got {budgets!r}")
    for b in budgets:
        if not b >= 1.0 or not math.isfinite(b):
            raise PlanError(f"compare.budgets: {b} is not a budget (each is a multiple >= 1.0 of the 1x steps)")
    if len(set(budgets)) < 3 or 1.0 not in budgets:
        raise PlanError(f"compare.budgets={budgets}: the comparison needs at least 3 budgets, 1.0 among them")
    if compare.get("steps") is not None:
        _int(compare, "compare.steps", 1)
    _int(compare["retune"], "compare.retune.trials", 0)
    if not float(compare["retune"]["step"]) > 1:
        raise PlanError(f"compare.retune.step must be > 1 (the lr grid's ratio), got {compare['retune']['step']}")
    _int(compare, "compare.eval_points", 1)
    _int(stats, "stats.bootstrap", 200)
    for s0 in stats["thresholds"]:
        if not s0 > 0:
            raise PlanError(f"stats.thresholds: {s0} is not a speedup (each must be > 0)")


def check_train_overrides(overrides: list[str], dim_keys: set[str]) -> None:
    """No sweep (the study picks values itself) and nothing the study sets on every run."""
    for text in overrides:
        key = override_key(text)
        if _is_sweep(text):
            raise PlanError(f"{text}: a sweep; the study chooses values itself (tune it through spaces.*)")
        if key in dim_keys:
            raise PlanError(f"{text}: set by the study's search spaces; change the dimension's init in spaces.* instead")
        if key in CONTROLLED or key.startswith("hydra.sweeper"):
            raise PlanError(f"{text}: the study sets {key} on every run itself")


def parsed_spaces(study: dict) -> dict:
    """{side: Space} of the study's two sides, and their parity; PlanError in one line."""
    from eval.fair.search_space import SpaceError, parity_problems
    from eval.fair.space_config import parse_space

    spaces = {}
    for side in (study["target"], study["baseline"]):
        try:
            spaces[side] = parse_space(side, study["spaces"][side])
        except SpaceError as err:
            raise PlanError(str(err)) from err
    problems = parity_problems(spaces[study["target"]], spaces[study["baseline"]])
    if problems and not study["tuning"].get("allow_unequal_grids"):
        raise PlanError(f"{problems[0]} (tuning.allow_unequal_grids=true runs it anyway, and the report says so)")
    return spaces


def start_from(study: dict) -> list[str]:
    """tuning.start_from: each side's dims start at the 1x choice of that earlier study (the rung
    below, on a ladder of sizes), their grids the same shape around it. Changes study["spaces"]
    in place; returns the plan's notes. The plan then holds the moved inits, so it reads alone."""
    from eval.fair.records import StudyError, chosen_settings, read_index, records_dir
    from eval.fair.search_space import SPACE_FIELDS

    source = study["tuning"].get("start_from")
    if not source:
        return []
    try:
        entries = read_index(records_dir(Path(source)))
    except StudyError as err:
        raise PlanError(f"tuning.start_from={source}: {err}") from err
    for side in (study["target"], study["baseline"]):
        chosen = chosen_settings(entries, side).get(1.0)
        if chosen is None:
            raise PlanError(f"tuning.start_from={source}: no final run of {side} at 1x there (a study's 1x choice "
                            "is recorded once its tuning is done)")
        for name, node in study["spaces"][side].items():
            if name in SPACE_FIELDS or name not in chosen:
                continue
            if not isinstance(node, dict) or "step" not in node:
                raise PlanError(f"spaces.{side}.{name}: tuning.start_from moves a grid of init, step and points "
                                "only (this one is a list or a range)")
            node["init"] = chosen[name]
    return [f"each side starts at the 1x choice of {source} (tuning.start_from)"]


def hold_dims(study: dict, spaces: dict) -> tuple[dict, list[str]]:
    """tuning.dims: the dims both sides tune; every other dim is held at its init, as fixed
    overrides. Returns the spaces' config nodes so reduced, and the plan's notes."""
    from eval.fair.search_space import held_overrides

    names = study["tuning"].get("dims")
    nodes = {side: study["spaces"][side] for side in spaces}
    if names is None:
        return nodes, []
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise PlanError(f"tuning.dims must be a non-empty list of dimension names, got {names!r}")
    for name in names:
        missing = [side for side, space in spaces.items() if name not in space.names]
        if missing:
            raise PlanError(f"tuning.dims: {name} is not a dimension of {', '.join(missing)}; "
                            "a study tunes the same dimensions on both sides")
    held_names = []
    for side, space in spaces.items():
        held = [d for d in space.dims if d.name not in names]
        node = {k: v for k, v in nodes[side].items() if k not in {d.name for d in held}}
        node["fixed"] = [*space.fixed, *(o for d in held for o in held_overrides(d))]
        nodes[side] = node
        held_names = [d.name for d in held]
    note = f"tuned: {', '.join(names)}; held at their init: {', '.join(held_names) or 'none'} (tuning.dims)"
    return nodes, [note]


def run_overrides(study_train: list[str], side_overrides: list[str], fraction: float, steps: int, seed: int,
                  objective: Optional[str] = None, eval_interval: int = 0) -> list[str]:
    """The train.py overrides of one run of the study, the base's first."""
    runs = [*study_train, *side_overrides, f"data.tune_fraction={fraction}", f"trainer.max_steps={steps}",
            f"seed={seed}", f"eval.interval={eval_interval}", "checkpoint.interval=0"]
    if objective is not None:
        runs.append(f"eval.objective={objective}")
    return runs


def check_runs_compose(study: dict, spaces: dict, train: list[str]) -> None:
    """Compose and check, as train.py would, the two corners of each side's grids (every
    dimension at its lowest point, then at its highest): a value a run would refuse stops the
    study here, named by its side (the checks are ranges, so the corners hold every point)."""
    from eval.fair.search_space import trial_overrides
    from trainer.config import ConfigError, register_configs
    from trainer.run.preflight import check_config, compose

    register_configs()
    fraction = float(study["tuning"]["split_fraction"])
    for side, space in spaces.items():
        corners = [("lowest", {d.name: min(d.grid) for d in space.dims}),
                   ("highest", {d.name: max(d.grid) for d in space.dims})]
        for what, values in corners:
            overrides = run_overrides(train, trial_overrides(space, values), fraction, 1, 0, "val/tune/loss")
            try:
                check_config(compose(overrides, str(CONF)), 1)
            except (ConfigError, ValueError) as err:
                raise PlanError(f"spaces.{side} ({what} point of every grid): {err}") from err


def base_config(train: list[str], fraction: float) -> Any:
    """The TrainConfig of the study's base overrides: its batch and steps, before any trial's."""
    from trainer.config import to_dataclass
    from trainer.run.preflight import compose

    return to_dataclass(compose([*train, f"data.tune_fraction={fraction}"], str(CONF)))


def run_steps(plan: "Plan", space: Any, values: dict[str, float], budget: float) -> tuple[int, int]:
    """(steps, tokens) of one run at `budget`: a trial that sets trainer.batch_size (a batch
    dimension, opened on both sides) runs as many tokens as the base batch would, in more or
    fewer steps."""
    steps, tokens_per_step = plan.steps(budget), plan.tokens_per_step
    batch = next((values[d.name] for d in space.dims if "trainer.batch_size" in d.keys), None)
    if batch:
        base = plan.compare["batch_size"]
        steps = max(1, int(math.floor(steps * base / batch + 0.5)))
        tokens_per_step = tokens_per_step * int(batch) // base
    return steps, steps * tokens_per_step


def build_plan(name: str, study: dict, command_train: list[str]) -> Plan:
    """The checked plan of a study (PlanError in one line), before anything is written."""
    from omegaconf import OmegaConf

    from eval.fair.space_config import parse_space

    check_settings(study)
    notes = start_from(study)
    spaces = parsed_spaces(study)
    dim_keys = {key for space in spaces.values() for dim in space.dims for key in dim.keys}
    check_train_overrides(command_train, dim_keys)
    nodes, held = hold_dims(study, spaces)
    spaces = {side: parse_space(side, node) for side, node in nodes.items()}
    train = [*study.get("train", []), *command_train]
    check_runs_compose(study, spaces, train)
    typed = base_config(train, float(study["tuning"]["split_fraction"]))
    t = typed.trainer
    compare = dict(study["compare"])
    steps_1x = compare.get("steps") or t.max_steps
    budgets = sorted(float(b) for b in set(compare["budgets"]))
    dp = max(1, typed.parallel.dp_replicate) * max(1, typed.parallel.dp_shard)
    tokens_per_step = t.batch_size * t.seq_len * t.grad_accum * dp
    compare.update(steps_1x=steps_1x, budgets=budgets, steps=[steps_of(steps_1x, b) for b in budgets],
                   batch_size=t.batch_size)
    tuning = dict(study["tuning"], objective="val/tune/loss")
    n_tune_seeds = len(tuning["seeds"])
    retune = compare["retune"]["trials"]
    runs = {"tune": tuning["trials"] * n_tune_seeds, "retune": retune * n_tune_seeds * (len(budgets) - 1),
            "final": len(compare["seeds"]) * len(budgets)}
    steps = {"tune": runs["tune"] * steps_1x,
             "retune": retune * n_tune_seeds * sum(compare["steps"][1:]),
             "final": len(compare["seeds"]) * sum(compare["steps"])}
    tokens = {k: v * tokens_per_step for k, v in steps.items()}
    tokens["total"] = sum(tokens.values())
    model = OmegaConf.to_container(OmegaConf.structured(typed.model))
    data = OmegaConf.to_container(OmegaConf.structured(typed.data))
    return Plan(name=name, target=study["target"], baseline=study["baseline"], train=train,
                spaces=nodes, tuning=tuning, compare=compare,
                stats=dict(study["stats"]), tokens_per_step=tokens_per_step,
                budget_per_side={"runs": runs, "tokens": tokens}, model=model, data=data,
                notes=["tokens per step count one process's batch" if dp == 1 else f"tokens per step over {dp} DP ranks",
                       *notes, *held])


def probe_step_seconds(plan: Plan, side: str, steps: int = 3) -> float:
    """Seconds per training step of `side`'s first trial, timed here: its model and optimizer
    built as a run builds them, `steps` steps on random tokens after one warm-up (no data read,
    nothing written)."""
    import torch

    from eval.fair.search_space import trial_overrides
    from eval.fair.space_config import parse_space
    from optim.builder import build_optimizer
    from parallel.mesh import Mesh
    from trainer.build import build_model
    from trainer.config import to_dataclass
    from trainer.device import resolve_device
    from trainer.run.preflight import compose

    space = parse_space(side, plan.spaces[side])
    overrides = run_overrides(plan.train, trial_overrides(space, {d.name: d.init for d in space.dims}),
                              plan.tuning["split_fraction"], plan.compare["steps_1x"], 0)
    cfg = to_dataclass(compose(overrides, str(CONF)))
    device = resolve_device(cfg.trainer.device, 0)
    model = build_model(cfg, cfg.data.vocab_size, Mesh(), device)
    optimizer = build_optimizer(model, cfg.optim, model.cfg)
    t = cfg.trainer
    tokens = torch.randint(0, cfg.data.vocab_size, (t.batch_size * t.grad_accum, t.seq_len + 1), device=device)
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.prepare_grads(cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


# A run's time besides its steps: start-up (data from the cache, the build), its evaluations and
# its end checkpoint, on a small model; measured on the smoke study.
RUN_OVERHEAD_S = 3.0


def estimate_seconds(plan: Plan, step_s: dict[str, float]) -> dict[str, float]:
    """Seconds per stage, both sides, from each side's seconds per step (evaluations count as a
    third of a step each, for a forward pass of eval.batches)."""
    c, t = plan.compare, plan.tuning
    per_stage = {"tune": 0.0, "retune": 0.0, "final": 0.0}
    for side in plan.sides:
        s = step_s[side]
        if plan.chosen:  # a rerun: the final runs only
            per_stage["final"] += len(c["seeds"]) * sum(n * s + c["eval_points"] * s / 3 + RUN_OVERHEAD_S
                                                        for n in c["steps"])
            continue
        per_stage["tune"] += t["trials"] * len(t["seeds"]) * (c["steps_1x"] * s + RUN_OVERHEAD_S)
        per_stage["retune"] += sum(c["retune"]["trials"] * len(t["seeds"]) * (n * s + RUN_OVERHEAD_S)
                                   for n in c["steps"][1:])
        per_stage["final"] += len(c["seeds"]) * sum(n * s + c["eval_points"] * s / 3 + RUN_OVERHEAD_S
                                                    for n in c["steps"])
    per_stage["total"] = sum(per_stage.values())
    return per_stage


def plan_lines(plan: Plan, seconds: Optional[dict[str, float]] = None) -> list[str]:
    """The plan as --dry-run prints it."""
    from eval.fair.space_config import parse_space

    c, t, b = plan.compare, plan.tuning, plan.budget_per_side
    lines = [f"study {plan.name}: {plan.target} (target) against {plan.baseline} (baseline), model "
             f"{plan.model.get('name')}, data {plan.data.get('name')}; tuning split data.tune_fraction="
             f"{t['split_fraction']} (a corpus id of its own, known after the first run)",
             f"batch: {plan.tokens_per_step:,} tokens per step ({plan.notes[0]}), the same for both sides",
             f"budgets: {', '.join(f'{x:g}x = {n} steps' for x, n in zip(c['budgets'], c['steps']))}",
             f"seeds: tuning {t['seeds']}, fresh for the comparison {c['seeds']}"]
    for side in plan.sides:
        space = parse_space(side, plan.spaces[side])
        lines.append(f"{side}: {len(space.dims)} dimensions: " + "; ".join(
            f"{d.name} {'/'.join(f'{v:.4g}' for v in d.grid)}" for d in space.dims))
    lines += plan.notes[1:]
    runs, tokens = b["runs"], b["tokens"]
    lines.append(f"per side (equal: yes): tuning {runs['tune']} trials, {tokens['tune']:,} tokens; lr retuned at "
                 f"the longer budgets {runs['retune']} runs, {tokens['retune']:,} tokens; final {runs['final']} runs, "
                 f"{tokens['final']:,} tokens; in all {sum(runs.values())} runs, {tokens['total']:,} tokens")
    if seconds is not None:
        lines.append("estimated time here: " + ", ".join(f"{k} {_hms(v)}" for k, v in seconds.items()))
    return lines


def _hms(seconds: float) -> str:
    minutes = int(seconds // 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{int(seconds % 60):02d}s"
