"""Run comparison: leading steps on synthetic curves with known answers, EWM, run loading."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from eval.compare import (
    best_per_optimizer, ewm, find_runs, first_reach, grid_edge_warnings, in_run_ratio, leading_steps, load_run,
    schedule_ratio,
)
from tests.prestarted import run_python
from tests.closeness import approx


def test_leading_steps_recover_a_known_twofold_speedup():
    steps = list(range(1, 201))
    muon = (steps, [10.0 / s for s in steps])  # reaches 10/s at step s
    adamw = (steps, [20.0 / s for s in steps])  # needs step 2s for the same loss
    leads = leading_steps(muon, adamw)
    for lead in leads[:100]:
        assert lead.step_b == 2 * lead.step_a
        assert lead.difference == lead.step_a
        assert lead.ratio == 2.0
    assert all(lead.step_b is None for lead in leads[100:])  # beyond AdamW's horizon


def test_leading_steps_picks_the_first_step_at_or_below():
    a = ([10, 20], [5.0, 3.0])
    b = ([1, 2, 3, 4], [6.0, 5.0, 3.5, 3.0])
    assert [(l.step_a, l.step_b) for l in leading_steps(a, b)] == [(10, 2), (20, 4)]


def test_crossings_are_interpolated_between_logged_points():
    # val every 10 steps: 4.0 at step 10, 2.0 at step 20, so 3.0 is reached at step 15, not 20
    assert first_reach(([0, 10, 20], [5.0, 4.0, 2.0]), 3.0) == approx(15.0)
    assert first_reach(([0, 10, 20], [5.0, 4.0, 2.0]), 4.0) == 10.0
    assert first_reach(([0, 10, 20], [5.0, 4.0, 2.0]), 1.0) is None
    assert [l.step_b for l in leading_steps(([10], [4.5]), ([0, 10, 20], [5.0, 4.0, 2.0]))] == [5.0]


def test_in_run_ratio_reads_the_crossing_of_whichever_final_loss_is_reached():
    steps = list(range(1, 101))
    muon = (steps, [10.0 / s for s in steps])
    adamw = (steps, [20.0 / s for s in steps])
    # equal lengths: AdamW never reaches Muon's final 0.1; Muon reaches AdamW's final 0.2 at 50
    r = in_run_ratio(muon, adamw)
    assert (r.reference, r.steps_b, r.steps_a, r.ratio) == ("B", 100.0, 50.0, 2.0)
    # AdamW twice as long: it reaches Muon's final loss at step 200
    longer = (list(range(1, 201)), [20.0 / s for s in range(1, 201)])
    r = in_run_ratio(muon, longer)
    assert (r.reference, r.steps_b, r.steps_a, r.ratio) == ("A", 200.0, 100.0, 2.0)


def test_schedule_ratio_interpolates_between_schedule_lengths():
    lengths, finals = [2.0, 1.0, 1.5, 1.25], [2.6, 3.0, 2.8, 2.9]  # any order
    s = schedule_ratio(2.7, lengths, finals)
    assert s.lengths == [1.0, 1.25, 1.5, 2.0] and s.finals == [3.0, 2.9, 2.8, 2.6]
    assert s.ratio == approx(1.75)  # 2.7 is halfway from 2.8 (1.5x) to 2.6 (2x)
    assert schedule_ratio(2.5, lengths, finals).ratio is None  # not reached even at 2x
    assert schedule_ratio(3.1, lengths, finals).ratio == 1.0  # the equal-length run already does


def test_ewm_is_bias_corrected_and_follows_the_recurrence():
    assert ewm([4.0, 4.0, 4.0], 0.05) == approx([4.0, 4.0, 4.0])
    values = [1.0, 3.0, 2.0]
    m1 = 1.0
    m2 = (0.5 * 0.5 * 1.0 + 0.5 * 3.0) / (0.5 * 0.5 + 0.5)
    assert ewm(values, 0.5)[:2] == approx([m1, m2])
    with pytest.raises(ValueError):
        ewm(values, 0.0)


def write_run(path: Path, optimizer: str, lr: float, losses: list[float], corpus: str | None = None,
              seed: int | None = None, precision: str | None = None, every: int = 1, optim: dict | None = None,
              output_rms: list[float] | None = None, weight_rms: dict[str, float] | None = None,
              max_logit: list[float] | None = None) -> None:
    """A run dir as train.py leaves it; with `corpus`, also its environment.json; with `seed`,
    a config that names it (runs without one are never grouped as seeds of one setting); with
    `precision`, the resolved_config.yaml that records what trainer.precision ran in. `losses`
    are logged every `every` steps, from step `every` on. `optim` adds keys to the config's
    optim section (optim.lr_overrides, ...). `output_rms`: each layer's output RMS and then
    the final normed state's at the last step, logged at every step scaled by step / last step,
    so that only the last logged values are these; `weight_rms` likewise, by kind. `max_logit`:
    each layer's attention logit at the last step, scaled by last step / step, so that the
    largest over the run is an earlier one."""
    (path / ".hydra").mkdir(parents=True)
    if precision is not None:
        (path / "resolved_config.yaml").write_text(f"trainer:\n  precision: {precision}\n")
    if corpus is not None:
        env = {"git": {"commit": "0123456789abcdef", "dirty": False}, "python": "3.11.7", "torch": "2.13.0",
               "cuda": None, "device": "Test CPU", "world_size": 1, "layout": {"dp": 1, "tp": 1},
               "corpus": {"id": corpus}}
        (path / "environment.json").write_text(json.dumps(env))
    seed_line = "" if seed is None else f"seed: {seed}\n"
    extra = "".join(f"  {key}: {json.dumps(value)}\n" for key, value in (optim or {}).items())  # JSON is YAML
    (path / ".hydra" / "config.yaml").write_text(f"{seed_line}optim:\n  name: {optimizer}\n  lr: {lr}\n{extra}")
    last = every * len(losses)
    with open(path / "metrics.jsonl", "w") as f:
        for step, loss in zip(range(every, last + 1, every), losses):
            record = {"step": step, "tokens": step * 10, "train/loss": loss,
                      "val/val/loss": loss + 0.1, "val/ood_prose/loss": loss + 1}
            record |= output_rms_record(output_rms or [], step / last)
            record |= scaled({f"model/weight_rms/{kind}": v for kind, v in (weight_rms or {}).items()}, step / last)
            record |= scaled({f"attn/max_logit/layer_{i}": v for i, v in enumerate(max_logit or [])}, last / step)
            f.write(json.dumps(record) + "\n")


def output_rms_record(values: list[float], scale: float) -> dict[str, float]:
    """model/output_rms/layer_<i> for all but the last of `values`, model/output_rms/final for
    the last, each times `scale`."""
    keys = [f"model/output_rms/layer_{i}" for i in range(len(values) - 1)] + ["model/output_rms/final"]
    return scaled(dict(zip(keys, values)), scale)


def scaled(record: dict[str, float], scale: float) -> dict[str, float]:
    return {key: value * scale for key, value in record.items()}


def test_sweep_dirs_keep_the_best_lr_per_optimizer(tmp_path):
    write_run(tmp_path / "sweep" / "0", "muon", 1e-3, [5, 4, 3.5])
    write_run(tmp_path / "sweep" / "1", "muon", 3e-3, [5, 4, 3.0])
    write_run(tmp_path / "sweep" / "2", "adamw", 1e-3, [5, 4.5, 4.0])
    write_run(tmp_path / "sweep" / "00", "adamw", 1e-2, [5, 9, float("nan")])  # diverged, read first
    runs = [load_run(p) for p in find_runs(tmp_path / "sweep")]
    best = {r.optimizer: r.lr for r in best_per_optimizer(runs)}
    assert best == {"muon": 3e-3, "adamw": 1e-3}


def test_a_runs_label_names_its_pipeline(tmp_path):
    """environment.json's layout as trainer/run/environment.py records a pipeline run: pp and its schedule
    and split; a record without pp (every run before pipelines, and pp 1) reads as before."""
    write_run(tmp_path / "pp", "muon", 1e-3, [3.0, 2.0], corpus="c")
    env_file = tmp_path / "pp" / "environment.json"
    env = json.loads(env_file.read_text())
    plain = load_run(tmp_path / "pp").describe()
    assert "pp " not in plain and plain.endswith(f"Test CPU x 1 (dp 1, tp 1) ({tmp_path / 'pp'})")
    env.update(world_size=4, layout={"dp": 2, "tp": 1, "dp_shard": 2, "ep": 1, "pp": 2, "pp_schedule": "1f1b",
                                     "pp_stages_per_rank": 1, "pp_microbatches": 4, "pp_layers_per_stage": [1, 1]})
    env_file.write_text(json.dumps(env))
    assert load_run(tmp_path / "pp").describe().endswith(
        f"Test CPU x 4 (dp 2, tp 1, FSDP2 over 2); pp 2 (1f1b, blocks per stage 1, 1) ({tmp_path / 'pp'})")
    env["layout"].update(pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, pp_layers_per_stage=[0, 1, 1, 0])
    env_file.write_text(json.dumps(env))
    assert "; pp 2 (interleaved_1f1b, 2 stages per rank, blocks per stage 0, 1, 1, 0) (" in (
        load_run(tmp_path / "pp").describe())


def test_a_best_lr_at_the_edge_of_its_grid_is_warned():
    """lab/results.md: the grid must contain the best lr. Arms of one optimizer at lrs 1e-3, 3e-3
    and 1e-2 (another optimizer's lrs do not count), and the best at each place."""
    from types import SimpleNamespace as Arm

    arms = [Arm(optimizer="muon", lr=lr) for lr in (1e-3, 3e-3, 1e-2)] + [Arm(optimizer="adamw", lr=1e-4)]
    assert grid_edge_warnings(arms, [arms[1]]) == []
    assert grid_edge_warnings(arms, [arms[3]]) == []  # one lr swept: no grid to be at the edge of
    assert grid_edge_warnings(arms, [arms[2], arms[0]]) == [
        "the best lr of muon, 0.01, is the highest of its grid (0.001, 0.003, 0.01): the best may lie above it; "
        "extend the grid above 0.01",
        "the best lr of muon, 0.001, is the lowest of its grid (0.001, 0.003, 0.01): the best may lie below it; "
        "extend the grid below 0.001"]


def test_cli_writes_plots_and_the_summary_ratio(tmp_path):
    write_run(tmp_path / "muon", "muon", 1e-3, [10.0 / s for s in range(1, 51)])
    write_run(tmp_path / "adamw", "adamw", 1e-3, [20.0 / s for s in range(1, 101)])
    proc = run_python(["scripts/compare_runs.py", str(tmp_path / "adamw"), str(tmp_path / "muon"),
                       "--out", str(tmp_path / "cmp"), "--alpha", "1"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cmp" / "losses.png").stat().st_size > 1000
    assert (tmp_path / "cmp" / "leading_steps.png").stat().st_size > 1000
    assert "A = muon" in proc.stdout
    # Muon's final loss (10/50) is AdamW's at step 100: 100 steps vs 50, ratio 2
    for key in ("train/loss", "val/val/loss", "val/ood_prose/loss"):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {key} "))
        assert row.replace(" ", "").endswith("|100|50|2.000|A|"), row
    assert (tmp_path / "cmp" / "summary.md").read_text() in proc.stdout


def test_a_resumed_run_keeps_the_last_record_of_each_step(tmp_path):
    """A run resumed from its step-2 checkpoint logs steps 3 and 4 again: the curve must be
    the continued one, in step order, without the abandoned records."""
    records = [(1, 5.0), (2, 4.0), (3, 9.0), (4, 9.5), (3, 3.5), (4, 3.0)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "tokens": s, "train/loss": v}) + "\n" for s, v in records)
    )
    assert load_run(tmp_path).series["train/loss"] == ([1, 2, 3, 4], [5.0, 4.0, 3.5, 3.0])


