"""scripts/fair_compare.py end to end: one real smoke study (gpt_tiny, a few steps a run), shared
by the tests below. Both sides spend equal runs and tokens, every run is recorded, a study run
again trains nothing and an interrupted one only what is missing, the report is made again from
the records alone byte for byte, and every bad input is one line and exit 2 before anything
trains. The statistics, the search spaces and the coordinate descent have their own tests
(test_speedup.py, test_search_space.py, test_coordinate_descent.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from study.records import INDEX_FILE, PLAN_FILE, load_study, read_index, run_id, write_index
from tests.conftest import FAIR_SMALL, REPO
from tests.prestarted import run_python

SCRIPT = "scripts/fair_compare.py"
SMALL = FAIR_SMALL
REPORTS = ("comparison.md", "comparison.json", "trials.md", "chosen.md")


def fair(*args: str):
    return run_python([SCRIPT, *args], timeout=900)


@pytest.fixture
def study(fair_study) -> tuple[Path, str]:
    return fair_study


def test_both_sides_spend_equal_runs_and_tokens(study):
    out, stdout = study
    data = load_study(out)
    for stage, runs in (("tune", 2), ("retune", 6), ("final", 6)):
        a, b = data.of(stage, "muon"), data.of(stage, "adamw")
        assert len(a) == len(b) == runs, stage
        assert sum(e.tokens_planned for e in a) == sum(e.tokens_planned for e in b) > 0, stage
        if all(e.status == "ok" for e in a + b):
            assert sum(e.tokens_seen for e in a) == sum(e.tokens_seen for e in b), stage
    assert "tune done: 2 runs and 512 tokens per side (equal)" in stdout
    # run k of N for every run, in order, with the study's clock
    counted = [line.split(":", 1)[0] for line in stdout.splitlines() if line.startswith("[fair] run ")]
    assert counted == [f"[fair] run {k} of 28" for k in range(1, 29)]
    assert "about " in next(line for line in stdout.splitlines() if line.startswith("[fair] run 2 of 28"))
    assert f"records: {out / 'records'}" in stdout and f"report: {out / 'report' / 'comparison.md'}" in stdout
    budget = json.loads((out / "report" / "comparison.json").read_text())["budget"]
    assert budget["muon"] == budget["adamw"]


def test_the_study_dir_holds_every_record_the_choice_the_table_and_the_plot(study):
    out, stdout = study
    records = out / "records"
    entries = read_index(records)
    assert len(entries) == 28 and len({e.name for e in entries}) == 28
    for e in entries:
        record = records / e.name
        assert (record / "metrics.jsonl.gz").is_file() and (record / ".hydra" / "config.yaml").is_file(), e.name
        assert sum(f.stat().st_size for f in record.rglob("*") if f.is_file()) < 64 * 1024, e.name
        assert e.status == "ok" and e.objective is not None, e
    # the tuning runs are scored on the tuning split and seeds, the final ones report val on fresh seeds
    import yaml

    for e in entries:
        config = yaml.safe_load((records / e.name / ".hydra" / "config.yaml").read_text())
        assert config["data"]["tune_fraction"] == 0.05 and config["seed"] == e.seed, e.name
        assert config["eval"]["objective"] == ("val/val/loss" if e.stage == "final" else "val/tune/loss"), e.name
        assert (e.seed in (0, 1)) == (e.stage == "final"), e.name
    report = (out / "report" / "comparison.md").read_text()
    # 2 trials a side cannot converge: the study is unresolved, its speedups say so and give no p-value
    assert "**Unresolved: the search of muon and adamw did not converge (see Search)." in report
    for split in ("val/val/loss", "val/ood_prose/loss"):
        row = next(line for line in report.splitlines() if line.startswith(f"| {split} |"))
        assert "x, unresolved" in row.split("|")[2] and row.endswith("| unresolved |") and "p(>" not in row
    for section in ("## Search", "## Scale", "## Which optimizer steps which parameters",
                    "## The speedup read other ways", "## Would more tuning move the answer?"):
        assert section in report, section
    assert "| muon | muon | attn_k (2, 4,096), attn_o (2, 8,192)" in report  # from the runs' environment.json
    assert "**The opening of training:** 0.0026 tokens a non-embedding parameter at 1x, below 1" in report
    assert "val/tune/loss |" not in report  # never a reported figure
    chosen = (out / "report" / "chosen.md").read_text()
    assert "- muon at 1x: " in chosen and "- adamw at 2x: lr=" in chosen
    assert (out / "report" / "loss_vs_tokens.png").stat().st_size > 5000
    headline = [line for line in stdout.splitlines() if line.startswith("| val/")]
    assert len(headline) == 2


def test_a_finished_study_trains_nothing_when_run_again(study):
    out, _ = study
    before = {p: p.read_bytes() for p in (out / "records").rglob("*") if p.is_file()}
    proc = fair(*SMALL, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[fair] done: 28 runs, 0 trained now, 28 taken from the records" in proc.stdout
    assert "the records hold 28 runs: each one this plan asks for is taken from there" in proc.stdout
    assert sum(1 for line in proc.stdout.splitlines() if line.endswith("(from the records)")) == 28
    assert {p: p.read_bytes() for p in (out / "records").rglob("*") if p.is_file()} == before


def test_an_interrupted_study_trains_only_what_is_missing(study, tmp_path):
    out, _ = study
    copy = tmp_path / "study"
    shutil.copytree(out / "records", copy / "records")
    entries = read_index(copy / "records")
    gone = next(e for e in entries if e.stage == "final" and e.side == "adamw" and e.seed == 1)
    shutil.rmtree(copy / "records" / gone.name)
    write_index(copy / "records", [e for e in entries if e.name != gone.name])
    proc = fair(*SMALL, "--out", str(copy))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[fair] done: 28 runs, 1 trained now, 27 taken from the records" in proc.stdout
    # CPU training is deterministic: the run trained again is the run recorded before
    again = {e.name: e for e in read_index(copy / "records")}
    assert again.keys() == {e.name for e in entries} and again[gone.name].objective == gone.objective
    for name in REPORTS:
        assert (copy / "report" / name).read_bytes() == (out / "report" / name).read_bytes(), name


def test_the_report_is_made_again_from_the_records_alone(study, tmp_path):
    out, _ = study
    shutil.copytree(out / "records", tmp_path / "records")
    proc = fair("--report", str(tmp_path / "records"), "--out", str(tmp_path / "again"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in REPORTS:
        assert (tmp_path / "again" / name).read_bytes() == (out / "report" / name).read_bytes(), name


def test_the_committed_smoke_study_is_made_again_from_its_committed_records(tmp_path):
    """lab/results/fair_smoke holds a --smoke study's records and the report made from them: the
    tables come back byte for byte on any machine (the statistics sum in a fixed order)."""
    committed = REPO / "lab" / "results" / "fair_smoke"
    proc = fair("--report", str(committed / "records"), "--out", str(tmp_path / "again"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in REPORTS:
        assert (tmp_path / "again" / name).read_bytes() == (committed / "report" / name).read_bytes(), name


def test_a_rung_starts_at_the_choice_of_the_study_below_and_holds_the_dims_it_does_not_tune(study):
    """tuning.start_from moves every dim's init to that study's 1x choice, the grid the same shape
    around it; tuning.dims keeps those dims tuned and holds the rest there, as fixed overrides that
    a run composes (the plan composes its corners as train.py would)."""
    from study.space_config import parse_space
    from study.checks import compose_study
    from study.plan import build_plan

    out, _ = study
    chosen = {e.side: e.values for e in read_index(out / "records") if e.stage == "final" and e.budget == 1.0}
    plan = build_plan("smoke", compose_study("smoke", [f"tuning.start_from={out}", "tuning.dims=[lr,warmup]"]), [])
    for side in ("muon", "adamw"):
        space = parse_space(side, plan.spaces[side])
        assert space.names == ("lr", "warmup")
        lr, warmup = space.dim("lr"), space.dim("warmup")
        assert lr.init == chosen[side]["lr"] and warmup.init == chosen[side]["warmup"]
        assert lr.grid == pytest.approx((lr.init / 3, lr.init, lr.init * 3), rel=1e-9)
        assert warmup.grid == pytest.approx((warmup.init - 0.05, warmup.init, warmup.init + 0.05), abs=1e-12)
        held = {o.lstrip("+").split("=", 1)[0]: float(o.split("=", 1)[1]) for o in space.fixed}
        assert held["optim.weight_decay"] == chosen[side]["weight_decay"]
        assert held["optim.lr_overrides.norm"] == held["optim.lr_overrides.router"] == chosen[side]["norm_lr_mult"]
        assert held["optim.beta2"] == chosen[side]["beta2"]
        assert len({k for k in held}) == 10  # 9 held dims, norm_lr_mult setting two keys
    assert any(f"1x choice of {out}" in note for note in plan.notes)
    assert any(note.startswith("tuned: lr, warmup; held at their init: embed_lr_mult") for note in plan.notes)


def test_a_rerun_runs_the_studys_choice_on_fresh_seeds_with_the_same_report(study, tmp_path):
    """--rerun: each side's chosen settings at every budget (from the study's final runs), the
    extra override on every run, fresh seeds, the study's tuning records copied (the report counts
    and redoes that choice); a rerun of a rerun, reused seeds and other study keys are refused."""
    out, _ = study
    rerun = tmp_path / "rerun"
    proc = fair("--rerun", str(out), "compare.seeds=[7,8]", "--out", str(rerun), "optim.muon.ns_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    source, data = load_study(out), load_study(rerun)
    assert [e.to_line() for e in data.entries if e.stage != "final"] == \
        [e.to_line() for e in source.entries if e.stage != "final"]
    finals = data.of("final")
    assert sorted({e.seed for e in finals}) == [7, 8] and len(finals) == 12
    for e in finals:
        assert e.values == source.of("final", e.side, e.budget)[0].values, e.name
        config = (rerun / "records" / e.name / ".hydra" / "overrides.yaml").read_text()
        assert "optim.muon.ns_steps=4" in config and f"seed={e.seed}" in config, e.name
    assert "a rerun of the settings" in (rerun / "report" / "comparison.md").read_text()
    for args, said in ((["compare.seeds=[0,9]"], "error: compare.seeds: seed 0 was one of"),
                       ([], f"error: --rerun {out} needs compare.seeds=[...]"),
                       (["compare.seeds=[7,8]", "tuning.trials=3"], "error: tuning.trials=3: a rerun runs the settings")):
        proc = run_python([SCRIPT, "--rerun", str(out), *args, "--out", str(tmp_path / "no")], timeout=300)
        assert proc.returncode == 2 and proc.stderr.startswith(said), proc.stderr
    proc = run_python([SCRIPT, "--rerun", str(rerun), "compare.seeds=[20,21]", "--out", str(tmp_path / "no")],
                      timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: --rerun {rerun}: a rerun itself"), proc.stderr
    assert not (tmp_path / "no").exists()


def test_records_of_another_corpus_mixed_in_are_refused(study, tmp_path):
    out, _ = study
    shutil.copytree(out / "records", tmp_path / "records")
    entry = read_index(tmp_path / "records")[3]
    env = tmp_path / "records" / entry.name / "environment.json"
    record = json.loads(env.read_text())
    record["corpus"]["id"] = "0123456789ab"
    env.write_text(json.dumps(record))
    proc = fair("--report", str(tmp_path / "records"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: records mix corpora: 0123456789ab ("), proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_the_dry_run_prints_the_plan_and_trains_nothing(tmp_path):
    proc = run_python([SCRIPT, *SMALL, "--dry-run", "--out", str(tmp_path / "none")], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("per side (equal: yes): tuning 2 trials, 512 tokens;") for line in lines), lines
    assert any(line.startswith("budgets: 1x = 4 steps, 1.5x = 6 steps, 2x = 8 steps") for line in lines)
    assert any(line.startswith("seeds: tuning [100], fresh for the comparison [0, 1]") for line in lines)
    # the plan first, then the timing: each side's step, and three real runs of the first trial
    assert lines.index(next(line for line in lines if line.startswith("[dry run] timing"))) > \
        lines.index(next(line for line in lines if line.startswith("per side (equal: yes)")))
    cost = next(line for line in lines if line.startswith("a run's cost here: muon "))
    assert "start-up and end " in cost and "(measured on 3 real runs of its first trial)" in cost
    assert any(line.startswith("estimated time here: start ") for line in lines)
    assert not (tmp_path / "none").exists()


@pytest.mark.parametrize("args, said", [
    (["spaces.adamw.lr.points=0"], "error: spaces.adamw.lr: an empty grid (points: 0)"),
    (["spaces.muon.weight_decay.step=null", "+spaces.muon.weight_decay.low=0.3", "+spaces.muon.weight_decay.high=0.03"],
     "error: spaces.muon.weight_decay: low 0.3 > high 0.03"),
    (["+spaces.adamw.lr.poinst=3"], "error: spaces.adamw.lr.poinst: unknown field (did you mean points?)"),
    (["spaces.adamw.lr.pionts=3"], "error: spaces.adamw.lr: no such dimension or field"),
    (["tuning.trials=0"], "error: tuning.trials must be an integer >= 1, got 0"),
    (["compare.budgets=[0.0,1.0,2.0]"], "error: compare.budgets: 0.0 is not a budget"),
    (["compare.budgets=[1.0,2.0]"], "error: compare.budgets=[1.0, 2.0]: the comparison needs at least 3 budgets"),
    (["compare.seeds=[0]"], "error: compare.seeds: 1 seed(s); a comparison needs at least 2"),
    (["compare.seeds=[0,100]"], "error: compare.seeds: seed 100 is also a tuning seed"),
    (["optim.lr=0.01"], "error: optim.lr=0.01: set by the study's search spaces"),
    (["optim.weight_decay=0.1,0.2"], "error: optim.weight_decay=0.1,0.2: a sweep; the study chooses values itself"),
    (["seed=3"], "error: seed=3: the study sets seed on every run itself"),
    (["baseline=muon"], "error: target=muon and baseline=muon: compare two different spaces"),
    # a grid the space allows and a run refuses: found by composing its corners before anything trains
    (["tuning.start_from=no/such/study"], "error: tuning.start_from=no/such/study: no/such/study: no records/plan.json"),
    (["tuning.dims=[lr,momentum]"], "error: tuning.dims: momentum is not a dimension of adamw; a study tunes the same"),
    (["tuning.dims=[]"], "error: tuning.dims must be a non-empty list of dimension names, got []"),
    (["compare.retune.trials=2"], "error: compare.retune.trials=2: a retune tries the lr's centre and both neighbours, "
                                  "at least 3 trials"),
    (["tuning.screen=true", "tuning.noise_seeds=[0]"], "error: tuning.noise_seeds: the screen measures the seed noise"),
    (["tuning.screen=true", "tuning.noise_seeds=[0,7]"], "error: tuning.noise_seeds: seed 0 is also a tuning or "
                                                         "comparison seed"),
    (["tuning.dims=[lrr]"], "error: tuning.dims: lrr is not a dimension of muon, adamw; a study tunes the same "
                            "dimensions on both sides (did you mean lr? both have: lr, embed_lr_mult,"),
    (["tuning.trails=3"], "error: tuning.trails: no such study key (did you mean tuning.trials? tuning's keys: trials,"),
    (["compaer.seeds=[0,1]"], "error: compaer.seeds=[0,1]: no such key (did you mean compare.seeds? a study key"),
    # the base config's own error, by its key, not blamed on a search space
    (["data=hf", "data.path=json", "data.data_files=[/no/such/file.jsonl]"],
     "error: data.data_files: no such file: /no/such/file.jsonl"),
    (["optim.muon.ns_steps=0"], "error: optim.muon.ns_steps"),
    (["logger.wandb.name=mine"], "error: logger.wandb.name=mine: the study sets logger.wandb.name on every run itself"),
    ([f"{prefix}spaces.{side}.warmup.{field}" for side in ("muon", "adamw")
      for prefix, field in (("", "step=null"), ("+", "low=0.1"), ("+", "high=1.0"), ("", "max=1"))],
     "error: spaces.muon (highest point of every grid): optim.warmup_fraction must lie in [0, 1), got 1.0"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_trains(tmp_path, args, said):
    proc = run_python([SCRIPT, *SMALL, *args, "--out", str(tmp_path / "study")], timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(said), proc.stderr
    assert not (tmp_path / "study").exists()


def test_the_report_of_a_dir_without_a_study_is_refused(tmp_path):
    proc = run_python([SCRIPT, "--report", str(tmp_path)], timeout=300)
    assert proc.returncode == 2
    assert proc.stderr == f"error: {tmp_path}: no records/{PLAN_FILE}: not a study made by scripts/fair_compare.py\n"


def test_a_run_is_named_by_its_overrides_in_any_order_but_its_run_dir():
    assert run_id(["a=1", "b=2", "hydra.sweep.subdir=x"]) == run_id(["b=2", "a=1"]) != run_id(["a=1", "b=3"])


@pytest.mark.slow
def test_the_smoke_study_runs_end_to_end(tmp_path):
    """The documented command as it is: python scripts/fair_compare.py --smoke."""
    proc = fair("--smoke", "--out", str(tmp_path / "smoke"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = load_study(tmp_path / "smoke")
    assert len(data.of("tune", "muon")) == len(data.of("tune", "adamw")) == data.plan["tuning"]["trials"]
    # the screen: the start on 3 seeds, and 2 steps for each of the 11 settings, a side
    assert len(data.of("screen", "muon")) == len(data.of("screen", "adamw")) == 3 + 2 * 11
    assert (tmp_path / "smoke" / "records" / "search.json").is_file()
    assert "## Search" in (tmp_path / "smoke" / "report" / "comparison.md").read_text()
    assert (tmp_path / "smoke" / "report" / "loss_vs_tokens.png").is_file()
    assert (tmp_path / "smoke" / "records" / INDEX_FILE).is_file()


def test_a_batch_dimension_keeps_each_runs_tokens():
    """Batch size opened for both sides: a trial at twice the base batch runs half the steps, so
    every trial of a budget trains the same tokens."""
    from types import SimpleNamespace

    from study.space_config import parse_space
    from study.runs import run_steps

    space = parse_space("adamw", {"optimizer": "adamw", "fixed": {},
                                  "lr": {"key": "optim.lr", "scale": "log", "init": 1e-3, "step": 3.0, "points": 3},
                                  "batch": {"key": "trainer.batch_size", "scale": "log", "integer": True, "init": 4,
                                            "step": 2, "points": 3, "min": 1}})
    plan = SimpleNamespace(steps=lambda budget: int(12 * budget), tokens_per_step=4 * 32, compare={"batch_size": 4})
    assert run_steps(plan, space, {"lr": 1e-3, "batch": 4}, 1.0) == (12, 12 * 128)
    assert run_steps(plan, space, {"lr": 1e-3, "batch": 8}, 1.0) == (6, 12 * 128)
    assert run_steps(plan, space, {"lr": 1e-3, "batch": 2}, 2.0) == (48, 24 * 128)


def test_a_diverged_or_crashed_run_is_recorded_counted_and_never_chosen(study, tmp_path):
    """The study's stages driven by a launch that returns what Hydra's launchers give back (the
    sweeper's adapter, hydra_plugins/): the first run diverges (its job returns NaN, as train.py's
    main() does for a multirun job), the second crashes; each is recorded with its outcome,
    counted in its side's budget, and not chosen."""
    from hydra.core.utils import JobReturn, JobStatus

    from hydra_plugins.fair_sweeper.fair_sweeper import HydraLaunch
    from study.runner import StudyRunner

    out, _ = study
    (tmp_path / "records").mkdir()
    shutil.copy(out / "records" / PLAN_FILE, tmp_path / "records" / PLAN_FILE)
    launched: list[list[str]] = []

    class Launcher:  # not the basic launcher: the runner hands it whole batches
        def launch(self, jobs, initial_job_idx):
            results = []
            for job in jobs:
                launched.append(job)
                outcome = JobReturn(status=JobStatus.COMPLETED, _return_value=5.0 - len(launched) / 100)
                if len(launched) == 1:
                    outcome._return_value = float("nan")
                elif len(launched) == 2:
                    outcome = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("boom\nand more"))
                results.append(outcome)
            return results

    launch = HydraLaunch(Launcher())
    assert (launch.in_flight, launch.local) == (None, False)
    StudyRunner(tmp_path / "records", tmp_path / "runs", launch).run()
    entries = read_index(tmp_path / "records")
    assert len(entries) == len(launched) == 28
    first, second = entries[0], entries[1]
    assert (first.stage, first.side, first.status, first.objective) == ("tune", "muon", "diverged", None)
    assert (second.side, second.status, second.error) == ("adamw", "crashed", "RuntimeError: boom")
    for e in (first, second):
        assert (tmp_path / "records" / e.name / "metrics.jsonl.gz").is_file()
    for side in ("muon", "adamw"):
        assert len([e for e in entries if e.stage == "tune" and e.side == side]) == 2
        chosen = next(e for e in entries if e.stage == "final" and e.side == side).values
        tuned = [e for e in entries if e.stage == "tune" and e.side == side]
        assert chosen == {**next(e for e in tuned if e.status == "ok").values, "lr": chosen["lr"]}
    # every job is named in wandb, grouped by the study, and carries what it is in its config
    plan = json.loads((tmp_path / "records" / PLAN_FILE).read_text())
    first_job = launched[0]
    assert f"hydra.sweep.subdir={first.name}" in first_job and "eval.sets=[tune]" in first_job
    assert "logger.wandb.name='tune muon 1x #0 init'" in first_job
    assert f"logger.wandb.group='{tmp_path.name}-{plan['study_id'][:6]}'" in first_job
    info = next(o for o in first_job if o.startswith("++logger.run_info="))
    assert info == (f"++logger.run_info={{study:'{plan['study_id']}',stage:'tune',side:'muon',budget:'1x',trial:0,"
                    "seed:100}")
    final_job = next(job for job in launched if "logger.wandb.name='final adamw 2x seed 1'" in job)
    assert not any(o.startswith("eval.sets=") for o in final_job)  # a final run evaluates every set


