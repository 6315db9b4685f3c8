"""scripts/gpu/reference_bf16.py (`make compare-gpu`, check-gpu's compare-bf16 step) without running
it: the sweeps are lab/results.md's fp32 commands with bf16 added, at the fp32 protocol's best
lrs and lengths, and records of two invocations never mix. (Its whole run on gpt_tiny on a CPU
takes about two minutes: the command is in its docstring.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from scripts.gpu import reference_bf16


def test_the_sweeps_are_the_reference_protocol_in_bf16():
    runs = Path("/runs")
    argv = {name: reference_bf16.sweep_argv("python3", name, 240, runs, ["model=gpt_tiny"])
            for name in reference_bf16.SWEEPS}
    for name, a in argv.items():
        assert a[:4] == ["python3", str(reference_bf16.REPO / "train.py"), "-m", "+experiment=reference_cpu_setup"]
        assert {"trainer.precision=bf16", "optim.muon.ns_dtype=bf16", "seed=0,1,2", "logger.wandb.mode=disabled",
                f"hydra.sweep.dir={runs / name}"} <= set(a)
        assert a[-1] == "model=gpt_tiny"  # extra overrides last: they win
    steps = {name: next(x for x in a if x.startswith("trainer.max_steps=")) for name, a in argv.items()}
    assert steps == {"muon": "trainer.max_steps=240", "adamw": "trainer.max_steps=240",
                     "adamw_1.25x": "trainer.max_steps=300", "adamw_1.5x": "trainer.max_steps=360",
                     "adamw_2x": "trainer.max_steps=480"}
    lrs = {name: next(x for x in a if x.startswith("optim.lr=")) for name, a in argv.items()}
    assert lrs == {"muon": "optim.lr=1e-2", "adamw": "optim.lr=1e-3", "adamw_1.25x": "optim.lr=7e-4",
                   "adamw_1.5x": "optim.lr=7e-4", "adamw_2x": "optim.lr=1e-3"}
    assert "optim=muon" in argv["muon"] and all("optim=adamw" in argv[n] for n in reference_bf16.LONGER)


def test_records_of_two_sessions_do_not_mix(tmp_path, capsys):
    records = tmp_path / "bf16"
    reference_bf16.prepare_records(records, replace=False)  # absent: fine
    (records / "muon").mkdir(parents=True)
    with pytest.raises(SystemExit) as exit:
        reference_bf16.prepare_records(records, replace=False)
    assert exit.value.code == 2 and "--replace" in capsys.readouterr().err
    reference_bf16.prepare_records(records, replace=True)
    assert not records.exists()
