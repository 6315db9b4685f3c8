"""Search spaces (study/search_space.py; read from config, study/space_config.py) and the shipped ones
(conf/tuning/*.yaml)."""
from __future__ import annotations

import copy
import dataclasses
import math
import typing

import pytest
import yaml
from omegaconf import OmegaConf

from study.search_space import (
    COMMON_DIMS, FAMILY_DICTS, SpaceError, extension_point, parity_problems, refine_points, space_dict, trial_overrides,
)
from study.space_config import lr_space, parse_space
from tests.conftest import REPO, compose


def shipped(side: str) -> dict:
    return yaml.safe_load((REPO / "conf" / "tuning" / f"{side}.yaml").read_text())


ADAMW, MUON = parse_space("adamw", shipped("adamw")), parse_space("muon", shipped("muon"))


def test_the_shipped_spaces_have_11_dims_each_and_the_same_shape():
    assert ADAMW.names == COMMON_DIMS + ("beta1", "beta2", "eps")
    assert MUON.names == COMMON_DIMS + ("momentum", "beta1", "beta2")
    assert (ADAMW.optimizer, MUON.optimizer, ADAMW.fixed, MUON.fixed) == ("adamw", "muon", (), ())
    assert parity_problems(ADAMW, MUON) == [] and parity_problems(MUON, ADAMW) == []
    # The published best lrs, everything else at today's shared defaults (optim/config.py).
    assert (ADAMW.dim("lr").init, MUON.dim("lr").init) == (1e-3, 1e-2)
    for name in COMMON_DIMS[1:]:
        a, m = ADAMW.dim(name), MUON.dim(name)
        assert (a.keys, a.scale, a.init, a.grid, a.lo_bound, a.hi_bound) == \
               (m.keys, m.scale, m.init, m.grid, m.lo_bound, m.hi_bound), name
    assert ADAMW.dim("lr").grid == (0.000333333333333, 0.001, 0.003)
    assert MUON.dim("lr").grid == (0.00333333333333, 0.01, 0.03)
    assert ADAMW.dim("norm_lr_mult").keys == ("optim.lr_overrides.norm", "optim.lr_overrides.router")
    assert ADAMW.dim("warmup").grid == (0.05, 0.1, 0.15) and ADAMW.dim("decay_floor").grid == (0.0, 0.1, 0.2)
    assert ADAMW.dim("beta2").grid == (0.9, 0.95, 0.975) and MUON.dim("momentum").grid == (0.9, 0.95, 0.975)
    assert ADAMW.dim("eps").grid == (1e-10, 1e-8, 1e-6)
    assert space_dict(ADAMW)["dims"][0] == {"name": "lr", "keys": ["optim.lr"], "scale": "log", "integer": False,
                                            "init": 0.001, "grid": [0.000333333333333, 0.001, 0.003],
                                            "bounds": [0.0, None]}


def schema_has(key: str) -> bool:
    from optim.routing import ALL_KINDS
    from trainer.config import TrainConfig

    prefix, _, last = key.rpartition(".")
    if prefix in FAMILY_DICTS:
        return last in ALL_KINDS
    node: typing.Any = TrainConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = typing.get_type_hints(node)[part]
    return True


def test_every_key_a_shipped_space_sets_is_a_real_config_key():
    from trainer.run.preflight import FAMILY_DICTS as TRAINER_FAMILY_DICTS

    assert FAMILY_DICTS == TRAINER_FAMILY_DICTS  # repeated in eval/ (which may not import trainer/)
    for space in (ADAMW, MUON):
        for dim in space.dims:
            assert all(schema_has(key) for key in dim.keys), (space.name, dim.name, dim.keys)
    assert not schema_has("optim.beta3") and not schema_has("optim.lr_overrides.emb")


def test_trial_overrides_name_the_real_keys_with_plus_plus_for_family_dicts():
    values = {**ADAMW.initial(), "lr": 0.000333333333333, "eps": 1e-10, "decay_floor": 0.0}
    assert trial_overrides(ADAMW, values) == [
        "optim=adamw", "optim.lr=0.000333333333333", "++optim.lr_overrides.embed=1.0",
        "++optim.lr_overrides.head=1.0", "++optim.lr_overrides.norm=1.0", "++optim.lr_overrides.router=1.0",
        "optim.weight_decay=0.1", "optim.warmup_fraction=0.1", "optim.min_lr_ratio=0.0", "optim.grad_clip=1.0",
        "optim.beta1=0.9", "optim.beta2=0.95", "optim.eps=1e-10"]
    with pytest.raises(ValueError, match=r"^spaces\.muon: a trial needs a value for each of .* \(missing momentum\)$"):
        trial_overrides(MUON, {k: v for k, v in MUON.initial().items() if k != "momentum"})


