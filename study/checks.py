"""Every check of a fair study made before anything trains or is written: the study config
composed from conf/study/, its numbers, its search spaces, the train.py overrides of the
command line, the grids' corners as a run would compose them, and --out.

Every bad input is a PlanError in one line naming what is wrong (fair_compare.py prints it and
exits 2): an empty or inverted range or an unknown field in a search space, spaces of unequal
shape, a budget of 0, fewer than 2 or reused seeds, a train.py override that the study sets
itself, a value a run would refuse, or a study dir that cannot be one.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from study.runs import CONF, override_key, run_overrides


# The study's own groups of keys; any other override is train.py's.
STUDY_KEYS = ("target", "baseline", "train", "tuning", "compare", "stats", "spaces")
# What the study sets on every run itself: a command line that sets one too would be overridden.
CONTROLLED = ("optim", "seed", "trainer.max_steps", "eval.objective", "eval.interval", "data.tune_fraction",
              "optim.warmup_steps", "optim.min_lr", "checkpoint.interval", "checkpoint.at_end", "eval.sets",
              "logger.run_info", "logger.wandb.name", "logger.resume_hint", "hydra.sweep.dir", "hydra.sweep.subdir",
              "hydra/sweeper")


class PlanError(ValueError):
    """A study that cannot run, in one line."""


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
        raise PlanError(_study_error_line(err, overrides, name)) from err
    node = OmegaConf.to_container(cfg, resolve=True)
    return node.get("study", node) if isinstance(node, dict) else {}


def _study_error_line(err: Exception, overrides: list[str], name: str) -> str:
    import difflib
    import re

    text = str(err).strip()
    missing = re.search(r"Could not override '([^']+)'", text) or re.search(r"Key '([^']+)' is not in struct", text)
    if missing:
        key = missing.group(1)
        parts = key.split(".")
        if parts[0] == "spaces" and len(parts) >= 3:
            return f"{'.'.join(parts[:3])}: no such dimension or field (see conf/tuning/; add one with +{key}=...)"
        if parts[0] in STUDY_KEYS and len(parts) == 2:  # a key of one group: that group's keys
            group = compose_study(name, []).get(parts[0])
            if isinstance(group, dict):
                close = difflib.get_close_matches(parts[1], list(group), n=1)
                hint = f"did you mean {parts[0]}.{close[0]}? " if close else ""
                return f"{key}: no such study key ({hint}{parts[0]}'s keys: {', '.join(group)}; conf/study/fair.yaml)"
        close = difflib.get_close_matches(parts[0], STUDY_KEYS, n=1)
        hint = f"did you mean {close[0]}? " if close and close[0] != parts[0] else ""
        return f"{key}: no such study key ({hint}the study's keys: {', '.join(STUDY_KEYS)}; conf/study/fair.yaml)"
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
    if tuning.get("screen"):
        noise = seed_list(tuning.get("noise_seeds") or [], "tuning.noise_seeds")
        if len(tune_seeds) + len(noise) < 3:
            raise PlanError(f"tuning.noise_seeds: the screen measures the seed noise of its start on the tuning and "
                            f"noise seeds, at least 3 in all (have {len(tune_seeds) + len(noise)})")
        clash = sorted(set(noise) & (set(seeds) | set(tune_seeds)))
        if clash:
            raise PlanError(f"tuning.noise_seeds: seed {clash[0]} is also a tuning or comparison seed")
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
    retune = _int(compare["retune"], "compare.retune.trials", 0)
    if 0 < retune < 3:
        raise PlanError(f"compare.retune.trials={retune}: a retune tries the lr's centre and both neighbours, at "
                        "least 3 trials (more leave room to extend past an edge); 0 keeps the 1x lr everywhere")
    if not float(compare["retune"]["step"]) > 1:
        raise PlanError(f"compare.retune.step must be > 1 (the lr grid's ratio), got {compare['retune']['step']}")
    _int(compare, "compare.eval_points", 1)
    _int(stats, "stats.bootstrap", 200)
    for s0 in stats["thresholds"]:
        if not s0 > 0:
            raise PlanError(f"stats.thresholds: {s0} is not a speedup (each must be > 0)")


def study_key_typo(key: str) -> str | None:
    """The study key that `key`, which no run has, was meant to be (`compaer.seeds` ->
    compare.seeds); None when it is a run's key or like no study key."""
    import dataclasses
    import difflib

    from trainer.config import TrainConfig

    head, _, rest = key.replace("/", ".").partition(".")
    known = {f.name for f in dataclasses.fields(TrainConfig)} | {p.name for p in CONF.iterdir() if p.is_dir()}
    if head in STUDY_KEYS or head in known or head == "hydra":
        return None
    close = difflib.get_close_matches(head, STUDY_KEYS, n=1, cutoff=0.75)
    return f"{close[0]}.{rest}".rstrip(".") if close else None


