"""A tuned study's choice, run again somewhere else: `scripts/fair_compare.py --rerun STUDY`.

Each side runs the settings STUDY chose at every budget (its 1x settings, and the lr retuned at
each longer one) on fresh seeds, with more train.py overrides for every run (bf16 on a GPU,
another device), through the same final stage and the same report. The new study's records
start with a copy of STUDY's tuning and retuning records, so its report counts what both sides
spent choosing, and its bootstrap redoes that choice (STUDY's tuning losses, perturbed by the
seed noise measured here); only the final runs are new.

`make compare-gpu` (lab/tools/gpu/reference_bf16.py) is this, in bf16 on one GPU.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from study.checks import PlanError, check_train_overrides, seed_list
from study.plan import Plan
from study.runs import CONF, base_config, override_key, run_overrides


def rerun_plan(source: Path, study_overrides: list[str], command_train: list[str]) -> Plan:
    """The plan of a rerun of `source`'s choice (PlanError in one line, before anything runs)."""
    import yaml

    from study.records import PLAN_FILE, StudyError, chosen_settings, read_index, records_dir
    from study.search_space import trial_overrides
    from study.space_config import parse_space
    from trainer.config import ConfigError, register_configs
    from trainer.run.preflight import check_config, compose

    try:
        records = records_dir(source)
    except StudyError as err:
        raise PlanError(f"--rerun {err}") from err
    old = Plan.from_json((records / PLAN_FILE).read_text())
    if old.chosen:
        raise PlanError(f"--rerun {source}: a rerun itself; rerun {old.tuning.get('chosen_from')}, whose choice it ran")
    seeds = None
    for text in study_overrides:
        if override_key(text) != "compare.seeds":
            raise PlanError(f"{text}: a rerun runs the settings and budgets of {source}; of the study's keys only "
                            "compare.seeds=[...] may be given")
        seeds = yaml.safe_load(text.split("=", 1)[1])
    if seeds is None:
        raise PlanError(f"--rerun {source} needs compare.seeds=[...]: fresh seeds, none of that study's")
    seeds = seed_list(seeds, "compare.seeds")
    if len(seeds) < 2:
        raise PlanError(f"compare.seeds: {len(seeds)} seed(s); a comparison needs at least 2 (5 or more recommended)")
    reused = sorted(set(seeds) & (set(old.compare["seeds"]) | set(old.tuning["seeds"])))
    if reused:
        raise PlanError(f"compare.seeds: seed {reused[0]} was one of {source}'s; a rerun needs fresh seeds")
    entries = read_index(records)
    chosen = {side: {f"{b:g}": values for b, values in chosen_settings(entries, side).items()} for side in old.sides}
    for side in old.sides:
        for budget in old.compare["budgets"]:
            if f"{budget:g}" not in chosen[side]:
                raise PlanError(f"--rerun {source}: no final run of {side} at {budget:g}x there, so its choice "
                                "is not known (finish that study first)")
    spaces = {side: parse_space(side, old.spaces[side]) for side in old.sides}
    check_train_overrides(command_train, {key for space in spaces.values() for d in space.dims for key in d.keys})
    train = [*old.train, *command_train]
    register_configs()
    fraction = float(old.tuning["split_fraction"])
    for side, space in spaces.items():  # as train.py would: a value this machine refuses stops here
        overrides = run_overrides(train, trial_overrides(space, chosen[side]["1"]), fraction, 1, 0)
        try:
            check_config(compose(overrides, str(CONF)), 1)
        except (ConfigError, ValueError) as err:
            raise PlanError(f"{side}'s chosen settings with {' '.join(command_train)}: {err}") from err
    from omegaconf import OmegaConf

    typed = base_config(train, fraction)
    model = OmegaConf.to_container(OmegaConf.structured(typed.model))
    if model != old.model:
        raise PlanError(f"{' '.join(command_train)}: changes the model; a rerun runs {source}'s "
                        f"{old.model.get('name')} as it was tuned")
    t = typed.trainer
    if t.batch_size * t.seq_len * t.grad_accum != old.tokens_per_step:
        raise PlanError(f"{' '.join(command_train)}: changes the tokens per step; a rerun keeps {source}'s budgets")
    compare = dict(old.compare, seeds=seeds)
    runs = dict(old.budget_per_side["runs"], final=len(seeds) * len(compare["budgets"]))
    tokens = dict(old.budget_per_side["tokens"], final=len(seeds) * sum(compare["steps"]) * old.tokens_per_step)
    tokens["total"] = tokens["tune"] + tokens["retune"] + tokens["final"]
    data = OmegaConf.to_container(OmegaConf.structured(typed.data))
    note = (f"a rerun of the settings {source} chose (its tuning and retuning records are copied here); "
            f"its final runs add {' '.join(command_train) or 'nothing'}")
    return Plan(name="rerun", target=old.target, baseline=old.baseline, train=train, spaces=old.spaces,
                tuning=dict(old.tuning, chosen_from=str(source)), compare=compare, stats=old.stats,
                tokens_per_step=old.tokens_per_step, budget_per_side={"runs": runs, "tokens": tokens}, model=model,
                data=data, notes=[*old.notes, note], chosen=chosen, adopted=[old.study_id])


def copy_choice_records(source: Path, records: Path) -> None:
    """`source`'s tuning and retuning runs into `records` (their records and index lines), before
    this study's own; those already there are left as they are."""
    from study.records import read_index, records_dir, write_index

    src = records_dir(source)
    have = read_index(records)
    names = {e.name for e in have}
    copied = [e for e in read_index(src) if e.stage != "final" and e.name not in names]
    for e in copied:
        shutil.copytree(src / e.name, records / e.name, dirs_exist_ok=True)
    if copied:
        write_index(records, [*copied, *have])
