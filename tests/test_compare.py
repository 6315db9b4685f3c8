"""Run comparison: leading steps on synthetic curves with known answers, EWM, run loading."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval.compare import best_per_optimizer, ewm, find_runs, leading_steps, load_run
from tests.conftest import REPO


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


def test_ewm_is_bias_corrected_and_follows_the_recurrence():
    assert ewm([4.0, 4.0, 4.0], 0.05) == pytest.approx([4.0, 4.0, 4.0])
    values = [1.0, 3.0, 2.0]
    m1 = 1.0
    m2 = (0.5 * 0.5 * 1.0 + 0.5 * 3.0) / (0.5 * 0.5 + 0.5)
    assert ewm(values, 0.5)[:2] == pytest.approx([m1, m2])
    with pytest.raises(ValueError):
        ewm(values, 0.0)


def write_run(path: Path, optimizer: str, lr: float, losses: list[float]) -> None:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "config.yaml").write_text(f"optim:\n  name: {optimizer}\n  lr: {lr}\n")
    with open(path / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, start=1):
            f.write(json.dumps({"step": step, "tokens": step * 10, "train/loss": loss,
                                "val/val/loss": loss + 0.1, "val/ood_prose/loss": loss + 1}) + "\n")


def test_sweep_dirs_keep_the_best_lr_per_optimizer(tmp_path):
    write_run(tmp_path / "sweep" / "0", "muon", 1e-3, [5, 4, 3.5])
    write_run(tmp_path / "sweep" / "1", "muon", 3e-3, [5, 4, 3.0])
    write_run(tmp_path / "sweep" / "2", "adamw", 1e-3, [5, 4.5, 4.0])
    write_run(tmp_path / "sweep" / "00", "adamw", 1e-2, [5, 9, float("nan")])  # diverged, read first
    runs = [load_run(p) for p in find_runs(tmp_path / "sweep")]
    best = {r.optimizer: r.lr for r in best_per_optimizer(runs)}
    assert best == {"muon": 3e-3, "adamw": 1e-3}


def test_cli_writes_plots_and_the_summary_ratio(tmp_path):
    write_run(tmp_path / "muon", "muon", 1e-3, [10.0 / s for s in range(1, 51)])
    write_run(tmp_path / "adamw", "adamw", 1e-3, [20.0 / s for s in range(1, 101)])
    proc = subprocess.run([sys.executable, "scripts/compare_runs.py", str(tmp_path / "adamw"),
                           str(tmp_path / "muon"), "--out", str(tmp_path / "cmp"), "--alpha", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "cmp" / "losses.png").stat().st_size > 1000
    assert (tmp_path / "cmp" / "leading_steps.png").stat().st_size > 1000
    assert "A = muon" in proc.stdout
    # Muon's final loss (10/50) is AdamW's at step 100: 100 steps vs 50, ratio 2
    for key in ("train/loss", "val/val/loss", "val/ood_prose/loss"):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {key} "))
        assert row.replace(" ", "").endswith("|100|50|2.000|"), row


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