def test_sweep_of_tensorboard_only_runs_is_found_and_read(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for job, loss in (("0", 3.0), ("1", 2.0)):
        with SummaryWriter(str(tmp_path / "sweep" / job / "tb")) as writer:
            for step in (1, 2):
                writer.add_scalar("val/val/loss", loss + 1.0 / step, step)
    runs = [load_run(p) for p in find_runs(tmp_path / "sweep")]
    assert [r.path.name for r in runs] == ["0", "1"]
    assert runs[1].series["val/val/loss"] == ([1, 2], [3.0, 2.5])


def test_cli_prints_the_sweep_table_and_the_schedule_ratio(tmp_path):
    """A sweep of two lrs per optimizer, plus AdamW re-run at 1.5x and 2x of Muon's 40 steps."""
    def curve(scale: float, steps: int) -> list[float]:
        return [scale * 10.0 / s for s in range(1, steps + 1)]

    write_run(tmp_path / "sweep" / "0", "muon", 1e-3, curve(1.0, 40))
    write_run(tmp_path / "sweep" / "1", "muon", 3e-3, curve(1.2, 40))
    write_run(tmp_path / "sweep" / "2", "adamw", 1e-3, curve(1.5, 40))
    write_run(tmp_path / "sweep" / "3", "adamw", 3e-3, curve(1.6, 40))
    write_run(tmp_path / "longer" / "0", "adamw", 1e-3, curve(1.5, 60))
    write_run(tmp_path / "longer" / "1", "adamw", 1e-3, curve(1.5, 80))
    with open(tmp_path / "sweep" / "0" / "metrics.jsonl", "a") as f:  # health metrics get plots
        f.write(json.dumps({"step": 40, "optim/update_rms/mlp_in": 0.2, "model/output_rms/final": 1.0,
                            "moe/load_imbalance/layer_1": 1.3, "moe/bias_spread/layer_1": 0.02,
                            "optim/qk_clip/max_logit": 40.0, "optim/qk_clip/heads_clipped": 2}) + "\n")
    proc = run_python(["scripts/compare_runs.py", str(tmp_path / "sweep"), "--longer", str(tmp_path / "longer"),
                       "--out", str(tmp_path / "cmp")], timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # both best lrs are the lowest swept: said on stderr and in summary.md
    edge = ("the best lr of {0}, 0.001, is the lowest of its grid (0.001, 0.003): the best may lie below it; extend "
            "the grid below 0.001")
    assert [line for line in proc.stderr.splitlines() if "grid" in line] == [
        "warning: " + edge.format("muon"), "warning: " + edge.format("adamw")]
    summary = (tmp_path / "cmp" / "summary.md").read_text().splitlines()
    assert f"**Warning: {edge.format('muon')}.**" in summary and f"**Warning: {edge.format('adamw')}.**" in summary
    # the sweep table: every run, final val (loss + 0.1) and OOD (loss + 1) losses, best marked
    assert "| muon (best) | 0.001 | 0.3500 | 1.2500 |" in lines
    assert "| adamw | 0.003 | 0.5000 | 1.4000 |" in lines
    # Muon's final val 0.35 (loss 0.25); AdamW's final loss 15/n reaches 0.25 at n = 60 steps:
    # 1.5x exactly, for val and OOD alike
    honest = lines[next(i for i, line in enumerate(lines) if line.startswith("## Schedule ratio")):]
    assert "| loss | A final | B at 1x | B at 1.5x | B at 2x | schedule ratio B/A |" in honest
    for key in ("val/val/loss", "val/ood_prose/loss"):
        row = next(line for line in honest if line.startswith(f"| {key} "))
        assert row.replace(" ", "").endswith("|1.500|"), row
    for name in ("update_rms.png", "output_rms.png", "moe_load_imbalance.png", "moe_expert_bias.png", "qk_clip.png"):
        assert (tmp_path / "cmp" / name).stat().st_size > 1000
    assert not (tmp_path / "cmp" / "max_attn_logit.png").exists()  # a family no run logged


def test_the_schedule_ratio_takes_the_best_lr_at_each_length(tmp_path):
    """AdamW re-tuned per length: at 60 steps lr 5e-4 beats 1e-3, at 80 steps 1e-3 wins."""
    def curve(scale: float, steps: int) -> list[float]:
        return [scale * 10.0 / s for s in range(1, steps + 1)]

    write_run(tmp_path / "muon", "muon", 3e-3, curve(1.0, 40))
    write_run(tmp_path / "adamw", "adamw", 1e-3, curve(1.5, 40))
    for name, lr, scale, steps in (("a", 1e-3, 1.5, 60), ("b", 5e-4, 1.4, 60), ("c", 1e-3, 1.5, 80),
                                   ("d", 5e-4, 1.55, 80)):
        write_run(tmp_path / "longer" / name, "adamw", lr, curve(scale, steps))
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"), "--longer", str(tmp_path / "longer"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "| adamw (best) | 60 | 0.0005 | 0.3333 | 1.2333 |" in lines
    assert "| adamw | 60 | 0.001 | 0.3500 | 1.2500 |" in lines
    assert "B's lr at each length: 1x 0.001, 1.5x 0.0005, 2x 0.001" in lines
    # each length's grid is its own
    assert [line for line in proc.stderr.splitlines() if "grid" in line] == [
        "warning: the best lr of adamw at 60 steps, 0.0005, is the lowest of its grid (0.0005, 0.001): the best may "
        "lie below it; extend the grid below 0.0005",
        "warning: the best lr of adamw at 80 steps, 0.001, is the highest of its grid (0.0005, 0.001): the best may "
        "lie above it; extend the grid above 0.001"]
    # Muon's final val 0.35 lies between AdamW's 0.475 (1x) and 0.3333 (1.5x, lr 5e-4)
    t = (0.475 - 0.35) / (0.475 - (1.4 * 10 / 60 + 0.1))
    row = next(line for line in lines if line.startswith("| val/val/loss ") and "B at 1.5x" not in line
               and line.count("|") == 7)
    assert row.endswith(f"| {1 + 0.5 * t:.3f} |"), row


def test_unfinished_runs_are_left_out_and_named(tmp_path):
    """A run still going (or killed) would enter the tables as a shorter schedule: left out,
    with a warning and a line in summary.md naming it."""
    def curve(scale: float, steps: int) -> list[float]:
        return [scale * 10.0 / s for s in range(1, steps + 1)]

    write_run(tmp_path / "muon", "muon", 3e-3, curve(1.0, 40))
    write_run(tmp_path / "adamw", "adamw", 1e-3, curve(1.5, 40))
    write_run(tmp_path / "longer" / "a", "adamw", 1e-3, curve(1.5, 60))
    write_run(tmp_path / "longer" / "b", "adamw", 1e-3, curve(1.5, 30))  # meant to run 80 steps
    for name, steps in (("muon", 40), ("adamw", 40), ("longer/a", 60), ("longer/b", 80)):
        config = tmp_path / name / ".hydra" / "config.yaml"
        config.write_text(config.read_text() + f"trainer:\n  max_steps: {steps}\n")
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"), "--longer", str(tmp_path / "longer"))
    assert proc.returncode == 0, proc.stderr
    assert f"warning: not compared, unfinished: {tmp_path / 'longer' / 'b'} logged up to step 30 of its 80" in proc.stderr
    assert "B at 2x" not in proc.stdout and "| loss | A final | B at 1x | B at 1.5x | schedule ratio B/A |" in proc.stdout
    assert f"- {tmp_path / 'longer' / 'b'} logged up to step 30 of its 80" in (tmp_path / "cmp" / "summary.md").read_text()


def test_cli_refuses_longer_runs_of_another_optimizer(tmp_path):
    write_run(tmp_path / "muon", "muon", 1e-3, [3.0, 2.0])
    write_run(tmp_path / "adamw", "adamw", 1e-3, [3.0, 2.5])
    write_run(tmp_path / "wrong", "muon", 1e-3, [3.0, 2.5, 2.0])
    proc = run_python(["scripts/compare_runs.py", str(tmp_path / "muon"), str(tmp_path / "adamw"),
                       "--longer", str(tmp_path / "wrong"), "--out", str(tmp_path / "cmp")], timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --longer run") and "adamw" in proc.stderr


def test_cli_names_a_longer_path_without_runs_as_longer(tmp_path):
    write_run(tmp_path / "muon", "muon", 1e-3, [3.0, 2.0])
    write_run(tmp_path / "adamw", "adamw", 1e-3, [3.0, 2.5])
    proc = run_python(["scripts/compare_runs.py", str(tmp_path / "muon"), str(tmp_path / "adamw"),
                       "--longer", str(tmp_path / "no_such"), "--out", str(tmp_path / "cmp")], timeout=120)
    assert proc.returncode == 2 and not (tmp_path / "cmp").exists()
    assert proc.stderr.splitlines() == [f"error: --longer {tmp_path / 'no_such'}: no runs (metrics.jsonl, "
                                        "metrics.jsonl.gz or tb/) found here or below"]


def compare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return run_python(["scripts/compare_runs.py", *args, "--out", str(tmp_path / "cmp")], timeout=120)


def test_cli_refuses_runs_on_different_corpora_in_one_line(tmp_path):
    write_run(tmp_path / "muon", "muon", 1e-3, [3.0, 2.0], corpus="aaaaaaaaaaaa")
    write_run(tmp_path / "adamw", "adamw", 1e-3, [3.0, 2.5], corpus="bbbbbbbbbbbb")
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"))
    assert proc.returncode == 2 and not (tmp_path / "cmp").exists()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: runs trained on different corpora")
    assert "aaaaaaaaaaaa" in lines[0] and "bbbbbbbbbbbb" in lines[0] and "--allow-mixed-corpora" in lines[0]

    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"), "--allow-mixed-corpora")
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "cmp" / "summary.md").read_text()
    assert "**Mixed corpora (--allow-mixed-corpora)" in summary
    assert "corpus aaaaaaaaaaaa" in summary and "corpus bbbbbbbbbbbb" in summary


def test_cli_refuses_a_longer_run_on_another_corpus_and_a_run_without_one(tmp_path):
    write_run(tmp_path / "muon", "muon", 1e-3, [3.0, 2.0], corpus="aaaaaaaaaaaa")
    write_run(tmp_path / "adamw", "adamw", 1e-3, [3.0, 2.5], corpus="aaaaaaaaaaaa")
    write_run(tmp_path / "longer", "adamw", 1e-3, [3.0, 2.5, 2.0], corpus="cccccccccccc")
    write_run(tmp_path / "old", "adamw", 1e-3, [3.0, 2.6])  # from before corpus ids
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"), "--longer", str(tmp_path / "longer"))
    assert proc.returncode != 0 and "cccccccccccc" in proc.stderr and "aaaaaaaaaaaa" in proc.stderr
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "old"))
    assert proc.returncode != 0 and "corpus unknown" in proc.stderr