def test_the_studys_clock_prices_the_runs_left_from_the_runs_trained():
    """A run's seconds = a start-up + seconds a step, fitted on the runs trained so far; runs
    taken from the records cost nothing and count as done."""
    from study.progress import StudyProgress, run_cost

    assert run_cost([]) is None
    assert run_cost([(10, 7.0), (20, 12.0)]) == pytest.approx((2.0, 0.5))
    assert run_cost([(10, 5.0), (10, 7.0)]) == pytest.approx((0.0, 0.6))  # one length seen: by steps alone
    progress = StudyProgress(total=4, total_steps=60)
    assert progress.count(10, 7.0) == "run 1 of 4" and progress.left() == pytest.approx(3 * 0.0 + 50 * 0.7)
    progress.count(20, 12.0)
    assert progress.left() == pytest.approx(2 * 2.0 + 30 * 0.5)
    progress.count(10, None)
    assert progress.left() == pytest.approx(1 * 2.0 + 20 * 0.5)


def test_the_dry_runs_estimate_counts_each_runs_start_its_steps_and_its_evaluations():
    """Trials score the tuning set once; a final run evaluates every set at each eval point
    (every steps // eval_points steps and its last); the first run's one-off cost and the study's
    own start count once."""
    from types import SimpleNamespace

    from study.estimate import RunCost, estimate_seconds, final_evals

    assert [final_evals(n, 2) for n in (4, 5, 6, 1)] == [2, 3, 2, 1]
    plan = SimpleNamespace(sides=("muon", "adamw"), chosen={}, tuning={"seeds": [100], "trials": 3},
                           compare={"seeds": [0, 1], "steps": [4, 6], "steps_1x": 4, "eval_points": 2,
                                    "retune": {"trials": 1}})
    cost = RunCost({"muon": 1.0, "adamw": 0.5}, start_up_s=2.0, eval_s=0.25, first_s=5.0, sets=3, measured=True)
    seconds = estimate_seconds(plan, cost, start_s=6.0)
    assert seconds["start"] == 6.0
    assert seconds["tune"] == pytest.approx(3 * (2 + 4 + 0.25) + 3 * (2 + 2 + 0.25) + 5.0)
    assert seconds["retune"] == pytest.approx((2 + 6 + 0.25) + (2 + 3 + 0.25))
    assert seconds["final"] == pytest.approx(2 * ((2 + 4 + 1.5) + (2 + 6 + 1.5)) + 2 * ((2 + 2 + 1.5) + (2 + 3 + 1.5)))
    assert seconds["total"] == pytest.approx(sum(v for k, v in seconds.items() if k != "total"))


