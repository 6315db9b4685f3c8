"""hydra/sweeper=fair: the sweeper of a fair Muon-vs-AdamW study (scripts/fair_compare.py).

It runs the study's plan (STUDY/records/plan.json) through the configured Hydra launcher: the
basic launcher runs one run after another in this process, `hydra/launcher=local` several side
by side (joblib), `hydra/launcher=slurm` each on its own SLURM allocation (submitit). The
stages live in _study.py, imported only when a sweep starts: Hydra imports this module at every
start-up of train.py, to find its plugins.

Hydra accepts a plugin only under the `hydra_plugins` namespace package, and finds it through
sys.path: this folder is that package's share in the repository (it must hold no __init__.py at
hydra_plugins/ itself, or the installed launchers' share would be hidden). Hydra loads this file
without entering it in sys.modules, so its dataclass has no postponed annotations (no
`from __future__ import annotations`): they could not be resolved.
"""

from dataclasses import dataclass
from typing import Any, List

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper


@dataclass
class FairSweeperConf:
    _target_: str = "hydra_plugins.fair_sweeper.fair_sweeper.FairSweeper"
    plan: str = "???"  # STUDY/records/plan.json, written by scripts/fair_compare.py


ConfigStore.instance().store(group="hydra/sweeper", name="fair", node=FairSweeperConf, provider="fair_sweeper")


class FairSweeper(Sweeper):
    def __init__(self, plan: str) -> None:
        self.plan = plan
        self.config: Any = None
        self.launcher: Any = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        """`arguments`, the command line's task overrides, are the plan's base overrides, which
        train.py checked before this started; every run's own come from the plan."""
        from hydra_plugins.fair_sweeper._study import StudyRunner

        return StudyRunner(self.plan, self.config, self.launcher).run()