def test_summary_states_the_corpus_precision_and_each_sides_environment(tmp_path):
    write_run(tmp_path / "muon", "muon", 1e-3, [3.0, 2.0], corpus="aaaaaaaaaaaa", precision="fp32")
    write_run(tmp_path / "adamw", "adamw", 1e-3, [3.0, 2.5], corpus="aaaaaaaaaaaa", precision="fp32")
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"))
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "cmp" / "summary.md").read_text().splitlines()
    assert "Corpus: aaaaaaaaaaaa (every run)" in summary
    assert "Precision: fp32 (every run)" in summary
    env = "corpus aaaaaaaaaaaa; commit 0123456789; Python 3.11.7, torch 2.13.0; Test CPU x 1 (dp 1, tp 1)"
    assert f"- A = muon lr=0.001: precision fp32; {env} ({tmp_path / 'muon'})" in summary
    assert f"- B = adamw lr=0.001: precision fp32; {env} ({tmp_path / 'adamw'})" in summary


def test_a_run_resumed_on_another_corpus_matches_neither(tmp_path):
    write_run(tmp_path / "muon", "muon", 1e-3, [3.0, 2.0], corpus="aaaaaaaaaaaa")
    write_run(tmp_path / "adamw", "adamw", 1e-3, [3.0, 2.5], corpus="aaaaaaaaaaaa")
    env_file = tmp_path / "adamw" / "environment.json"
    env = json.loads(env_file.read_text())
    env["resumes"] = [{"step": 1, **env, "corpus": {"id": "bbbbbbbbbbbb"}}]
    env_file.write_text(json.dumps(env))
    assert load_run(tmp_path / "adamw").corpus_id == "aaaaaaaaaaaa+bbbbbbbbbbbb"
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"))
    assert proc.returncode != 0 and "corpus aaaaaaaaaaaa+bbbbbbbbbbbb" in proc.stderr


