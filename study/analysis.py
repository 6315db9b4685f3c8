"""Everything a fair study's report says, worked out once from its records (study/records.py):
the speedup per split (study/speedup.py) and its second readings (study/sensitivity.py), how well
each side was searched (study/search_state.py), what the study's scale leaves open (tokens per
parameter, tokens per step, epochs), and which optimizer stepped which parameters in its runs.
study/report.py writes it down; study/ladder.py lays several studies side by side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from study.records import TUNE_KEY, VAL_KEY, Entry, StudyData, chosen_settings, final_loss
from study.search_state import SearchState, study_states
from study.sensitivity import PowerLawSpeedup, anchored, power_law_speedup, replay_k, still_moving
from study.speedup import Comparison, Ratio, Side, compare_splits, mean

# Below this many training tokens a non-embedding parameter at 1x, a study sees the opening of
# training: compute-optimal training runs about 20 (Chinchilla), and the optimizers' order can
# change after the opening.
OPENING_TOKENS_PER_PARAM = 1.0
INTERVAL_WORDS = "seed noise given the chosen settings"


def reported_splits(data: StudyData) -> list[str]:
    """val/val/loss and each OOD set's loss, as the final runs logged them; never the tuning split."""
    keys = {key for series in data.series.values() for key in series
            if key.startswith("val/") and key.endswith("/loss") and key != TUNE_KEY}
    return sorted(keys, key=lambda k: (k != VAL_KEY, k))


def trials_by_ordinal(entries: list[Entry]) -> tuple[np.ndarray, np.ndarray | None, list[Entry]]:
    """(each proposal's objective, its mean over the tuning seeds; [trials, seeds] when 2+ seeds,
    else None; the first entry of each proposal), in the order the search made them."""
    by: dict[int, list[Entry]] = {}
    for e in entries:
        by.setdefault(e.ordinal, []).append(e)
    ordinals = sorted(by)
    per_seed = [[e.score for e in sorted(by[o], key=lambda e: e.seed)] for o in ordinals]
    means = np.array([math.inf if any(math.isinf(s) for s in row) else mean(row) for row in per_seed])
    seeds = np.array(per_seed) if per_seed and len(per_seed[0]) > 1 else None
    return means, seeds, [by[o][0] for o in ordinals]


def chosen_values(data: StudyData, side: str) -> dict[float, dict[str, float]]:
    """Each budget's settings of `side`, in the plan's order of budgets."""
    chosen = chosen_settings(data.entries, side)
    return {b: chosen[b] for b in data.plan["compare"]["budgets"] if b in chosen}


def side_inputs(data: StudyData, side: str, split: str) -> Side:
    plan = data.plan
    budgets, steps = plan["compare"]["budgets"], plan["compare"]["steps"]
    seeds = plan["compare"]["seeds"]
    finals = np.full((len(budgets), len(seeds)), math.inf)
    noise = []
    for i, (b, n) in enumerate(zip(budgets, steps)):
        tune_losses = []
        for j, s in enumerate(seeds):
            series = data.series.get(f"final/{side}/{b:g}x/seed{s}", {})
            finals[i, j] = final_loss(series, split, n)
            tune_losses.append(final_loss(series, TUNE_KEY, n))
        finite = sorted(v for v in tune_losses if math.isfinite(v))
        noise.append(float(np.std(finite, ddof=1)) if len(finite) > 1 else 0.0)
    selection, selection_seeds = [], []
    for i, b in enumerate(budgets):
        entries = data.of("tune", side) if i == 0 else data.of("retune", side, b)
        means, per_seed, _ = trials_by_ordinal(entries)
        selection.append(means)
        selection_seeds.append(per_seed)
    tokens = tuple(float(n * plan["tokens_per_step"]) for n in steps)
    return Side(tokens, finals, tuple(seeds), tuple(selection), None, tuple(selection_seeds), tuple(noise))


def comparisons(data: StudyData, splits: Optional[list[str]] = None) -> dict[str, Comparison]:
    plan, stats = data.plan, data.plan["stats"]
    splits = reported_splits(data) if splits is None else splits
    targets = {k: side_inputs(data, plan["target"], k) for k in splits}
    bases = {k: side_inputs(data, plan["baseline"], k) for k in splits}
    return compare_splits(targets, bases, stats["bootstrap"], stats["seed"], stats["thresholds"])