def test_a_resolved_study_prints_its_p_values_and_an_unresolved_one_that_word():
    from study.report import ratio_text
    from study.speedup import Comparison, Ratio

    c = Comparison("val/val/loss", Ratio(1.3), Ratio(1.1), Ratio(1.5), {1.0: 0.01, 1.1: 0.04}, (0.0, 0.0), 99, 0,
                   True, "t")
    assert ratio_text(c) == ("1.30x", "1.10x to 1.50x", "p(> 1x) = 0.0100, p(> 1.1x) = 0.0400")
    assert ratio_text(c, resolved=False) == ("1.30x, unresolved", "1.10x to 1.50x", "unresolved")


def test_a_budget_added_to_a_finished_study_trains_only_its_own_runs(study, tmp_path):
    """What a report advises for a crossing past the budgets: the same command with the budget
    added takes every recorded run and trains only the new budget's retune and finals."""
    out, _ = study
    copy = tmp_path / "study"
    shutil.copytree(out / "records", copy / "records")
    proc = fair(*SMALL, "compare.budgets=[1.0,1.5,2.0,3.0]", "--out", str(copy))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 3 retune trials and 2 final seeds a side at 3x
    assert "[fair] done: 38 runs, 10 trained now, 28 taken from the records" in proc.stdout
    new = [e for e in read_index(copy / "records") if e.budget == 3.0]
    assert sorted((e.stage, e.side) for e in new).count(("final", "muon")) == 2 and len(new) == 10