def test_a_qk_clip_run_is_labelled_with_its_tau_and_kept_apart_from_the_unclipped_one(tmp_path):
    from eval.seeds import group_arms

    write_run(tmp_path / "off", "muon", 3e-2, [5, 4, 3], seed=0)
    write_run(tmp_path / "on", "muon", 3e-2, [5, 4, 3.1], seed=0)
    config = tmp_path / "on" / ".hydra" / "config.yaml"
    config.write_text(config.read_text().rstrip("\n") + "\n  qk_clip:\n    enabled: true\n    tau: 30.0\n")
    off, on = load_run(tmp_path / "off"), load_run(tmp_path / "on")
    assert (off.label, on.label) == ("muon lr=0.03", "muon lr=0.03 qk_clip tau=30")
    assert [arm.label for arm in group_arms([off, on])] == [off.label, on.label]


@pytest.mark.parametrize("ns_method, label", [("standard", "muon"), ("gram", "muon+gram_ns"),
                                               ("auto", "muon+auto_ns")])
def test_each_newton_schulz_method_is_its_own_optimizer_setting(ns_method, label):
    """auto runs Gram on some shapes only: neither plain Muon's arithmetic nor gram's."""
    from eval.compare import optimizer_setting

    assert optimizer_setting({"name": "muon", "muon": {"ns_method": ns_method}}) == label
    assert optimizer_setting({"name": "muon", "cautious_wd": True, "muon": {"ns_method": ns_method, "normuon": True}}) \
        == label.replace("muon", "muon+normuon+cautious_wd", 1)
    assert optimizer_setting({"name": "muon"}) == "muon"  # configs from before ns_method
    assert optimizer_setting({"name": "adamw", "muon": {"ns_method": ns_method}}) == "adamw"