def model_params(model: dict, vocab_size: int = 8) -> tuple[int, int]:
    """(non-embedding parameters, those one token goes through) of a plan's model config, counted
    on a model built on the meta device (no memory)."""
    import torch

    from model.config import ModelConfig
    from model.gpt import GPT

    cfg = ModelConfig(**{**model, "vocab_size": vocab_size})
    with torch.device("meta"):
        gpt = GPT(cfg)
    params = gpt.num_params(non_embedding=True)
    routed = sum(p.numel() for name, p in gpt.named_parameters() if ".experts." in name)
    active = params - routed + (routed * cfg.top_k // cfg.n_experts if cfg.n_experts else 0)
    return params, active


def model_text(model: dict) -> str:
    """The model by its shape, not only its preset's name: "gpt_tiny (4 layers, width 64,
    0.20M non-embedding parameters)", an MoE with its experts and active parameters."""
    params, active = model_params(model)
    shape = f"{model.get('n_layers')} layers, width {model.get('d_model')}, {params / 1e6:.2f}M non-embedding parameters"
    if model.get("n_experts"):
        shape += (f", {model['n_experts']} experts (top {model.get('top_k')}), {active / 1e6:.2f}M of them active "
                  "per token")
    return f"{model.get('name')} ({shape})"


def census_from_config(config: dict[str, Any]) -> dict[str, dict[str, dict[str, int]]]:
    """Which optimizer steps which family, for a run's config (the model built on meta, routed
    as the run routed it): for records made before runs wrote it into environment.json."""
    import torch

    from model.config import ModelConfig
    from model.gpt import GPT
    from optim.routing import routing_census

    model = dict(config["model"])
    vocab = model.get("vocab_size") or (config.get("data") or {}).get("vocab_size") or 8
    with torch.device("meta"):
        gpt = GPT(ModelConfig(**{**model, "vocab_size": vocab}))
    return routing_census(gpt, config["optim"]["name"])


@dataclass
class Scale:
    """What the study's size and tokens were: what a reader must know before carrying its speedup
    elsewhere, and what a ladder must hold equal to speak of size."""

    params: int                     # non-embedding parameters (every expert's)
    active: int                     # those one token goes through
    tokens_per_step: int
    steps: list[int]                # per budget
    train_tokens: Optional[int]     # the corpus's training split (a run's environment.json)
    trials: int                     # tuning trials a side
    dims_tuned: int
    seeds: int
    muon_share: Optional[float]     # of all parameters, the share the target's Muon steps

    @property
    def tokens_1x(self) -> int:
        return self.steps[0] * self.tokens_per_step

    @property
    def tokens_per_param(self) -> float:
        return self.tokens_1x / self.active

    @property
    def epochs_max(self) -> Optional[float]:
        return self.steps[-1] * self.tokens_per_step / self.train_tokens if self.train_tokens else None

    def opening_warning(self) -> Optional[str]:
        if self.tokens_per_param >= OPENING_TOKENS_PER_PARAM:
            return None
        return (f"{self.tokens_per_param:.3g} tokens a non-embedding parameter at 1x, below "
                f"{OPENING_TOKENS_PER_PARAM:g}: this result is for the opening of training, not for a model trained "
                "to its end (compute-optimal training is about 20)")


@dataclass
class Analysis:
    data: StudyData
    splits: list[str]
    results: dict[str, Comparison]
    tune: Optional[Comparison]                 # the same speedup on the tuning split
    power: dict[str, PowerLawSpeedup]
    anchored: dict[str, list[Ratio]]           # per split, anchored at each budget
    replayed: dict[str, list[Ratio]]           # per split, with the first k = 1.. trials a side
    states: dict[str, SearchState]
    scale: Scale
    census: dict[str, tuple[dict[str, dict[str, dict[str, int]]], str]] = field(default_factory=dict)

    @property
    def plan(self) -> dict[str, Any]:
        return self.data.plan

    @property
    def resolved(self) -> bool:
        return all(state.converged for state in self.states.values())

    def unresolved_line(self) -> Optional[str]:
        if self.resolved:
            return None
        sides = [side for side, state in self.states.items() if not state.converged]
        who = " and ".join(sides) + (" did" if len(sides) > 1 else " did")
        return (f"Unresolved: the search of {who} not converge (see Search). The figures below are for the settings "
                "chosen; no p-value is given for them, and a ladder leaves this study out of its trend.")

    def moving(self, split: str) -> Optional[str]:
        return still_moving(self.replayed[split], self.results[split])

    def extend_hint(self, split: str) -> Optional[str]:
        """For a crossing past the budgets run: the budget that would contain it, and how to add it."""
        ratio = self.results[split].ratio
        if not ratio.censored:
            return None
        budgets = self.plan["compare"]["budgets"]
        power = self.power.get(split)
        need = None
        if power is not None and power.value is not None:
            need = power.value if ratio.bound == ">" else 1 / power.value
        if need is None or need <= budgets[-1]:
            need = 2 * budgets[-1]
            how = "the power law gives no crossing; twice the longest budget"
        else:
            how = f"the power law reads {need:.2f}x"
        new = math.ceil(need * 2) / 2
        listed = ",".join(f"{b:g}" for b in [*budgets, new])
        slower = self.plan["baseline"] if ratio.bound == ">" else self.plan["target"]
        return (f"{split}: {slower} does not reach the other side's 1x loss within {budgets[-1]:g}x ({how}): a budget "
                f"of {new:g}x should contain the crossing; run the study's command again with "
                f"compare.budgets=[{listed}]: it trains only that budget's runs")


def scale_of(data: StudyData, census: dict[str, tuple[dict, str]]) -> Scale:
    plan = data.plan
    params, active = model_params(plan["model"])
    train_tokens = None
    for env in data.environments.values():
        train_tokens = ((env.get("corpus") or {}).get("splits") or {}).get("train", {}).get("tokens")
        if train_tokens:
            break
    share = None
    target = census.get(plan["target"])
    if target:
        counts = {opt: sum(k["params"] for k in kinds.values()) for opt, kinds in target[0].items()}
        total = sum(counts.values())
        share = counts.get("muon", 0) / total if total else None
    return Scale(params, active, plan["tokens_per_step"], list(plan["compare"]["steps"]), train_tokens,
                 int(plan["tuning"]["trials"]), 0, len(plan["compare"]["seeds"]), share)


def census_of(data: StudyData, side: str) -> Optional[tuple[dict[str, dict[str, dict[str, int]]], str]]:
    """(which optimizer stepped which family in `side`'s runs, where that was read): from a final
    run's environment.json, or for older records from its config."""
    names = sorted(e.name for e in data.of("final", side))
    for name in names:
        recorded = data.environments.get(name, {}).get("optimizers")
        if recorded:
            return recorded, "the runs' environment.json"
    for name in names:
        config = data.configs.get(name)
        if config and "model" in config and "optim" in config:
            return census_from_config(config), "the runs' configs (older runs did not record it)"
    return None


def analyse(data: StudyData, results: Optional[dict[str, Comparison]] = None) -> Analysis:
    plan = data.plan
    stats = plan["stats"]
    splits = reported_splits(data)
    results = comparisons(data, splits) if results is None else results
    targets = {k: side_inputs(data, plan["target"], k) for k in splits}
    bases = {k: side_inputs(data, plan["baseline"], k) for k in splits}
    tune = None
    if any(TUNE_KEY in series for series in data.series.values()):
        tune = comparisons(data, [TUNE_KEY])[TUNE_KEY]
    power = {k: power_law_speedup(targets[k], bases[k], stats["bootstrap"], stats["seed"]) for k in splits}
    trials = min(len(targets[splits[0]].selection[0]), len(bases[splits[0]].selection[0])) if splits else 0
    replayed = {k: [replay_k(targets[k], bases[k], n) for n in range(1, trials + 1)] for k in splits}
    census = {side: found for side in (plan["target"], plan["baseline"]) if (found := census_of(data, side))}
    states = study_states(plan, data.entries)
    scale = scale_of(data, census)
    scale.dims_tuned = sum(1 for d in states[plan["target"]].dims if d.tuned)
    return Analysis(data, splits, results, tune, power, {k: anchored(targets[k], bases[k]) for k in splits},
                    replayed, states, scale, census)