@pytest.mark.parametrize("space", [ADAMW, MUON], ids=lambda s: s.name)
def test_one_trial_per_side_composes_to_its_values(space):
    # Each dim at a point other than its init, so a key that composed to its default would show.
    values = {d.name: d.grid[0] for d in space.dims}
    # +adamw_side=third sets every AdamW-side family first: a `+` override would fail there.
    cfg = compose(["+adamw_side=third", *trial_overrides(space, values)])
    assert cfg.optim.name == space.optimizer
    for dim in space.dims:
        for key in dim.keys:
            assert OmegaConf.select(cfg, key) == values[dim.name], key


def minimal(**dims) -> dict:
    return {"optimizer": "adamw", "fixed": {}, **dims}


LR = {"key": "optim.lr", "scale": "log", "init": 1e-3, "step": 3.0, "points": 3, "min": 0}
BETA2 = {"key": "optim.beta2", "scale": "log1m", "init": 0.95, "step": 2.0, "points": 3, "max": 0.9999}
WARMUP = {"key": "optim.warmup_fraction", "scale": "linear", "init": 0.1, "step": 0.05, "points": 3, "min": 0}


def bad(dim: str | None = None, drop: tuple[str, ...] = (), **changes) -> dict:
    """The minimal valid space (lr, beta2, warmup) with `changes` made to dim `dim`'s fields, or
    to the top-level fields when `dim` is None; None as a value removes the field."""
    node = copy.deepcopy(minimal(lr=LR, beta2=BETA2, warmup=WARMUP))
    target = node if dim is None else node[dim]
    for name in drop:
        target.pop(name)
    target.update(changes)
    return node


WD_RANGE = {"key": "optim.weight_decay", "scale": "log", "init": 0.1, "points": 3}
BETA2_GRID = {"drop": ("step", "points"), "grid": [0.9, 0.95, 0.975]}


@pytest.mark.parametrize("node, line", [
    (bad("lr", points=0), "spaces.adamw.lr: an empty grid (points: 0)"),
    (bad("lr", drop=("step", "points"), grid=[]), "spaces.adamw.lr.grid: empty"),
    (minimal(wd={**WD_RANGE, "low": 0.3, "high": 0.03}), "spaces.adamw.wd: low 0.3 > high 0.03"),
    (minimal(wd={**WD_RANGE, "low": 0.1, "high": 0.1}), "spaces.adamw.wd: low = high = 0.1, an empty range"),
    (minimal(wd={**WD_RANGE, "low": 0.03}), "spaces.adamw.wd.high: missing (low and high go together)"),
    (bad("lr", drop=("step", "points"), grid=[0.003, 0.001]),
     "spaces.adamw.lr.grid: not increasing (0.003 then 0.001); list each point once, lowest first"),
    (bad("lr", min=1, max=0.1), "spaces.adamw.lr: min 1 > max 0.1"),
    (bad("beta2", **BETA2_GRID), None),  # valid: the base of the next case
    (bad("beta2", **BETA2_GRID, init=0.97),
     "spaces.adamw.beta2.init=0.97 is not a point of its grid (0.9, 0.95, 0.975)"),
    (bad("lr", poinst=3), "spaces.adamw.lr.poinst: unknown field (did you mean points?)"),
    (bad(optimzer="adamw"), "spaces.adamw.optimzer: unknown field (did you mean optimizer?)"),
    (bad("lr", scale="lgo"), "spaces.adamw.lr.scale: 'lgo' is not a scale (did you mean log?)"),
    (bad("lr", points=4), "spaces.adamw.lr.points: 4 is even; a grid centred on init needs an odd number"),
    (bad("lr", grid=[1e-3]),
     "spaces.adamw.lr: grid and step both given: use exactly one of grid, (init, step, points), (low, high, points)"),
    (bad("lr", drop=("step", "points")),
     "spaces.adamw.lr: no grid: give grid, (init, step, points) or (low, high, points)"),
    (bad("lr", step=0.5), "spaces.adamw.lr.step: 0.5 must be > 1 (a factor on a log scale)"),
    (bad("lr", init=0), "spaces.adamw.lr.init: init 0 is outside the log scale (values must be > 0)"),
    (bad("lr", init="abc"), "spaces.adamw.lr.init: 'abc' is not a number"),
    (bad("warmup", points=5), None),  # 0.0: on its bound (min 0), which a run may take
    (bad("warmup", points=7),
     "spaces.adamw.warmup.step: the grid point -0.05 (init 0.1, step 0.05, points 7) is below min 0"),
    (bad("beta2", max=0.97),
     "spaces.adamw.beta2.step: the grid point 0.975 (init 0.95, step 2, points 3) is above max 0.97"),
    (bad("lr", drop=("key",)), "spaces.adamw.lr.key: missing"),
    (bad("lr", key="+optim.lr"),
     "spaces.adamw.lr.key: '+optim.lr' is not a config key (a dotted name such as optim.lr; no +, = or spaces)"),
    (bad("beta2", key="optim.lr"), "spaces.adamw.beta2.key: optim.lr is also set by spaces.adamw.lr"),
    (minimal(), "spaces.adamw: no dimensions; a search space tunes at least one"),
    (bad(fixed={"optim": {"lr": 0.01}}),
     "spaces.adamw.fixed: optim.lr is tuned by spaces.adamw.lr; it cannot also be fixed"),
    (bad(optimizer=None), "spaces.adamw.optimizer: missing (the optim= preset of this side, e.g. adamw)"),
    (bad("lr", integer="yes"), "spaces.adamw.lr.integer: true or false, got 'yes'"),
])
def test_a_malformed_space_is_one_line_naming_the_field(node, line):
    if line is None:  # a valid variant, kept beside the case that breaks it
        parse_space("adamw", node)
        return
    with pytest.raises(SpaceError) as err:
        parse_space("adamw", node)
    assert str(err.value) == line and "\n" not in line
    assert isinstance(err.value, ValueError)


