"""lab/tools/gpu/reference_bf16.py (`make compare-gpu`, check-gpu's compare-bf16 step) without a GPU:
it reruns a fair study's tuned choice through `fair_compare.py --rerun` in bf16, on fresh seeds,
the ladder's largest dense rung by default, and quotes the report's speedup table. (The rerun
itself is tested in test_fair_compare.py, on a CPU.)"""
from __future__ import annotations

import shutil
from pathlib import Path

from lab.tools.gpu import reference_bf16
from tests.conftest import REPO

SMOKE = REPO / "lab" / "results" / "fair_smoke"


def test_the_command_is_a_rerun_in_bf16_on_fresh_seeds_with_extra_overrides_last():
    argv = reference_bf16.rerun_argv("python3", Path("S"), Path("O"), [100, 101], 4, ["model.qk_norm=true"])
    assert argv[:6] == ["python3", str(REPO / "scripts" / "fair_compare.py"), "--rerun", "S", "--out", "O"]
    assert {"compare.seeds=[100,101]", "trainer.precision=bf16", "optim.muon.ns_dtype=bf16",
            "hydra/launcher=local", "hydra.launcher.n_jobs=4", "logger.wandb.mode=disabled"} <= set(argv)
    assert argv[-1] == "model.qk_norm=true"
    assert not any("launcher" in a for a in reference_bf16.rerun_argv("p", Path("S"), Path("O"), [1, 2], 1, []))


def test_the_default_study_is_the_ladders_largest_dense_rung(tmp_path):
    """Three rungs made of the smoke study's records: the deepest dense one wins, the MoE never."""
    import json

    for name, update in (("a", {"n_layers": 2}), ("b", {"n_layers": 6}), ("c", {"n_layers": 8, "n_experts": 4})):
        shutil.copytree(SMOKE / "records", tmp_path / name / "records")
        plan_path = tmp_path / name / "records" / "plan.json"
        plan = json.loads(plan_path.read_text())
        plan["model"].update(update)
        plan_path.write_text(json.dumps(plan))
    assert reference_bf16.largest_dense_rung(tmp_path) == tmp_path / "b"
    assert reference_bf16.largest_dense_rung(tmp_path / "none") is None


def test_the_speedup_table_is_quoted_from_the_report():
    section = reference_bf16.speedup_section(SMOKE / "report" / "comparison.md")
    lines = section.splitlines()
    assert lines[0] == "| split | speedup | 95% interval (seed noise given the chosen settings) | one-sided p |"
    assert lines[2].startswith("| val/val/loss | ")
    assert reference_bf16.speedup_section(Path("/no/such/report.md")) == ""
