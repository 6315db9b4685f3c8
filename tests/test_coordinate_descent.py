"""Coordinate descent with one budget per side (study/coordinate_descent.py), on fake objectives."""
from __future__ import annotations

import math

import pytest
import yaml

from study.coordinate_descent import CoordinateDescent, Proposal, ReplayError, drive
from study.search_space import Space, to_unit
from study.space_config import parse_space
from tests.conftest import REPO

ADAMW, MUON = (parse_space(side, yaml.safe_load((REPO / "conf" / "tuning" / f"{side}.yaml").read_text()))
               for side in ("adamw", "muon"))


def tiny(**dims) -> Space:
    return parse_space("x", {"optimizer": "adamw", **dims})


LR = {"key": "optim.lr", "scale": "log", "init": 1e-3, "step": 3.0, "points": 3, "min": 0}
WD = {"key": "optim.weight_decay", "scale": "log", "init": 0.1, "step": 3.0, "points": 3, "min": 0}
BETA2 = {"key": "optim.beta2", "scale": "log1m", "init": 0.95, "step": 2.0, "points": 3, "max": 0.9999}


def bowl(space, **optimum):
    """A separable bowl in scale units, its minimum at `optimum` (the init for unnamed dims)."""
    def objective(p: Proposal) -> float:
        return sum((to_unit(d, p.value(d.name)) - to_unit(d, optimum.get(d.name, d.init))) ** 2 for d in space.dims)
    return objective


def run(space, trials: int, objective, **kw) -> CoordinateDescent:
    engine = CoordinateDescent(space, trials, **kw)
    drive(engine, lambda batch: [objective(p) for p in batch])
    return engine


def lr_trials(engine) -> list[tuple[float, str]]:
    return [(p.value("lr"), p.reason) for p, _ in engine.history if p.dim in (None, "lr")]


def configs(engine) -> list[tuple]:
    return [p.values for p, _ in engine.history]


def test_an_optimum_beyond_the_lr_grid_extends_it_and_each_extension_is_counted():
    engine = run(ADAMW, 8, bowl(ADAMW, lr=0.02))
    # Nearest first, ties low first; then one step at a time past the edge while it keeps winning.
    assert lr_trials(engine) == [(0.001, "init"), (0.000333333333333, "sweep"), (0.003, "sweep"),
                                 (0.009, "extend"), (0.027, "extend"), (0.081, "extend")]
    assert [p.ordinal for p, _ in engine.history] == list(range(8)) and engine.done and engine.ask() == []
    assert [p.dim for p, _ in engine.history][-2:] == ["embed_lr_mult", "embed_lr_mult"]  # 3 extensions: 8, not 11
    assert engine.incumbent.value("lr") == 0.027 and engine.notes == []
    # Still winning after extend_max extensions: the round notes it, and the next round goes on.
    far = run(ADAMW, 40, bowl(ADAMW, lr=1.0))
    assert "lr: best 0.081 is still at the high edge of its grid after 3 extensions in round 1" in far.notes
    assert [(v, p.round) for p, _ in far.history if p.reason == "extend" and (v := p.value("lr")) > 0.1] == \
           [(0.243, 2), (0.729, 2), (2.187, 2)]


def test_a_hard_bound_is_never_crossed_and_is_noted():
    space = tiny(beta2=BETA2)
    engine = run(space, 14, lambda p: 1 - p.value("beta2"))
    values = [p.value("beta2") for p, _ in engine.history]
    assert values[:11] == [0.95, 0.9, 0.975, 0.9875, 0.99375, 0.996875, 0.9984375, 0.99921875, 0.999609375,
                           0.9998046875, 0.9999]  # the step past max stops at max
    assert len(values) == 14 and max(values) == 0.9999 and len(set(values)) == 14
    assert "beta2: best 0.9999 is at its bound (max 0.9999)" in engine.notes
    # The round at the bound changed nothing: converged, and the rest refines below it.
    assert engine.converged_at == 11 and {p.reason for p, _ in engine.history[11:]} == {"refine"}
    assert engine.incumbent.value("beta2") == 0.9999


def test_a_diverged_trial_is_counted_never_chosen_and_never_proposed_again():
    space = tiny(lr=LR, wd=WD)
    best = bowl(space, lr=0.003, wd=0.05)

    def objective(p: Proposal) -> float:
        if p.ordinal == 0:
            return math.inf  # the initial point crashed
        return math.nan if p.value("lr") == 0.003 else best(p)  # the best lr diverges
    engine = run(space, 20, objective)
    assert len(engine.history) == 20
    failed = [p for p, obj in engine.history if obj == math.inf]  # nan is recorded as inf
    assert failed[0].ordinal == 0 and len(failed) >= 2
    assert all(p.value("lr") == 0.003 for p in failed[1:]) and not any(math.isnan(o) for _, o in engine.history)
    assert engine.incumbent not in failed and engine.incumbent_objective < math.inf
    assert engine.incumbent.value("lr") != 0.003
    assert len(set(configs(engine))) == 20  # nothing evaluated twice, the failures included
    nothing = run(space, 9, lambda p: math.inf)  # every trial failed: no choice, still the whole budget
    assert nothing.incumbent is None and len(nothing.history) == 9


def test_two_sides_with_different_objectives_both_spend_exactly_their_trials():
    adamw = run(ADAMW, 40, bowl(ADAMW))  # its optimum is its starting point: converges in round 1
    muon = run(MUON, 40, bowl(MUON, lr=0.2, momentum=0.99, weight_decay=0.01))
    assert len(adamw.history) == len(muon.history) == 40 and adamw.done and muon.done
    assert adamw.converged_at == 1 + 2 * 11 and adamw.incumbent.ordinal == 0
    assert [p.reason for p, _ in adamw.history[23:]] == ["refine"] * 17
    assert adamw.summary() == "40 of 40 trials; converged at trial 23, then refined its grids"
    assert muon.converged_at is None
    assert muon.summary() == f"40 of 40 trials; not converged: the budget ran out in round {muon.round}"
    for engine in (adamw, muon):
        assert len(set(configs(engine))) == 40