def test_fixed_overrides_are_flattened_and_prefixed():
    space = parse_space("adamw", bad(fixed={"optim": {"cautious_wd": True, "lr_overrides.bias": 0.5}}))
    assert space.fixed == ("optim.cautious_wd=true", "++optim.lr_overrides.bias=0.5")
    assert trial_overrides(space, space.initial())[:3] == ["optim=adamw", *space.fixed]


def test_the_three_grid_forms():
    space = parse_space("x", minimal(
        a={"key": "optim.lr", "scale": "log", "init": "1e-2", "low": 1e-3, "high": 1e-1, "points": 3},  # YAML 1.1 string
        b={"key": "optim.warmup_fraction", "scale": "linear", "init": 0.25, "low": 0, "high": 0.5, "points": 5},
        c={"key": "optim.min_lr_ratio", "scale": "linear", "init": 0.0, "grid": [0.0, 0.1, 0.2], "min": 0, "max": 1},
        d={"key": "trainer.batch_size", "scale": "log", "integer": True, "init": 8, "step": 2, "points": 3, "min": 1},
        e={"key": "optim.beta1", "scale": "log1m", "init": 0.9, "step": 2.0, "points": 5}))
    assert space.dim("a").grid == (0.001, 0.01, 0.1) and space.dim("a").init == 0.01
    assert space.dim("b").grid == (0.0, 0.125, 0.25, 0.375, 0.5)
    assert space.dim("c").grid == (0.0, 0.1, 0.2)
    assert space.dim("d").grid == (4.0, 8.0, 16.0)
    assert space.dim("e").grid == (0.6, 0.8, 0.9, 0.95, 0.975)  # 1 - beta: 0.4, 0.2, 0.1, 0.05, 0.025
    assert trial_overrides(space, space.initial())[-2:] == ["trainer.batch_size=8", "optim.beta1=0.9"]


