"""How long a fair study takes here, before it runs (`fair_compare.py --dry-run`).

Each side's seconds per step are timed on its model (a few steps on random tokens). What a run
costs besides its steps is measured on three real runs of the study's own first trial, as the
study would run them (its overrides, its wandb and TensorBoard, its tuning split), in a temp dir:

    A = first + start_up + step + eval      one step, scored on the tuning set (the first run here)
    B =         start_up + step + eval      the same again
    C =         start_up + 2 step + 2 n eval  two steps, every set evaluated after each (a final run's way)

with `step` from the timing and n the eval sets a final run has: `first` is what only the first
run of a process pays (imports, the token cache of the tuning split), `start_up` what every run
pays (the config, the model and optimizer, wandb, its end), `eval` one set's evaluation.
"""
from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from study.plan import Plan
from study.progress import minutes
from study.records import TUNE_KEY, Entry
from study.runs import CONF, run_overrides


@dataclass
class RunCost:
    """What a run of this study costs here, besides its training steps (seconds)."""

    step_s: dict[str, float]   # per side
    start_up_s: float          # every run: its config, build, logging, end
    eval_s: float              # one eval set's evaluation (eval.batches batches)
    first_s: float             # once, the first run of the study's process
    sets: int                  # eval sets of a final run (val, tune, OOD)
    measured: bool             # start_up, eval and first come from real runs (else unmeasured: 0)


def probe_step_seconds(plan: Plan, side: str, steps: int = 3) -> float:
    """Seconds per training step of `side`'s first trial, timed here: its model and optimizer
    built as a run builds them, `steps` steps on random tokens after one warm-up (no data read,
    nothing written)."""
    import torch

    from optim.builder import build_optimizer
    from parallel.mesh import Mesh
    from study.search_space import trial_overrides
    from study.space_config import parse_space
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


def eval_set_count(plan: Plan) -> int:
    """The eval sets a final run evaluates: val, tune and each OOD set of the base config."""
    from study.runs import base_config
    from trainer.config import objective_choices

    typed = base_config(plan.train, float(plan.tuning["split_fraction"]))
    return sum(1 for key in objective_choices(typed) if key.startswith("val/"))


def measure_runs(plan: Plan, train: Callable[[list[str]], int], say: Callable[[str], None]) -> RunCost:
    """RunCost from three real runs of the target's first trial (see the module's docstring), in
    a temp dir removed after; the step time from each side's timing."""
    from study.runner import how, run_settings
    from study.search_space import trial_overrides
    from study.space_config import parse_space

    step_s = {}
    for side in plan.sides:
        say(f"timing {side}'s step on its model")
        step_s[side] = probe_step_seconds(plan, side)
    side = plan.target
    space = parse_space(side, plan.spaces[side])
    values = {d.name: d.init for d in space.dims}
    seed = plan.tuning["seeds"][0]
    sets = eval_set_count(plan)
    work = Path(tempfile.mkdtemp(prefix="fair-dry-run-"))
    settings = run_settings(plan, work, local=True)
    walls = []
    try:
        for label, steps, stage in (("A", 1, "tune"), ("B", 1, "tune"), ("C", 2, "final")):
            entry = Entry(stage=stage, side=side, budget=1.0, name=f"dry-run/{label}", run_id="", seed=seed,
                          steps=steps, tokens_planned=0, status="", objective=None, values=values)
            objective, interval = (TUNE_KEY, 0) if stage == "tune" else (None, 1)
            overrides = [*run_overrides(plan.train, trial_overrides(space, values), plan.tuning["split_fraction"],
                                        steps, seed, objective, interval),
                         *how(entry, settings, False), f"hydra.run.dir={work / label}", "logger.progress=none",
                         "+hydra.job_logging.handlers.console.level=WARNING", "hydra.hydra_logging.root.level=WARNING"]
            say(f"timing a real run of {side}'s first trial ({label}: {steps} step{'s' * (steps > 1)}, "
                f"{'the tuning set' if stage == 'tune' else 'every set'} evaluated)")
            start = time.monotonic()
            code = train(["train.py", *overrides])
            walls.append(time.monotonic() - start)
            if code:
                say(f"that run stopped (exit {code}): the time besides each run's steps is unmeasured")
                return RunCost(step_s, 0.0, 0.0, 0.0, sets, False)
        alone = alone_seconds([o for o in overrides if not o.startswith("hydra.")])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a, b, c = walls
    s = step_s[side]
    eval_s = max((c - b - s) / (2 * sets - 1), 0.0)
    start_up = max(b - s - eval_s - alone, 0.0)
    return RunCost(step_s, start_up, eval_s, max(a - b, 0.0), sets, True)