def test_a_sweep_of_one_optimizer_gets_its_table_with_the_best_lr_per_length(tmp_path):
    """Tuning one optimizer alone (AdamW's lr at a longer schedule): nothing to compare, but the
    table of finals is the result, with the best lr at each length marked."""
    def curve(scale: float, steps: int) -> list[float]:
        return [scale * 10.0 / s for s in range(1, steps + 1)]

    for lr, scale in ((7e-4, 1.2), (1e-3, 1.0), (1.4e-3, 1.1)):
        write_run(tmp_path / "sweep" / f"{lr:g}_40", "adamw", lr, curve(scale, 40), corpus="c0ffee")
    write_run(tmp_path / "sweep" / "7e-4_80", "adamw", 7e-4, curve(0.9, 80), corpus="c0ffee")
    write_run(tmp_path / "sweep" / "1e-3_80", "adamw", 1e-3, curve(1.05, 80), corpus="c0ffee")
    proc = compare(tmp_path, str(tmp_path / "sweep"))
    assert proc.returncode == 0, proc.stderr
    rows = [line.replace(" ", "") for line in proc.stdout.splitlines() if line.startswith("| adamw")]
    assert rows == [
        "|adamw|40|0.0007|0.4000|1.3000|", "|adamw(best)|40|0.001|0.3500|1.2500|", "|adamw|40|0.0014|0.3750|1.2750|",
        "|adamw(best)|80|0.0007|0.2125|1.1125|", "|adamw|80|0.001|0.2313|1.1313|",
    ]
    assert "Corpus: c0ffee (every run)" in (tmp_path / "cmp" / "summary.md").read_text()
    # inside its grid at 40 steps, at its edge at 80
    edge = ("the best lr of adamw at 80 steps, 0.0007, is the lowest of its grid (0.0007, 0.001): the best may lie "
            "below it; extend the grid below 0.0007")
    assert [line for line in proc.stderr.splitlines() if "grid" in line] == [f"warning: {edge}"]
    assert f"**Warning: {edge}.**" in (tmp_path / "cmp" / "summary.md").read_text().splitlines()
    (tmp_path / "sweep" / "1e-3_80" / "environment.json").write_text('{"corpus": {"id": "beef"}}')
    proc = compare(tmp_path, str(tmp_path / "sweep"))
    assert proc.returncode != 0 and "runs trained on different corpora" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("n_arms", [2, 6])
def test_a_legend_per_panel_for_a_few_arms_and_one_below_the_figure_for_many(n_arms):
    """Six arms' labels inside a panel would cover the curves (the Muon-family sweep)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from scripts.compare_plots import add_legend

    fig, axes = plt.subplots(1, 2)
    for ax in axes:
        for i in range(n_arms):
            ax.plot([0, 1], [i, i + 1], label=f"arm {i}")
    add_legend(fig, list(axes), n_arms)
    panel_legends = [ax.get_legend() for ax in axes]
    if n_arms <= 3:
        assert all(leg is not None for leg in panel_legends) and not fig.legends
    else:
        assert all(leg is None for leg in panel_legends) and len(fig.legends) == 1
        assert [t.get_text() for t in fig.legends[0].get_texts()] == [f"arm {i}" for i in range(n_arms)]
        # below the axes: its anchor is at the figure's bottom edge
        assert fig.legends[0].get_bbox_to_anchor().y0 == approx(0.0)
    plt.close(fig)


def test_cli_refuses_arms_in_different_precisions_in_one_line_unless_allowed(tmp_path):
    """trainer.precision=auto resolves per run: a bf16 arm beside an fp32 arm is refused like
    mixed corpora (one line, exit 2, nothing written); the flag compares them, said in bold."""
    write_run(tmp_path / "muon", "muon", 1e-3, [3.0, 2.0], corpus="aaaaaaaaaaaa", precision="bf16")
    write_run(tmp_path / "adamw", "adamw", 1e-3, [3.0, 2.5], corpus="aaaaaaaaaaaa", precision="fp32")
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"))
    assert proc.returncode == 2 and not (tmp_path / "cmp").exists()
    named = (f"muon lr=0.001 in bf16 ({tmp_path / 'muon'}), adamw lr=0.001 in fp32 ({tmp_path / 'adamw'})")
    assert proc.stderr.strip().splitlines() == [
        f"error: arms ran in different precisions: {named}; pass --allow-mixed-precision to compare them anyway"]

    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"), "--allow-mixed-precision")
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "cmp" / "summary.md").read_text().splitlines()
    assert f"**Mixed precisions (--allow-mixed-precision): arms ran in different precisions: {named}.** " \
           "Loss differences below mix the optimizers' effect with the arithmetic's." in summary
    assert any(line.startswith("- A = muon lr=0.001: precision bf16; corpus aaaaaaaaaaaa;") for line in summary)
    assert any(line.startswith("- B = adamw lr=0.001: precision fp32; corpus aaaaaaaaaaaa;") for line in summary)


def test_an_auto_run_without_its_resolution_is_unknown_and_an_explicit_one_counts(tmp_path):
    """.hydra/config.yaml holds what was asked: "auto" says nothing about what ran, so such a
    run (from before resolved_config.yaml) is "unknown" and refused beside an fp32 one; an
    explicit fp32 ran as fp32."""
    import scripts.compare_runs as cr

    write_run(tmp_path / "muon", "muon", 1e-3, [3.0, 2.0], precision="fp32")
    for name, asked in (("auto", "auto"), ("explicit", "fp32")):
        write_run(tmp_path / name, "adamw", 1e-3, [3.0, 2.5])
        config = tmp_path / name / ".hydra" / "config.yaml"
        config.write_text(config.read_text() + f"trainer:\n  precision: {asked}\n")
    # resolved_config.yaml wins over the asked "auto"
    write_run(tmp_path / "resolved", "adamw", 1e-3, [3.0, 2.5], precision="bf16")
    config = tmp_path / "resolved" / ".hydra" / "config.yaml"
    config.write_text(config.read_text() + "trainer:\n  precision: auto\n")
    assert [cr.run_precision(load_run(tmp_path / n)) for n in ("muon", "auto", "explicit", "resolved")] == [
        "fp32", "unknown", "fp32", "bf16"]

    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "auto"))
    assert proc.returncode == 2 and f"adamw lr=0.001 in unknown ({tmp_path / 'auto'})" in proc.stderr
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "explicit"))
    assert proc.returncode == 0, proc.stderr
    assert "Precision: fp32 (every run)" in proc.stdout.splitlines()


def test_seeds_on_which_auto_resolved_differently_form_a_mixed_arm(tmp_path):
    """Seeds of one setting run on other machines can resolve "auto" differently: the arm is
    "bf16+fp32", refused even alone, and never taken for a bf16 or an fp32 arm."""
    import scripts.compare_runs as cr
    from eval.seeds import group_arms

    write_run(tmp_path / "s0", "muon", 1e-3, [3.0, 2.0], seed=0, precision="bf16")
    write_run(tmp_path / "s1", "muon", 1e-3, [3.0, 2.1], seed=1, precision="fp32")
    write_run(tmp_path / "s2", "muon", 1e-3, [3.0, 2.2], seed=2, precision="fp32")
    (arm,) = group_arms([load_run(tmp_path / n) for n in ("s0", "s1", "s2")])
    assert cr.arm_precision(arm) == "bf16+fp32"
    assert cr.mixed_precisions([arm]) == f"arms ran in different precisions: muon lr=0.001 (3 seeds) in bf16+fp32 " \
                                         f"({tmp_path / 's0'})"
    (fp32,) = group_arms([load_run(tmp_path / n) for n in ("s1", "s2")])
    assert cr.arm_precision(fp32) == "fp32" and cr.mixed_precisions([fp32]) is None


def test_a_sweep_of_one_optimizer_in_mixed_precisions_is_refused(tmp_path):
    write_run(tmp_path / "sweep" / "0", "adamw", 1e-3, [3.0, 2.0], precision="fp32")
    write_run(tmp_path / "sweep" / "1", "adamw", 3e-3, [3.0, 2.1], precision="bf16")
    proc = compare(tmp_path, str(tmp_path / "sweep"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1
    assert "adamw lr=0.001 in fp32" in lines[0] and "adamw lr=0.003 in bf16" in lines[0]
    proc = compare(tmp_path, str(tmp_path / "sweep"), "--allow-mixed-precision")
    assert proc.returncode == 0, proc.stderr
    assert "**Mixed precisions (--allow-mixed-precision): arms ran in different precisions:" in proc.stdout


@pytest.mark.parametrize("n_points, marker", [(1, "o"), (5, "o"), (19, "o"), (20, "None"), (100, "None")])
def test_curves_with_few_points_are_drawn_with_markers(n_points, marker):
    """A run that logged one point would otherwise draw a line of zero length: nothing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.compare import Run
    from eval.seeds import Arm
    from scripts.compare_plots import plot_curve

    steps = list(range(10, 10 * (n_points + 1), 10))
    run = Run(Path("r"), "muon", 1e-3, {"val/val/loss": (steps, [1.0 / s for s in steps])})
    fig, ax = plt.subplots()
    plot_curve(ax, Arm([run]), "val/val/loss")
    (line,) = ax.lines
    assert line.get_marker() == marker
    assert list(line.get_xdata()) == steps and line.get_label() == "muon lr=0.001"
    plt.close(fig)


