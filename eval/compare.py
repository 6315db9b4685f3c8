"""Run comparison maths: reading runs, EWM smoothing, best-lr selection, "leading steps".

Leading steps (the Moonlight authors' Muon-vs-AdamW view): for each logged step of run A,
the first step at which run B's loss is at or below A's loss there. The difference says
how many steps B needs beyond A to reach the same loss; the ratio B/A is A's step
efficiency over B. Curves are EWM-smoothed first, with a light default (alpha 0.05):
heavy smoothing (alpha 0.005) was seen to hide the real curves.
"""
from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from optim.config import OptimConfig
from eval.environment import read_environment, summary_line

Series = tuple[list[int], list[float]]

# What a run logs; a committed run record (eval/run_records.py) holds the same bytes gzipped.
METRICS = "metrics.jsonl"
RECORDED_METRICS = "metrics.jsonl.gz"

# libyaml's parser where PyYAML has it (its wheels do): a study's report reads one config per run,
# and the pure-Python parser was most of that report's time.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping file ({} when empty), as yaml.safe_load reads it."""
    return yaml.load(path.read_text(), Loader=_YAML_LOADER) or {}


@dataclass
class Run:
    path: Path
    optimizer: str
    lr: Optional[float]
    series: dict[str, Series] = field(default_factory=dict)
    corpus_id: Optional[str] = None  # None: the run recorded none (it predates corpus ids)
    environment: Optional[dict] = None  # its environment.json
    config: dict = field(default_factory=dict)  # its .hydra/config.yaml ({} when absent)

    @property
    def seed(self) -> Optional[int]:
        seed = self.config.get("seed")
        return None if seed is None else int(seed)

    @property
    def corpus(self) -> str:
        return self.corpus_id or "unknown"

    def describe(self) -> str:
        env = (summary_line(self.environment) + pipeline_words(self.environment) if self.environment
               else "no environment.json")
        return f"{self.label}: corpus {self.corpus}; {env} ({self.path})"

    @property
    def label(self) -> str:
        label = f"{self.optimizer} lr={self.lr:g}" if self.lr is not None else self.optimizer
        clip = self.config.get("optim", {}).get("qk_clip", {})
        if clip.get("enabled"):
            label += f" qk_clip tau={float(clip['tau']):g}"
        return label

    def unfinished(self) -> Optional[str]:
        """Why the run cannot count as finished: it logged fewer steps than its
        trainer.max_steps (still running, killed, or stopped by divergence). None otherwise,
        or when its config does not say how long it was meant to be. A run that has logged no
        training step yet (just started) is unfinished too."""
        planned = self.config.get("trainer", {}).get("max_steps")
        last = final_step(self, "train/loss")
        if planned is None or (last is not None and last >= int(planned)):
            return None
        if last is None:
            return f"{self.path} logged no training step yet of its {planned}"
        return f"{self.path} logged up to step {last} of its {planned}"

    def final(self, key: str) -> Optional[float]:
        return self.series[key][1][-1] if key in self.series and self.series[key][1] else None


def _read_jsonl(path: Path) -> dict[str, Series]:
    """Every metric's (steps, values), in step order. A resumed run logs again the steps
    after the checkpoint it resumed from; the later record of a step wins, as it is the one
    the run continued from."""
    by_step: dict[str, dict[int, float]] = {}
    data = path.read_bytes()
    text = (gzip.decompress(data) if path.name.endswith(".gz") else data).decode("utf-8")
    for line in text.splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        for key, value in record.items():
            if key in ("step", "tokens"):
                continue
            by_step.setdefault(key, {})[int(record["step"])] = float(value)
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_step.items()}


def _read_tensorboard(path: Path) -> dict[str, Series]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: ([e.step for e in acc.Scalars(tag)], [e.value for e in acc.Scalars(tag)])
            for tag in acc.Tags()["scalars"]}


