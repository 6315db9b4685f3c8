"""The plan of a fair Muon-vs-AdamW study (scripts/fair_compare.py): the checked study config
(study/checks.py), the runs and tokens it will spend on each side, and how it reads to a user.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from study.checks import (PlanError, check_runs_compose, check_settings, check_train_overrides, hold_dims,
                          parsed_spaces, start_from)
from study.runs import base_config, steps_of

PLAN_FORMAT = 1


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
    # (study/rerun.py), which runs the final stage only; empty for a study that tunes.
    chosen: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # The study's id, made when its plan is first written and carried by every run it records
    # (its index line and logger.run_info.study); "" in studies made before ids.
    study_id: str = ""
    # The ids of the studies whose tuning records a rerun copied in (study/rerun.py).
    adopted: list[str] = field(default_factory=list)
    # {side: its whole space, held settings included, as the study starts it}: what the screen
    # tries (study/screen.py); empty for a study without a screen.
    full_spaces: dict[str, dict] = field(default_factory=dict)

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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def steps(self, budget: float) -> int:
        return steps_of(self.compare["steps_1x"], budget)


def screen_runs(plan: Plan) -> int:
    """The screen's runs a side: its start on the tuning and noise seeds, each neighbour on the
    tuning seeds (study/screen.py); 0 without a screen."""
    if not plan.tuning.get("screen") or not plan.full_spaces:
        return 0
    from study.screen import full_space, screen_trials

    trials = len(screen_trials(full_space(plan.as_dict(), plan.target)))
    seeds = len(plan.tuning["seeds"])
    return seeds + len(plan.tuning.get("noise_seeds") or []) + (trials - 1) * seeds


def planned_runs(plan: Plan) -> tuple[int, int]:
    """(runs, steps) the study trains in all, both sides: a rerun its final stage only."""
    c, t = plan.compare, plan.tuning
    finals = len(c["seeds"]) * len(c["budgets"]), len(c["seeds"]) * sum(c["steps"])
    if plan.chosen:
        return 2 * finals[0], 2 * finals[1]
    seeds, retune, screen = len(t["seeds"]), c["retune"]["trials"], screen_runs(plan)
    runs = screen + t["trials"] * seeds + retune * seeds * (len(c["budgets"]) - 1) + finals[0]
    steps = (screen + t["trials"] * seeds) * c["steps_1x"] + retune * seeds * sum(c["steps"][1:]) + finals[1]
    return 2 * runs, 2 * steps


def build_plan(name: str, study: dict, command_train: list[str]) -> Plan:
    """The checked plan of a study (PlanError in one line), before anything is written."""
    from omegaconf import OmegaConf

    from study.space_config import parse_space

    import copy

    check_settings(study)
    notes = start_from(study)
    spaces = parsed_spaces(study)
    full = {side: copy.deepcopy(study["spaces"][side]) for side in spaces} if study["tuning"].get("screen") else {}
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
    plan = Plan(name=name, target=study["target"], baseline=study["baseline"], train=train,
                spaces=nodes, tuning=tuning, compare=compare,
                stats=dict(study["stats"]), tokens_per_step=tokens_per_step,
                budget_per_side={"runs": runs, "tokens": tokens}, model=model, data=data,
                notes=["tokens per step count one process's batch" if dp == 1 else f"tokens per step over {dp} DP ranks",
                       *notes, *held], full_spaces=full)
    if full:
        check_screen(plan)
        runs["screen"] = screen_runs(plan)
        tokens["screen"] = runs["screen"] * steps_1x * tokens_per_step
        tokens["total"] += tokens["screen"]
    return plan


def check_screen(plan: Plan) -> None:
    """Both sides screen as many settings (PlanError otherwise): the screen's budget is equal."""
    from study.screen import full_space, screen_trials

    counts = {side: len(screen_trials(full_space(plan.as_dict(), side))) - 1 for side in plan.sides}
    if len(set(counts.values())) > 1:
        raise PlanError(f"tuning.screen: the sides have {', '.join(f'{n} screen trials ({s})' for s, n in counts.items())}"
                        "; the screen needs as many settings, each with a step either side, on both")


def plan_lines(plan: Plan) -> list[str]:
    """The plan as the study (and --dry-run) prints it first."""
    from study.space_config import parse_space

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
    screen = (f"screen {runs['screen']} runs (every setting one step either side of the start; the start also on "
              f"tuning.noise_seeds {t.get('noise_seeds')}), {tokens['screen']:,} tokens; " if runs.get("screen") else "")
    lines.append(f"per side (equal: yes): {screen}tuning {runs['tune']} trials, {tokens['tune']:,} tokens; lr retuned "
                 f"at the longer budgets {runs['retune']} runs, {tokens['retune']:,} tokens; final {runs['final']} runs, "
                 f"{tokens['final']:,} tokens; in all {sum(runs.values())} runs, {tokens['total']:,} tokens")
    return lines + scale_lines(plan)


def scale_lines(plan: Plan) -> list[str]:
    """Tokens per parameter, and the warning a short study needs (study/analysis.py's threshold)."""
    from study.analysis import OPENING_TOKENS_PER_PARAM, model_params

    params, active = model_params(plan.model)
    tokens_1x = plan.compare["steps"][0] * plan.tokens_per_step
    per_param = tokens_1x / active
    lines = [f"scale: {params / 1e6:.2f}M non-embedding parameters" + (f" ({active / 1e6:.2f}M active)" if active != params
             else "") + f"; 1x = {tokens_1x:,} tokens = {per_param:.3g} tokens a non-embedding parameter; epochs: known "
             "after the first run (the report gives them)"]
    if per_param < OPENING_TOKENS_PER_PARAM:
        lines.append(f"warning: {per_param:.3g} tokens a parameter at 1x, below {OPENING_TOKENS_PER_PARAM:g}: the result "
                     "will be for the opening of training, not for a model trained to its end (compute-optimal "
                     "training is about 20)")
    return lines