def check_train_overrides(overrides: list[str], dim_keys: set[str]) -> None:
    """No sweep (the study picks values itself), nothing the study sets on every run, and no
    study key mistyped into a run's."""
    for text in overrides:
        key = override_key(text)
        meant = study_key_typo(key)
        if meant is not None:
            raise PlanError(f"{text}: no such key (did you mean {meant}? a study key; the study's keys: "
                            f"{', '.join(STUDY_KEYS)}; conf/study/fair.yaml)")
        if _is_sweep(text):
            raise PlanError(f"{text}: a sweep; the study chooses values itself (tune it through spaces.*)")
        if key in dim_keys:
            raise PlanError(f"{text}: set by the study's search spaces; change the dimension's init in spaces.* instead")
        if key in CONTROLLED or key.startswith("hydra.sweeper"):
            raise PlanError(f"{text}: the study sets {key} on every run itself")


def parsed_spaces(study: dict) -> dict:
    """{side: Space} of the study's two sides, and their parity; PlanError in one line."""
    from study.search_space import SpaceError, parity_problems
    from study.space_config import parse_space

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
    from study.records import StudyError, chosen_settings, read_index, records_dir
    from study.search_space import SPACE_FIELDS

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
    from study.search_space import held_overrides

    names = study["tuning"].get("dims")
    nodes = {side: study["spaces"][side] for side in spaces}
    if names is None:
        return nodes, []
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise PlanError(f"tuning.dims must be a non-empty list of dimension names, got {names!r}")
    shared = [n for n in next(iter(spaces.values())).names if all(n in space.names for space in spaces.values())]
    for name in names:
        missing = [side for side, space in spaces.items() if name not in space.names]
        if missing:
            import difflib

            close = difflib.get_close_matches(name, shared, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise PlanError(f"tuning.dims: {name} is not a dimension of {', '.join(missing)}; a study tunes the "
                            f"same dimensions on both sides ({hint}both have: {', '.join(shared)})")
    held_names = []
    for side, space in spaces.items():
        held = [d for d in space.dims if d.name not in names]
        node = {k: v for k, v in nodes[side].items() if k not in {d.name for d in held}}
        node["fixed"] = [*space.fixed, *(o for d in held for o in held_overrides(d))]
        nodes[side] = node
        held_names = [d.name for d in held]
    note = f"tuned: {', '.join(names)}; held at their init: {', '.join(held_names) or 'none'} (tuning.dims)"
    return nodes, [note]


def check_runs_compose(study: dict, spaces: dict, train: list[str]) -> None:
    """Compose and check, as train.py would, the two corners of each side's grids (every
    dimension at its lowest point, then at its highest): a value a run would refuse stops the
    study here, named by its side (the checks are ranges, so the corners hold every point)."""
    from study.search_space import trial_overrides
    from trainer.config import ConfigError, register_configs
    from trainer.run.preflight import check_config, compose

    register_configs()
    fraction = float(study["tuning"]["split_fraction"])
    for side, space in spaces.items():
        # The starting point first: what it refuses is the base config's (a data file, a model
        # key), named by its own key, not blamed on a grid.
        start = run_overrides(train, trial_overrides(space, {d.name: d.init for d in space.dims}), fraction, 1, 0,
                              "val/tune/loss")
        try:
            check_config(compose(start, str(CONF)), 1)
        except (ConfigError, ValueError) as err:
            raise PlanError(str(err)) from err
        corners = [("lowest", {d.name: min(d.grid) for d in space.dims}),
                   ("highest", {d.name: max(d.grid) for d in space.dims})]
        for what, values in corners:
            overrides = run_overrides(train, trial_overrides(space, values), fraction, 1, 0, "val/tune/loss")
            try:
                check_config(compose(overrides, str(CONF)), 1)
            except (ConfigError, ValueError) as err:
                raise PlanError(f"spaces.{side} ({what} point of every grid): {err}") from err