def load_run(path: Path) -> Run:
    """A run dir: metrics.jsonl if present (or its run record's metrics.jsonl.gz), else the
    TensorBoard events under tb/."""
    if (path / METRICS).exists():
        series = _read_jsonl(path / METRICS)
    elif (path / RECORDED_METRICS).exists():
        series = _read_jsonl(path / RECORDED_METRICS)
    elif (path / "tb").is_dir():
        series = _read_tensorboard(path / "tb")
    else:
        raise FileNotFoundError(f"{path}: no {METRICS}, {RECORDED_METRICS} or tb/ in this run dir")
    config_file = path / ".hydra" / "config.yaml"
    config = read_yaml(config_file) if config_file.exists() else {}
    optim = config.get("optim", {})
    optimizer, lr = (optimizer_setting(optim) if "name" in optim else path.name), optim.get("lr")
    environment = read_environment(path)
    corpus = run_corpus_id(environment)
    resolved = path / "resolved_config.yaml"
    if corpus is None and resolved.exists():
        corpus = read_yaml(resolved).get("corpus_id")
    return Run(path, optimizer, lr, series, corpus, environment, config)


def optimizer_setting(optim: dict) -> str:
    """The optimizer a run used, with the Muon-family options it switched on and the
    per-family lr and weight decay it set (per_family_settings): "muon",
    "muon+normuon+cautious_wd", "adamw+cautious_wd", "muon+lr×(embed, head, norm: 0.1)+wd=0.3".
    Runs that differ in these are different optimizers to every table: each gets its own best
    lr and its own row.

    ns_method=gram is "gram_ns" and ns_method=auto "auto_ns": auto runs Gram on the shapes
    where it measured faster, so its arithmetic is neither plain Muon's nor gram's."""
    name = str(optim["name"])
    muon = optim.get("muon", {}) if name == "muon" else {}
    beta2 = muon.get("normuon_beta2", 0.95)
    normuon = "normuon" if beta2 == 0.95 else f"normuon(beta2={beta2:g})"
    ns_method = muon.get("ns_method", "standard")
    options = [label for label, on in ((normuon, muon.get("normuon")),
                                       ("cautious_wd", optim.get("cautious_wd")),
                                       (f"{ns_method}_ns", ns_method != "standard")) if on]
    return "+".join([name, *options, *per_family_settings(optim)])


def per_family_settings(optim: dict) -> list[str]:
    """The lr multipliers and weight decays a run set away from the defaults, as parts of its
    setting's name: "lr×(embed, head, norm: 0.1)", "wd=0.3", "wd(attn_o, mlp_out: 0.3)".

    They are part of the setting, not only of the label, so that runs differing in them never
    compete for one best lr and each gets its own row in every table, with its difference from
    the plain setting paired by seed, as NorMuon does.

    optim.weight_decay is named whenever it is not OptimConfig's default (0.1), rather than only
    where the compared runs differ: a name that depends on which runs are compared could not key
    the best-lr choice, and a run at the default keeps today's name ("muon"), so a 0.1-vs-0.3
    comparison reads "muon" against "muon+wd=0.3". Overrides equal to what a family gets
    anyway (an lr multiplier of 1, a weight decay equal to optim.weight_decay) change nothing,
    so they are left out of the name."""
    weight_decay = float(optim.get("weight_decay", OptimConfig.weight_decay))
    parts = [overrides_text("lr×", optim.get("lr_overrides") or {}, 1.0)]
    if weight_decay != OptimConfig.weight_decay:
        parts.append(f"wd={weight_decay:g}")
    parts.append(overrides_text("wd", optim.get("weight_decay_overrides") or {}, weight_decay))
    return [part for part in parts if part]


def overrides_text(prefix: str, overrides: dict, neutral: float) -> str:
    """`prefix(embed, head, norm: 0.1)`: a per-family dict, families sorted, those with one
    value named once ("lr×(embed: 0.5; head, norm: 0.1)"), so that six Muon families at one
    weight decay stay one short group. "" when no entry differs from `neutral`."""
    by_value: dict[float, list[str]] = {}
    for kind in sorted(overrides):
        if float(overrides[kind]) != neutral:
            by_value.setdefault(float(overrides[kind]), []).append(kind)
    if not by_value:
        return ""
    groups = "; ".join(f"{', '.join(kinds)}: {value:g}" for value, kinds in by_value.items())
    return f"{prefix}({groups})"