def test_extension_is_one_grid_step_and_stops_at_a_hard_bound():
    lr, beta2, warmup = (parse_space("x", minimal(d=node)).dim("d") for node in (LR, BETA2, WARMUP))
    assert extension_point(lr, lr.grid, "high") == 0.009
    assert extension_point(lr, lr.grid, "low") == 0.000111111111111
    assert extension_point(lr, (1e-3, 3e-3, 9e-3), "high") == 0.027  # the dim's own step, from any grid
    # log1m: 1 - beta halves each step; the step that would pass max stops at max, then nothing.
    assert extension_point(beta2, beta2.grid, "high") == 0.9875
    assert extension_point(beta2, (0.95, 0.9998046875), "high") == 0.9999  # 0.99990234375 > max
    assert extension_point(beta2, (0.95, 0.9999), "high") is None
    assert extension_point(warmup, warmup.grid, "low") == 0.0  # a bound is a value a run may take
    assert extension_point(warmup, (0.0, 0.05, 0.1, 0.15), "low") is None
    one = parse_space("x", minimal(d={**LR, "points": 1})).dim("d")
    assert one.grid == (0.001,) and extension_point(one, one.grid, "high") is None


def test_the_retune_space_is_the_lr_alone_centred_on_the_choice():
    retune = lr_space(MUON, 0.0155884572681, 1.5)
    (lr,) = retune.dims
    assert (retune.name, retune.optimizer, lr.keys, lr.scale, lr.init) == ("muon", "muon", ("optim.lr",), "log",
                                                                          0.0155884572681)
    assert lr.grid == (0.0103923048454, 0.0155884572681, 0.0233826859021) and lr.lo_bound == 0.0
    with pytest.raises(SpaceError, match=r"^spaces\.muon\.lr\.step: 1 must be > 1 \(a factor on a log scale\)$"):
        lr_space(MUON, 0.01, 1.0)


def test_refinement_adds_the_midpoints_in_scale_units():
    lr, warmup = (parse_space("x", minimal(d=node)).dim("d") for node in (LR, WARMUP))
    low, high = refine_points(lr, lr.grid, 0.001)
    assert (low, high) == (pytest.approx(1e-3 / math.sqrt(3), rel=1e-11), pytest.approx(1e-3 * math.sqrt(3), rel=1e-11))
    assert refine_points(lr, lr.grid, 0.003) == [high]
    assert refine_points(warmup, warmup.grid, 0.1) == [0.075, 0.125]
    with pytest.raises(ValueError, match="not a point of the grid"):
        refine_points(lr, lr.grid, 0.002)


def test_parity_names_every_difference():
    muon = shipped("muon")
    wider = copy.deepcopy(muon)
    wider["lr"]["points"] = 5
    assert parity_problems(ADAMW, parse_space("muon", wider)) == [
        "spaces.muon.lr: 5 points, gaps 1.099 1.099 1.099 1.099 in log units, but spaces.adamw.lr has 3 points, "
        "gaps 1.099 1.099 in log units: a dimension both sides tune needs the same grid shape (only init may differ)"]
    batch = {"key": "trainer.batch_size", "scale": "log", "integer": True, "init": 8, "step": 2, "points": 3, "min": 1}
    opened = copy.deepcopy(muon)
    opened["batch"] = batch
    assert parity_problems(ADAMW, parse_space("muon", opened)) == [
        "spaces: adamw has 11 dimensions, muon 12: both sides must be tuned over the same families",
        "spaces.muon.batch: trainer.batch_size is tuned on muon only; open it on both sides or on neither"]
    both = copy.deepcopy(shipped("adamw"))
    both["batch"] = batch
    assert parity_problems(parse_space("adamw", both), parse_space("muon", opened)) == []
    swapped = copy.deepcopy(muon)
    swapped.pop("grad_clip")
    swapped["warmup"].update(scale="log", step=2.0, min=None, max=None)
    swapped["clip"] = {"key": "optim.grad_clip", "scale": "log", "init": 1.0, "step": 2.0, "points": 3}
    capped = copy.deepcopy(muon)
    capped["beta2"]["max"] = 0.999
    del capped["lr"]["min"]
    assert parity_problems(ADAMW, parse_space("muon", capped)) == [
        "spaces.muon.lr.min: none, but spaces.adamw.lr.min is 0: both sides' grids must stop at the same bounds",
        "spaces.muon.beta2.max: 0.999, but spaces.adamw.beta2.max is 0.9999: both sides' grids must stop at the "
        "same bounds"]
    assert parity_problems(ADAMW, parse_space("muon", swapped)) == [
        "spaces.muon.grad_clip: missing; every side tunes grad_clip",
        "spaces.muon.warmup.scale: log, but spaces.adamw.warmup is linear: a dimension both sides tune has one scale"]