def test_the_logging_interval_is_read_from_the_steps_or_else_the_config():
    from eval.compare import Run
    from scripts.compare_runs import logging_interval

    config = {"logger": {"interval": 25}, "eval": {"interval": 50}}
    # the last step is logged off the grid: the commonest gap counts, not the last one
    run = Run(Path("r"), "muon", 1e-3, {"train/loss": ([10, 20, 30, 35], [4.0, 3.0, 2.0, 1.9]),
                                        "val/val/loss": ([35], [2.0])}, config=config)
    assert logging_interval(run, "train/loss") == 10
    assert logging_interval(run, "val/val/loss") == 50  # one point: eval.interval from the config
    run.series["train/loss"] = ([35], [1.9])
    assert logging_interval(run, "train/loss") == 25  # logger.interval
    run.config = {"eval": {"interval": 0}}  # evaluated only at the end: no interval to state
    assert logging_interval(run, "val/val/loss") is None and logging_interval(run, "train/loss") is None


def in_run_rows(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("## In-run leading steps"))
    return {line.split("|")[1].strip(): line for line in lines[start:] if line.startswith("| ") and "/" in line}


def test_the_in_run_table_states_its_resolution_and_ratios_within_it(tmp_path):
    """Logged every 10 steps: A reaches B's final loss at step 95.5 (interpolated), B's run ends
    at 100, 4.5 steps apart: less than one interval, so ratio 1.047 cannot be told from 1.
    A twofold difference (100 vs 50 steps) is well outside it."""
    steps = range(10, 101, 10)
    write_run(tmp_path / "muon", "muon", 1e-3, [10.0 / s for s in steps], every=10)
    write_run(tmp_path / "close", "adamw", 1e-3, [10.5 / s for s in steps], every=10)
    write_run(tmp_path / "slow", "adamw", 3e-3, [20.0 / s for s in steps], every=10)
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "close"), "--alpha", "1")
    assert proc.returncode == 0, proc.stderr
    assert "| loss | A final | B final | logged every | B steps | A steps | ratio B/A | at the final loss of |" \
        in proc.stdout
    rows = in_run_rows(proc.stdout)
    assert rows["train/loss"] == "| train/loss | 0.1000 | 0.1050 | 10 | 100 | 95.5 | 1.047, within resolution | B |"
    assert rows["val/val/loss"] == "| val/val/loss | 0.2000 | 0.2050 | 10 | 100 | 95.5 | 1.047, within resolution | B |"
    note = next(line for line in proc.stdout.splitlines() if line.startswith("Resolution: "))
    assert "one logging interval" in note and "cannot be told from 1" in note

    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "slow"), "--alpha", "1")
    assert proc.returncode == 0, proc.stderr
    assert in_run_rows(proc.stdout)["train/loss"] == "| train/loss | 0.1000 | 0.2000 | 10 | 100 | 50 | 2.000 | B |"


MUON_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_o", "mlp_in", "mlp_out")