def pipeline_words(environment: dict) -> str:
    """"; pp 2 (1f1b, blocks per stage 1, 1)" for a run with a pipeline (environment.json's
    layout: pp, pp_schedule, pp_stages_per_rank, pp_layers_per_stage, as trainer/run/environment.py
    records them), "" without one: a record with no pp key predates pipelines (pp 1)."""
    layout = environment.get("layout") or {}
    pp = layout.get("pp", 1)
    if pp <= 1:
        return ""
    details = [str(layout.get("pp_schedule", "schedule unknown"))]
    if layout.get("pp_stages_per_rank", 1) > 1:
        details.append(f"{layout['pp_stages_per_rank']} stages per rank")
    if layout.get("pp_layers_per_stage"):
        details.append("blocks per stage " + ", ".join(map(str, layout["pp_layers_per_stage"])))
    return f"; pp {pp} ({', '.join(details)})"


def run_corpus_id(environment: Optional[dict]) -> Optional[str]:
    """The corpus id of a run's record; "a+b" when a resume went on with another corpus, so
    that such a run never matches a run on either corpus alone."""
    if not environment:
        return None
    ids: list[str] = []
    for start in [environment, *environment.get("resumes", [])]:
        cid = (start.get("corpus") or {}).get("id")
        if cid is not None and cid not in ids:
            ids.append(cid)
    return "+".join(ids) or None


def mixed_corpora(runs: list[Run]) -> Optional[str]:
    """None when every run trained on one corpus; else one line naming each corpus id with a
    run on it. Losses on other tokens are not comparable, so comparing them is refused."""
    by_corpus: dict[str, Run] = {}
    for run in runs:
        by_corpus.setdefault(run.corpus, run)
    if len(by_corpus) < 2:
        return None
    named = ", ".join(f"corpus {cid} ({run.path})" for cid, run in by_corpus.items())
    return f"runs trained on different corpora: {named}"


def find_runs(path: Path) -> list[Path]:
    """The run dirs (or run records) at or below `path` (a single run, or a sweep dir of runs)."""
    def is_run(p: Path) -> bool:
        return (p / METRICS).exists() or (p / RECORDED_METRICS).exists() or (p / "tb").is_dir()

    if is_run(path):
        return [path]
    found = {p.parent for name in (METRICS, RECORDED_METRICS) for p in path.rglob(name)}
    found |= {p.parent for p in path.rglob("tb") if p.is_dir()}
    if not found:
        raise FileNotFoundError(f"{path}: no runs ({METRICS}, {RECORDED_METRICS} or tb/) found here or below")
    return sorted(found)


def best_per_optimizer(runs: list, key: str = "val/val/loss") -> list:
    """For each optimizer, the run (or the arm of seeds, by its mean) with the lowest final
    `key`: the best lr of a sweep."""
    best: dict = {}
    for run in runs:
        value = run.final(key)
        if value is None or not math.isfinite(value):
            continue  # a diverged job of the sweep (NaN never compares lower)
        if run.optimizer not in best or value < best[run.optimizer].final(key):
            best[run.optimizer] = run
    return list(best.values())


def grid_edge_warnings(arms: list, best: list, length: Callable[[Any], Any] = lambda arm: None) -> list[str]:
    """One line for each run (or arm) of `best` whose lr is the lowest or the highest of the lrs
    its optimizer swept (among `arms` of the same `length`, when given: a schedule length), out
    of two or more: the sweep cannot show that an lr beyond it would not do better, and a
    comparison at a best lr that is not inside its grid may flatter one optimizer
    (lab/results.md). Names the lr, the grid and which side to extend."""
    lines = []
    for chosen in best:
        grid = sorted({arm.lr for arm in arms if arm.optimizer == chosen.optimizer and arm.lr is not None
                       and length(arm) == length(chosen)})
        if chosen.lr is None or len(grid) < 2 or grid[0] < chosen.lr < grid[-1]:
            continue
        side, beyond = ("lowest", "below") if chosen.lr == grid[0] else ("highest", "above")
        at = f" at {length(chosen)} steps" if length(chosen) is not None else ""
        lines.append(f"the best lr of {chosen.optimizer}{at}, {chosen.lr:g}, is the {side} of its grid "
                     f"({', '.join(f'{lr:g}' for lr in grid)}): the best may lie {beyond} it; extend the grid "
                     f"{beyond} {chosen.lr:g}")
    return lines


