"""How well a fair study searched, and what its speedup depends on (study/search_state.py,
study/screen.py, study/sensitivity.py), on synthetic tuners and records: a search that ends at
an edge, or before a round changed nothing, is flagged and leaves its study unresolved; a held
setting is traced to where it was last swept; the screen adds a held setting that gains; the
retune tries both neighbours; the first-k replay ends at the headline; the power law recovers a
known speedup."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from study.coordinate_descent import CoordinateDescent, drive
from study.records import Entry, read_index, read_plan, records_dir
from study.search_state import INIT, SEARCH_FILE, Lineage, side_state, study_states
from study.sensitivity import power_law_speedup, replay_k
from study.space_config import lr_space, parse_space
from study.speedup import Side
from tests.conftest import REPO

SPACE = {"optimizer": "adamw", "fixed": [],
         "lr": {"key": "optim.lr", "scale": "log", "init": 1e-3, "step": 3.0, "points": 3, "min": 0},
         "wd": {"key": "optim.weight_decay", "scale": "log", "init": 0.1, "step": 3.0, "points": 3, "min": 0}}


def searched(objective, trials: int, side: str = "adamw") -> list[Entry]:
    """The tune entries a study would record for `side`'s search of SPACE under `objective`."""
    engine = CoordinateDescent(parse_space(side, SPACE), trials, extend_max=3)
    history = drive(engine, lambda batch: [objective(p.as_dict()) for p in batch])
    return [Entry(stage="tune", side=side, budget=1.0, name=f"tune/{side}/{p.ordinal:03d}", run_id="x", seed=1,
                  steps=10, tokens_planned=100, status="ok", objective=v, ordinal=p.ordinal, round=p.round,
                  reason=p.reason, dim=p.dim, values=p.as_dict()) for p, v in history]


def plan_of(trials: int) -> dict:
    return {"target": "muon", "baseline": "adamw", "spaces": {"adamw": SPACE, "muon": SPACE},
            "tuning": {"trials": trials, "extend_max": 3, "seeds": [1]},
            "compare": {"budgets": [1.0], "retune": {"trials": 0}}}


def bowl(lr_best: float, wd_best: float):
    return lambda v: (math.log10(v["lr"] / lr_best)) ** 2 + (math.log10(v["wd"] / wd_best)) ** 2


def test_a_search_that_converged_inside_its_grids_is_resolved():
    state = side_state(plan_of(20), searched(bowl(1e-3, 0.1), 20), "adamw", Lineage())
    assert state.converged_at is not None and state.at_edge == [] and state.never_swept == []
    assert state.converged and state.summary().startswith("converged at trial ")


def test_a_search_that_ends_at_a_grid_edge_is_flagged_and_unresolved():
    """The best lr lies far above the grid: the budget ends while it is still extending upward."""
    state = side_state(plan_of(7), searched(bowl(1.0, 0.1), 7), "adamw", Lineage())
    assert [(d.name, d.edge) for d in state.at_edge] == [("lr", "high")]
    assert not state.converged and "at an edge: lr=" in state.summary()


def test_a_search_cut_short_before_a_round_changed_nothing_is_unresolved_and_names_what_it_never_swept():
    state = side_state(plan_of(3), searched(bowl(1e-3, 0.1), 3), "adamw", Lineage())
    assert state.converged_at is None and [d.name for d in state.never_swept] == ["wd"]
    assert not state.converged and "never swept: wd" in state.summary()


def test_a_held_setting_is_traced_to_the_study_that_last_swept_it():
    """The committed ladder: gpt_small held eight settings at gpt_d256's choice; AdamW's eps was
    last swept at gpt_d128 (gpt_d256's 24 trials never reached it); Muon's head multiplier was
    tuned at gpt_small but never swept, and its embedding multiplier ended at the top of its grid."""
    records = records_dir(REPO / "lab" / "results" / "fair" / "gpt_small")
    states = study_states(read_plan(records), read_index(records))
    adamw = {d.name: d for d in states["adamw"].dims}
    assert not adamw["eps"].tuned and adamw["eps"].origin == "gpt_d128"
    assert not adamw["weight_decay"].tuned and adamw["weight_decay"].origin == "gpt_d256"
    muon = {d.name: d for d in states["muon"].dims}
    assert muon["head_lr_mult"].tuned and not muon["head_lr_mult"].swept
    assert muon["embed_lr_mult"].edge == "high" and not states["muon"].converged
    assert all(d.origin != INIT for d in states["adamw"].inherited)


def test_the_retune_tries_the_centre_then_both_neighbours_then_extends_past_an_edge():
    space = parse_space("adamw", SPACE)
    engine = CoordinateDescent(lr_space(space, 1e-3, 1.5), 5, extend_max=3)
    lrs = [p.value("lr") for p, _ in drive(engine, lambda batch: [-math.log(p.value("lr")) for p in batch])]
    assert lrs[0] == pytest.approx(1e-3) and sorted(lrs[1:3]) == pytest.approx([1e-3 / 1.5, 1.5e-3])
    assert lrs[3] == pytest.approx(1.5e-3 * 1.5) and lrs[4] == pytest.approx(1.5e-3 * 2.25)  # the best was the top