def test_per_family_lr_and_weight_decay_name_the_setting_and_defaults_keep_todays_label(tmp_path):
    """optim.lr_overrides, a non-default optim.weight_decay and optim.weight_decay_overrides are
    part of the setting's name (and so of every label, table row and legend entry), families
    sorted and one value named once; entries that change nothing (a 1x lr, a weight decay equal
    to optim.weight_decay) and the defaults leave the name as it was."""
    from eval.seeds import group_arms

    settings = {
        "plain": {},
        "defaults": {"weight_decay": 0.1, "lr_overrides": {}, "weight_decay_overrides": {}},
        "no_op": {"lr_overrides": {"attn_q": 1.0}, "weight_decay_overrides": {"embed": 0.1}},
        "lr": {"lr_overrides": {"norm": 0.1, "head": 0.1, "embed": 0.1}},
        "lr_two": {"lr_overrides": {"norm": 0.1, "head": 0.1, "embed": 0.5}},
        "wd": {"weight_decay": 0.3},
        "wd_matrices": {"weight_decay_overrides": {kind: 0.3 for kind in MUON_MATRICES}},
        "both": {"weight_decay": 0.0, "lr_overrides": {"embed": 0.1},
                 "weight_decay_overrides": {"mlp_in": 0.3, "norm": 0.0}},
    }
    for name, optim in settings.items():
        write_run(tmp_path / name, "muon", 1e-2, [5, 4, 3], seed=0, optim=optim)
    runs = {name: load_run(tmp_path / name) for name in settings}
    assert {name: run.label for name, run in runs.items()} == {
        "plain": "muon lr=0.01",
        "defaults": "muon lr=0.01",
        "no_op": "muon lr=0.01",
        "lr": "muon+lr×(embed, head, norm: 0.1) lr=0.01",
        "lr_two": "muon+lr×(embed: 0.5; head, norm: 0.1) lr=0.01",
        "wd": "muon+wd=0.3 lr=0.01",
        "wd_matrices": "muon+wd(attn_k, attn_o, attn_q, attn_v, mlp_in, mlp_out: 0.3) lr=0.01",
        "both": "muon+lr×(embed: 0.1)+wd=0+wd(mlp_in: 0.3) lr=0.01",
    }
    # each setting is its own arm, and its own best lr: none hides another
    named = [runs[name] for name in ("plain", "lr", "wd", "wd_matrices")]
    assert [arm.label for arm in group_arms(named)] == [run.label for run in named]
    assert sorted(r.optimizer for r in best_per_optimizer(named, "train/loss")) == sorted(r.optimizer for r in named)


def test_a_weight_decay_experiment_gets_a_row_per_setting_paired_with_the_plain_one(tmp_path):
    """Muon at weight decay 0.1 and 0.3, three seeds each, beside AdamW: before, both Muon arms
    were "muon" and only the better one survived the best-lr choice."""
    for seed, c in ((0, 3.0), (1, 3.4), (2, 2.8)):
        write_run(tmp_path / "muon" / str(seed), "muon", 1e-2, [c + 1, c], seed=seed)
        write_run(tmp_path / "wd" / str(seed), "muon", 1e-2, [c + 1, c - 0.05 * (seed + 1)], seed=seed,
                  optim={"weight_decay": 0.3})
        write_run(tmp_path / "adamw" / str(seed), "adamw", 1e-3, [c + 2, c + 0.5], seed=seed)
    proc = compare(tmp_path, *(str(tmp_path / n) for n in ("muon", "wd", "adamw")))
    assert proc.returncode == 0, proc.stderr
    assert "## In-run leading steps: A = muon lr=0.01 (3 seeds), B = adamw lr=0.001 (3 seeds)" in proc.stdout
    table = proc.stdout.split("## Every optimizer setting, at its best lr")[1].split("\n## ")[0]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert list(rows)[2:] == ["muon (A)", "adamw (B)", "muon+wd=0.3"]
    # the paired difference of the 0.3 arm from plain Muon: -0.05, -0.10, -0.15 by seed
    assert "| -0.1000 ± 0.0289 (95% CI -0.224 to +0.024) |" in rows["muon+wd=0.3"]


OUTPUT_RMS_FINALS = {  # per seed: layers 0..2, then the final normed state
    "muon": {0: [10.0, 40.0, 60.0, 0.5], 1: [20.0, 50.0, 66.0, 0.6], 2: [30.0, 45.0, 63.0, 0.7]},
    "adamw": {0: [1.0, 1.5, 2.0, 1.05]},
}


def write_output_rms_runs(root: Path) -> None:
    for optimizer, seeds in OUTPUT_RMS_FINALS.items():
        for seed, values in seeds.items():
            write_run(root / optimizer / str(seed), optimizer, 1e-2 if optimizer == "muon" else 1e-3,
                      [5.0, 4.0, 3.0 + 0.1 * seed], seed=seed, output_rms=values)