def ewm(values: list[float], alpha: float) -> list[float]:
    """Exponentially weighted mean, bias-corrected so the first points are not pulled to 0."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must lie in (0, 1], got {alpha}")
    out, mean, weight = [], 0.0, 0.0
    for v in values:
        mean = (1 - alpha) * mean + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(mean / weight)
    return out


@dataclass
class Lead:
    step_a: float
    step_b: Optional[float]  # None: B never reaches A's loss

    @property
    def difference(self) -> Optional[float]:
        return None if self.step_b is None else self.step_b - self.step_a

    @property
    def ratio(self) -> Optional[float]:
        return None if self.step_b is None else self.step_b / self.step_a


def first_reach(curve: Series, target: float) -> Optional[float]:
    """The first step at which `curve` is at or below `target`, interpolated linearly between
    the two logged points around the crossing: val losses are logged every few dozen steps,
    and snapping to the next logged point would bias every ratio upward by up to one interval."""
    previous: Optional[tuple[int, float]] = None
    for step, value in zip(*curve):
        if value <= target:
            if previous is None or previous[1] == value:
                return float(step)
            s0, v0 = previous
            return s0 + (v0 - target) / (v0 - value) * (step - s0)
        previous = (step, value)
    return None


def leading_steps(a: Series, b: Series) -> list[Lead]:
    """For each step of A, the (interpolated) first step at which B's loss is <= A's loss there."""
    return [Lead(step, first_reach(b, loss)) for step, loss in zip(*a)]


@dataclass
class InRunRatio:
    """How many times more steps B needs than A for the same loss, read along two runs:
    at B's crossing of A's final loss when B gets there, otherwise at A's crossing of B's
    final loss (the usual case when A is faster and both runs have the same length)."""
    steps_b: float
    steps_a: float
    reference: str  # whose final loss the crossing is measured at: "A" or "B"

    @property
    def ratio(self) -> float:
        return self.steps_b / self.steps_a


def in_run_ratio(a: Series, b: Series) -> Optional[InRunRatio]:
    if not a[0] or not b[0]:
        return None
    b_at_a_final = first_reach(b, a[1][-1])
    if b_at_a_final is not None:
        return InRunRatio(b_at_a_final, float(a[0][-1]), "A")
    a_at_b_final = first_reach(a, b[1][-1])
    if a_at_b_final is None:  # neither reaches the other's final loss: cannot happen, but be exact
        return None
    return InRunRatio(float(b[0][-1]), a_at_b_final, "B")


@dataclass
class ScheduleRatio:
    """The "honest" ratio: B (e.g. AdamW) re-run with longer schedules, everything else equal;
    the schedule length, relative to A's, at which B's *final* loss reaches A's final loss,
    interpolated linearly between the lengths run. None when even the longest does not."""
    lengths: list[float]  # B's schedule lengths / A's, ascending
    finals: list[float]  # B's final loss at each length
    target: float  # A's final loss
    ratio: Optional[float]


def schedule_ratio(target: float, lengths: list[float], finals: list[float]) -> ScheduleRatio:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    lengths, finals = [lengths[i] for i in order], [finals[i] for i in order]
    ratio = first_reach((lengths, finals), target)  # type: ignore[arg-type]
    return ScheduleRatio(lengths, finals, target, ratio)


def final_step(run: Run, key: str) -> Optional[int]:
    return run.series[key][0][-1] if key in run.series and run.series[key][0] else None