def noisy(space):
    """A bumpy but deterministic objective: a bowl plus a ripple, so ties never happen."""
    base = bowl(space, lr=0.05, weight_decay=0.02, momentum=0.98)
    return lambda p: base(p) + 0.3 * math.sin(7.0 * sum(to_unit(d, p.value(d.name)) for d in space.dims))


def test_the_first_n_trials_of_a_larger_budget_are_the_smaller_budgets_run():
    objective = noisy(MUON)
    full = run(MUON, 60, objective)
    assert full.converged_at is not None  # the prefix holds across convergence and refinement too
    for n in (1, 2, 3, 9, 23, full.converged_at, 47, 60):
        short = run(MUON, n, objective)
        assert short.history == full.history[:n]
        # The selection is the argmin (the earliest of ties) of those n trials.
        argmin = min(short.history, key=lambda t: (t[1], t[0].ordinal))[0]
        assert short.incumbent == argmin
        # Convergence is the same finding, once the smaller budget has seen the round end.
        assert short.converged_at == (full.converged_at if n >= full.converged_at else None)


def test_the_incumbent_is_the_argmin_after_every_batch():
    objective = noisy(ADAMW)
    engine = CoordinateDescent(ADAMW, 50)
    while batch := engine.ask():
        engine.tell([(p, objective(p)) for p in reversed(batch)])  # the order told does not matter
        best = min(engine.history, key=lambda t: (t[1], t[0].ordinal))
        assert (engine.incumbent, engine.incumbent_objective) == best


def test_ties_keep_the_incumbent_and_batches_are_cut_at_the_budget():
    flat = run(ADAMW, 30, lambda p: 1.0)
    assert flat.incumbent.ordinal == 0 and len(set(configs(flat))) == 30
    # Two sweep points tie below the init: the earlier keeps it, and an equal extension does not move it.
    space = tiny(lr=LR, wd=WD)
    engine = run(space, 6, lambda p: 2.0 if p.ordinal == 0 else 1.0)
    assert lr_trials(engine) == [(0.001, "init"), (0.000333333333333, "sweep"), (0.003, "sweep"),
                                 (0.000111111111111, "extend")]
    assert engine.incumbent.ordinal == 1
    # A budget of 2: the init, then the lr sweep cut to its nearest point.
    cut = CoordinateDescent(space, 2)
    (init,) = cut.ask()
    cut.tell([(init, 1.0)])
    (first,) = cut.ask()
    assert (first.ordinal, first.dim, first.value("lr")) == (1, "lr", 0.000333333333333)
    cut.tell([(first, 0.5)])
    assert cut.ask() == [] and cut.done and cut.incumbent == first
    # A round the budget cut short is no evidence of convergence; the same round complete is.
    at_init = bowl(space)
    assert run(space, 4, at_init).summary() == "4 of 4 trials; not converged: the budget ran out in round 1"
    assert run(space, 5, at_init).converged_at == 5


def test_asking_again_returns_the_batch_and_results_may_come_in_parts():
    engine = CoordinateDescent(tiny(lr=LR, wd=WD), 10)
    engine.tell([(engine.ask()[0], 3.0)])
    batch = engine.ask()
    assert engine.ask() == batch and len(batch) == 2
    engine.tell([(batch[1], 2.0)])
    assert engine.ask() == [batch[0]]
    with pytest.raises(ValueError, match=r"^trial 2 \(lr=0.003\) was told twice$"):
        engine.tell([(batch[1], 2.0)])
    stranger = Proposal(7, batch[0].values, "lr", 1, "sweep")
    with pytest.raises(ValueError, match=r"^trial 7 \(lr=0.0003333\) is not a proposal awaiting a result$"):
        engine.tell([(stranger, 1.0)])
    with pytest.raises(ValueError, match=r"^trials must be a whole number >= 1, got 0$"):
        CoordinateDescent(ADAMW, 0)


def test_a_resumed_study_evaluates_only_the_trials_it_has_no_record_of():
    objective = noisy(ADAMW)
    uninterrupted = run(ADAMW, 30, objective)
    records: dict[int, tuple[dict, float]] = {}
    evaluated: list[int] = []

    def evaluate(batch, crash_at=None):
        out = []
        for p in batch:  # one trial at a time, each recorded as it ends, as the study does
            if p.ordinal == crash_at:
                raise RuntimeError("interrupted")
            evaluated.append(p.ordinal)
            records[p.ordinal] = (p.as_dict(), objective(p))
            out.append(records[p.ordinal][1])
        return out

    with pytest.raises(RuntimeError):
        drive(CoordinateDescent(ADAMW, 30), lambda b: evaluate(b, crash_at=13))  # 13: mid-batch
    assert evaluated == list(range(13))
    evaluated.clear()
    resumed = CoordinateDescent(ADAMW, 30)
    drive(resumed, evaluate, recorded=dict(records))
    assert evaluated == list(range(13, 30))
    assert resumed.history == uninterrupted.history
    # A record that is not what the plan proposes there: the plan changed, refused in one line.
    changed = dict(records)
    changed[0] = ({**records[0][0], "lr": 0.003}, records[0][1])
    with pytest.raises(ReplayError, match=r"^trial 0 was recorded with lr=0.003 \(now 0.001\): "
                                          r"the plan changed since it ran$"):
        drive(CoordinateDescent(ADAMW, 30), evaluate, recorded=changed)
