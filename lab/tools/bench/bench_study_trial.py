"""What one fair-study trial costs, as the study runs it now against as it ran before.

    python lab/tools/bench/bench_study_trial.py                    # the default study (gpt_small), 3 rounds
    python lab/tools/bench/bench_study_trial.py --smoke --rounds 5

A trial is the study's first tuning trial of Muon (its plan's overrides, its tuning split and
seed) at --steps steps, run through train.py in this process as the study's runs are. "before":
every eval set evaluated, an end checkpoint written, the peak FLOP/s left to the run; "now":
the study's own settings for a trial (study/runner.py `how`): the tuning set alone, no end
checkpoint, the peak passed on. Rounds alternate the two (after one warm-up of each, which pays
the process's one-off costs); reported: each one's median seconds, the median saving a trial
and the median ratio over rounds.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from lab.tools.bench.bench_common import machine_info
from scripts.fair_compare import run_train_py
from study.checks import compose_study
from study.plan import build_plan
from study.records import TUNE_KEY, Entry
from study.runner import how, run_settings
from study.runs import run_overrides
from study.search_space import trial_overrides
from study.space_config import parse_space

QUIET = ["logger.progress=none", "+hydra.job_logging.handlers.console.level=WARNING",
         "hydra.hydra_logging.root.level=WARNING"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="the smoke study's settings (gpt_tiny)")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    name = "smoke" if args.smoke else "fair"
    plan = build_plan(name, compose_study(name, []), [])
    side = plan.target
    space = parse_space(side, plan.spaces[side])
    values = {d.name: d.init for d in space.dims}
    seed = plan.tuning["seeds"][0]
    base = run_overrides(plan.train, trial_overrides(space, values), plan.tuning["split_fraction"], args.steps, seed,
                         TUNE_KEY)
    work = Path(tempfile.mkdtemp(prefix="bench-trial-"))
    entry = Entry(stage="tune", side=side, budget=1.0, name="trial", run_id="", seed=seed, steps=args.steps,
                  tokens_planned=0, status="", objective=None, values=values)
    variants = {"before": [], "now": how(entry, run_settings(plan, work, local=True), False)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for round_ in range(args.rounds + 1):
            for label, extra in variants.items():
                run_dir = work / f"{label}-{round_}"
                start = time.monotonic()
                code = run_train_py(["train.py", *base, *extra, *QUIET, f"hydra.run.dir={run_dir}"])
                took = time.monotonic() - start
                if code:
                    raise SystemExit(f"the {label} trial stopped with exit code {code}")
                if round_:  # round 0 warms both up
                    times[label].append(took)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for key, value in machine_info().items():
        print(f"{key}: {value}")
    print(f"study {name}, model {plan.model.get('name')}, {side}'s first trial at {args.steps} step(s), "
          f"{args.rounds} rounds")
    print("| trial | median s | rounds |\n|---|---:|---|")
    for label, values_ in times.items():
        print(f"| {label} | {statistics.median(values_):.2f} | {', '.join(f'{t:.2f}' for t in values_)} |")
    saved = statistics.median(b - n for b, n in zip(times["before"], times["now"]))
    ratio = statistics.median(n / b for b, n in zip(times["before"], times["now"]))
    print(f"saved a trial: {saved:.2f} s (median over rounds); now / before: {ratio:.3f}")


if __name__ == "__main__":
    main()