def test_the_screen_adds_a_held_setting_that_gains_more_than_the_seed_noise(tmp_path):
    """A study tuning the lr alone (tuning.dims), every other setting held: its screen finds that
    AdamW's weight decay one step lower gains 0.5 nats, far beyond the start's spread over its
    seeds (0.001), so weight decay joins both sides' descent; nothing else gains."""
    from hydra_plugins.fair_sweeper.fair_sweeper import HydraLaunch
    from hydra.core.utils import JobReturn, JobStatus
    from study.checks import compose_study
    from study.plan import build_plan
    from study.records import write_plan
    from study.runner import StudyRunner

    plan = build_plan("smoke", compose_study("smoke", ["tuning.dims=[lr]", "tuning.trials=4",
                                                       "compare.retune.trials=0"]), [])
    plan.study_id = "0123456789ab"
    records = tmp_path / "records"
    write_plan(records, plan.to_json())

    def objective(overrides: list[str]) -> float:
        value = {o.lstrip("+").split("=", 1)[0]: o.split("=", 1)[1] for o in overrides if "=" in o}
        seed = int(value["seed"])
        wd = float(value["optim.weight_decay"])
        return 5.0 + (0.5 if wd > 0.05 else 0.0) + 0.001 * (seed % 3)  # lower weight decay is better

    class Launcher:
        def launch(self, jobs, initial_job_idx):
            return [JobReturn(status=JobStatus.COMPLETED, _return_value=objective(job)) for job in jobs]

    StudyRunner(records, tmp_path / "runs", HydraLaunch(Launcher())).run()
    entries = read_index(records)
    screened = [e for e in entries if e.stage == "screen"]
    assert len([e for e in screened if e.side == "muon"]) == len([e for e in screened if e.side == "adamw"]) == 25
    swept = {e.dim for e in entries if e.stage == "tune" and e.dim}
    assert "weight_decay" in swept and swept <= {"lr", "weight_decay"}
    # the search state the runner recorded is the one the records give
    recorded = (records / SEARCH_FILE).read_text()
    assert '"weight_decay"' in recorded
    derived = study_states(read_plan(records), entries)
    assert {side: s.to_dict() for side, s in derived.items()} == __import__("json").loads(recorded)


def side(tokens: list[float], law, shift: float, seeds: int = 4, noise: float = 0.002, seed: int = 0) -> Side:
    """Final losses on a power-law curve, the side reaching at D what the curve gives at shift*D."""
    rng = np.random.default_rng(seed)
    finals = np.array([[law(shift * t) + noise * rng.standard_normal() for _ in range(seeds)] for t in tokens])
    return Side(tuple(tokens), finals)


@pytest.mark.parametrize("speedup, extrapolated", [(1.8, False), (4.0, True)])
def test_the_power_law_estimate_recovers_a_known_speedup_inside_its_interval(speedup, extrapolated):
    """Both sides on L(D) = 2 (D / 1e5)^-0.3 + 3 (seed noise 0.002), the target reaching at D what the baseline reaches at
    1.8 D (inside the budgets, 1x to 3x) or 4 D (past them: extrapolated, where the headline can
    only say "> 3.00x")."""
    tokens = [1e5, 1.5e5, 2e5, 3e5]
    law = lambda d: 2.0 * (d / 1e5) ** -0.3 + 3.0  # noqa: E731
    result = power_law_speedup(side(tokens, law, speedup), side(tokens, law, 1.0, seed=1), 1000, 0)
    assert result.lo <= speedup <= result.hi and result.lo <= result.value <= result.hi
    assert result.value == pytest.approx(speedup, rel=0.1) and result.extrapolated == extrapolated


def test_the_first_k_replay_ends_at_the_headline(tmp_path):
    """Replayed with every trial, each split's speedup is the headline's; with fewer, the config
    chosen among the first k moves the finals by its tuning-loss gap."""
    from study.analysis import analyse, side_inputs
    from study.records import load_study

    data = load_study(REPO / "lab" / "results" / "fair_smoke" / "records")
    a = analyse(data)
    for split in a.splits:
        assert a.replayed[split][-1] == a.results[split].ratio
        target, base = side_inputs(data, "muon", split), side_inputs(data, "adamw", split)
        assert replay_k(target, base, len(a.replayed[split])) == a.results[split].ratio
    # an unreached crossing with the full budget names the budget that would contain it
    committed = analyse(load_study(REPO / "lab" / "results" / "fair" / "gpt_small"))
    hint = committed.extend_hint("val/val/loss")
    assert hint is not None and re.search(r"a budget of \d+(\.5)?x should contain the crossing", hint)
    assert "compare.budgets=[1,1.5,2," in hint