def test_the_output_rms_profile_is_each_arms_last_logged_value_by_layer(tmp_path):
    """The panel's points: each layer's last logged output RMS (not an earlier or a mean one),
    mean +- standard error over the seeds, layers by index and the final state after them."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.seeds import group_arms
    from scripts.compare_profiles import depth_profiles, draw_output_rms

    write_output_rms_runs(tmp_path)
    arms = group_arms([load_run(p) for p in find_runs(tmp_path)])
    profiles = {profile.arm.optimizer: profile for profile in depth_profiles(arms)}
    muon, adamw = profiles["muon"], profiles["adamw"]
    finals = list(zip(*OUTPUT_RMS_FINALS["muon"].values()))  # per layer, the three seeds' values
    assert [i for i, _ in muon.layers] == [0, 1, 2]
    for (_, est), values in zip(muon.layers + [(3, muon.final)], finals):
        assert est.n == 3 and est.mean == approx(statistics.fmean(values))
        assert est.se == approx(statistics.stdev(values) / 3 ** 0.5)
    assert [est.mean for _, est in adamw.layers] == approx([1.0, 1.5, 2.0]) and adamw.final.se is None

    fig, ax = plt.subplots()
    draw_output_rms(ax, [muon, adamw])
    layer_lines = [c for c in ax.containers if c.get_label() in (muon.name, adamw.name)]
    assert [c.get_label() for c in layer_lines] == ["muon lr=0.01 (3 seeds)", "adamw lr=0.001"]
    assert list(layer_lines[0].lines[0].get_xdata()) == [0, 1, 2]
    assert list(layer_lines[0].lines[0].get_ydata()) == approx([statistics.fmean(v) for v in finals[:3]])
    assert list(layer_lines[1].lines[0].get_ydata()) == approx([1.0, 1.5, 2.0])
    final_points = [c.lines[0] for c in ax.containers if c not in layer_lines]
    assert [(list(p.get_xdata()), list(p.get_ydata())) for p in final_points] == [([3], [approx(0.6)]),
                                                                                ([3], [approx(1.05)])]
    assert final_points[0].get_color() == layer_lines[0].lines[0].get_color()
    assert layer_lines[0].has_yerr and not layer_lines[1].has_yerr  # one seed: no bar
    assert ax.get_yscale() == "log" and ax.get_xticklabels()[-1].get_text() == "final"
    plt.close(fig)


def test_cli_writes_the_output_rms_panel_and_its_table_and_names_runs_without_it(tmp_path):
    write_output_rms_runs(tmp_path)
    write_run(tmp_path / "muon" / "3", "muon", 1e-2, [5.0, 4.0, 3.3], seed=3)  # from before the metric
    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cmp" / "output_rms_by_layer.png").stat().st_size > 1000
    section = (tmp_path / "cmp" / "summary.md").read_text().split("## Output RMS by layer at the end of the run")[1]
    lines = section.splitlines()
    assert "| setting | layer 0 | layer 1 | layer 2 | final |" in lines
    # seed 3 logged none: the arm's row is over seeds 0-2; layer 0's 10, 20, 30: mean 20, se 10/sqrt(3)
    assert "| muon lr=0.01 (3 seeds) | 20.000 ± 5.774 | 45.000 ± 2.887 | 63.000 ± 1.732 | 0.600 ± 0.058 |" in lines
    assert "| adamw lr=0.001 | 1.000 | 1.500 | 2.000 | 1.050 |" in lines
    assert f"- {tmp_path / 'muon' / '3'}" in lines[lines.index("Left out, no model/output_rms/layer_<i> logged:"):]

    (tmp_path / "cmp" / "output_rms_by_layer.png").unlink()
    (tmp_path / "muon" / "3").rename(tmp_path / "old_muon")
    write_run(tmp_path / "old_adamw", "adamw", 1e-3, [5.0, 4.0, 3.5], seed=3)
    proc = compare(tmp_path, str(tmp_path / "old_muon"), str(tmp_path / "old_adamw"))
    assert proc.returncode == 0, proc.stderr
    assert "No compared run logged model/output_rms/layer_<i>: no output_rms_by_layer.png." in proc.stdout
    assert "No compared run logged model/weight_rms/<kind> or attn/max_logit/layer_<i>." in proc.stdout
    assert not (tmp_path / "cmp" / "output_rms_by_layer.png").exists()


def test_a_sweep_of_one_optimizer_gets_the_output_rms_panel_too(tmp_path):
    """Every lr of the sweep, each at its own length: same label, told apart by its steps."""
    write_run(tmp_path / "sweep" / "a", "adamw", 1e-3, [5.0, 4.0], output_rms=[1.0, 2.0, 1.1])
    write_run(tmp_path / "sweep" / "b", "adamw", 1e-3, [5.0, 4.0, 3.0], output_rms=[3.0, 4.0, 1.2])
    proc = compare(tmp_path, str(tmp_path / "sweep"))
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "cmp" / "summary.md").read_text().splitlines()
    assert "| adamw lr=0.001, 2 steps | 1.000 | 2.000 | 1.100 |" in lines
    assert "| adamw lr=0.001, 3 steps | 3.000 | 4.000 | 1.200 |" in lines
    assert (tmp_path / "cmp" / "output_rms_by_layer.png").stat().st_size > 1000


# Per optimizer and seed: the last step's weight RMS by kind (in the order logged, not sorted)
# and attention logit by layer.
WEIGHTS_FINALS = {
    "muon": {0: ({"norm": 0.86, "attn_q": 0.0719, "embed": 0.0654}, [15.5, 67.7, 33.9]),
             1: ({"norm": 0.87, "attn_q": 0.0714, "embed": 0.0648}, [42.1, 30.2, 68.2]),
             2: ({"norm": 0.85, "attn_q": 0.0724, "embed": 0.0656}, [58.6, 12.0, 20.4])},
    "adamw": {0: ({"norm": 0.987, "attn_q": 0.0225, "embed": 0.0211}, [30.2, 8.0, 11.5])},
}


def weights_row(name: str, finals: list[tuple[dict[str, float], list[float]]]) -> str:
    """The row the seeds' `finals` should give: each kind (sorted) and the largest logit over the
    layers, mean ± standard error over the seeds, or the plain value for one seed."""
    import statistics

    def cell(values: list[float], spec: str) -> str:
        if len(values) == 1:
            return format(values[0], spec)
        return f"{statistics.fmean(values):{spec}} ± {statistics.stdev(values) / len(values) ** 0.5:{spec}}"

    kinds = sorted(finals[0][0])
    cells = [cell([rms[kind] for rms, _ in finals], ".5f") for kind in kinds]
    return f"| {name} | " + " | ".join(cells + [cell([max(logits) for _, logits in finals], ".2f")]) + " |"


def test_the_weights_table_is_each_arms_last_weight_rms_and_largest_last_logit(tmp_path):
    """Each kind's last logged weight RMS and each run's largest last logged logit over the layers
    (not the largest over the run), mean ± se over the seeds; a run without them is named."""
    for optimizer, seeds in WEIGHTS_FINALS.items():
        for seed, (rms, logits) in seeds.items():
            write_run(tmp_path / optimizer / str(seed), optimizer, 1e-2 if optimizer == "muon" else 1e-3,
                      [5.0, 4.0, 3.0 + 0.1 * seed], seed=seed, weight_rms=rms, max_logit=logits)
    write_run(tmp_path / "muon" / "3", "muon", 1e-2, [5.0, 4.0, 3.3], seed=3)  # from before the metrics
    muon_row = weights_row("muon lr=0.01 (3 seeds)", list(WEIGHTS_FINALS["muon"].values()))
    # seeds 0-2's largest logits 67.7, 68.2, 58.6; norm's 0.86, 0.87, 0.85
    assert muon_row == ("| muon lr=0.01 (3 seeds) | 0.07190 ± 0.00029 | 0.06527 ± 0.00024 | 0.86000 ± 0.00577 "
                        "| 64.83 ± 3.12 |")
    title = "## Weights and attention logits at the end of the run"

    proc = compare(tmp_path, str(tmp_path / "muon"), str(tmp_path / "adamw"))
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "cmp" / "summary.md").read_text().split(title)[1].splitlines()
    table = lines.index("| setting | attn_q | embed | norm | max logit |")
    assert lines[table + 2:table + 4] == [muon_row, "| adamw lr=0.001 | 0.02250 | 0.02110 | 0.98700 | 30.20 |"]
    left_out = lines.index("Left out, no model/weight_rms/<kind> or attn/max_logit/layer_<i> logged:")
    assert lines[left_out + 2] == f"- {tmp_path / 'muon' / '3'}"

    proc = compare(tmp_path, str(tmp_path / "muon"))  # a sweep of one optimizer gets it too
    assert proc.returncode == 0, proc.stderr
    assert muon_row in (tmp_path / "cmp" / "summary.md").read_text().split(title)[1].splitlines()
