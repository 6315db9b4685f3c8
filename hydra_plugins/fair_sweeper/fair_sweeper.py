"""hydra/sweeper=fair: a fair study's runs through whichever Hydra launcher is configured.

The study itself (its stages, records and progress) is study/runner.py; this file only hands it
the launcher as a callable. The basic launcher runs one run after another in this process,
`hydra/launcher=local` several side by side (joblib), `hydra/launcher=slurm` each on its own
SLURM allocation (submitit). scripts/fair_compare.py starts it (study/driver.py).

Hydra accepts a plugin only under the `hydra_plugins` namespace package, and finds it through
sys.path: this folder is that package's share in the repository (it must hold no __init__.py at
hydra_plugins/ itself, or the installed launchers' share would be hidden). Hydra imports this
module at every start-up of train.py, so the study is imported only when a sweep starts. Hydra
loads this file without entering it in sys.modules, so its dataclass has no postponed
annotations (no `from __future__ import annotations`): they could not be resolved.
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper


@dataclass
class FairSweeperConf:
    _target_: str = "hydra_plugins.fair_sweeper.fair_sweeper.FairSweeper"
    plan: str = "???"  # STUDY/records/plan.json, written by scripts/fair_compare.py


ConfigStore.instance().store(group="hydra/sweeper", name="fair", node=FairSweeperConf, provider="fair_sweeper")


class HydraLaunch:
    """study.runner.Launch over a Hydra launcher: each job runs in its own run dir below the
    sweep dir (hydra.sweep.subdir), and comes back as the value it returned or its error."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher
        self.job = 0
        kind = type(launcher).__name__
        self.local = kind in ("BasicLauncher", "JoblibLauncher")
        self.in_flight: Optional[int] = 1 if kind == "BasicLauncher" else None
        if kind == "JoblibLauncher":  # joblib's convention: -1 is a job per core
            n_jobs = int(getattr(launcher, "joblib", {}).get("n_jobs", -1) or -1)
            self.in_flight = n_jobs if n_jobs > 0 else max(1, (os.cpu_count() or 1) + 1 + n_jobs)

    def __call__(self, jobs: Sequence[Any]) -> List[Any]:
        from hydra.core.utils import JobStatus

        from study.runner import Outcome, first_line

        results = self.launcher.launch([[*job.overrides, f"hydra.sweep.subdir={job.name}"] for job in jobs],
                                       initial_job_idx=self.job)
        self.job += len(jobs)
        # A failed job's return_value raises its error: _return_value holds it.
        return [Outcome(r._return_value) if r.status == JobStatus.COMPLETED
                else Outcome(None, first_line(r._return_value)) for r in results]


class FairSweeper(Sweeper):
    def __init__(self, plan: str) -> None:
        self.plan = plan
        self.config: Any = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        """`arguments`, the command line's task overrides, are the plan's base overrides, which
        train.py checked before this started; every run's own come from the plan."""
        from study.records import StudyError
        from study.runner import StudyRunner

        try:
            StudyRunner(Path(self.plan).parent, Path(str(self.config.hydra.sweep.dir)), HydraLaunch(self.launcher)).run()
        except StudyError as err:  # records it cannot go on with: one line, as for any bad input
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2) from None
        return []