def alone_seconds(overrides: list[str]) -> float:
    """What a run started alone pays that a run of the study's sweep does not: its command line's
    checks (train.py's preflight and run-dir planning, each composing the config), timed here."""
    from trainer.run.lock import planned_run_dir
    from trainer.run.preflight import preflight

    start = time.monotonic()
    preflight(overrides, str(CONF), 1)
    planned_run_dir(overrides, str(CONF))
    return time.monotonic() - start


def final_evals(steps: int, eval_points: int) -> int:
    """How often a final run of `steps` steps evaluates: every `interval` steps and at its last."""
    interval = max(1, steps // eval_points)
    return steps // interval + (1 if steps % interval else 0)


def estimate_seconds(plan: Plan, cost: RunCost, start_s: float = 0.0) -> dict[str, float]:
    """Seconds per stage, both sides, from the cost of a run: its start-up, its steps, and its
    evaluations (a trial scores the tuning set once; a final run evaluates every set at each of
    its eval points); the first run's one-off cost is counted once, and the study's own start
    (`start_s`: its imports and plan) before them."""
    c, t = plan.compare, plan.tuning
    per_stage = {"start": start_s, "screen": 0.0, "tune": 0.0, "retune": 0.0, "final": 0.0}
    screen = getattr(plan, "budget_per_side", {}).get("runs", {}).get("screen", 0)

    def trial(steps: int, side: str) -> float:
        return cost.start_up_s + steps * cost.step_s[side] + cost.eval_s

    def final(steps: int, side: str) -> float:
        return (cost.start_up_s + steps * cost.step_s[side]
                + final_evals(steps, c["eval_points"]) * cost.sets * cost.eval_s)

    seeds = len(t["seeds"])
    for side in plan.sides:
        per_stage["final"] += len(c["seeds"]) * math.fsum(final(n, side) for n in c["steps"])
        if plan.chosen:  # a rerun: the final runs only
            continue
        per_stage["screen"] += screen * trial(c["steps_1x"], side)
        per_stage["tune"] += t["trials"] * seeds * trial(c["steps_1x"], side)
        per_stage["retune"] += c["retune"]["trials"] * seeds * math.fsum(trial(n, side) for n in c["steps"][1:])
    per_stage["screen" if screen else "tune" if not plan.chosen else "final"] += cost.first_s
    if not screen:
        del per_stage["screen"]
    per_stage["total"] = math.fsum(per_stage.values())
    return per_stage


def cost_line(cost: RunCost) -> str:
    """What the estimate assumes a run costs, as the dry run prints it."""
    steps = ", ".join(f"{side} {s:.3g}s a step" for side, s in cost.step_s.items())
    if not cost.measured:
        return f"a run's cost here: {steps}; its start-up and evaluations unmeasured (not counted)"
    return (f"a run's cost here: {steps}; start-up and end {cost.start_up_s:.1f}s a run; one eval set "
            f"{cost.eval_s:.1f}s ({cost.sets} sets in a final run, the tuning set alone in a trial); the study's "
            f"first run {cost.first_s:.1f}s more (measured on 3 real runs of its first trial)")


def dry_run_lines(plan: Plan, train: Optional[Callable[[list[str]], int]], say: Callable[[str], None],
                  start_s: float = 0.0) -> list[str]:
    """The estimate's lines; `train` None: the start-up and evaluations are not measured.
    `start_s`: how long this command took to print the plan, which the study takes too."""
    if train is None:
        cost = RunCost({side: probe_step_seconds(plan, side) for side in plan.sides}, 0.0, 0.0, 0.0,
                       eval_set_count(plan), False)
    else:
        cost = measure_runs(plan, train, say)
    seconds = estimate_seconds(plan, cost, start_s)
    return [cost_line(cost), "estimated time here: " + ", ".join(f"{k} {minutes(v)}" for k, v in seconds.items())
            + " (and the report: seconds, or a minute with many bootstrap replicates)"]

