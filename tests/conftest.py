"""Shared test helpers: compose the real Hydra config exactly as train.py does."""
from __future__ import annotations

import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The vocabulary of the whole training runs the tests make on the embedded corpus: at the
# default 8192, gpt_tiny's embedding and head are 1.05M of its 1.15M parameters and the head's
# matmul most of a step, which the tests' assertions (a parallel run equals one process, a
# resume continues exactly, a fault is caught) do not need. The tokenizer and token cache for it
# are built once, like the default's (.cache/data/).
TEST_VOCAB = "data.vocab_size=1024"

# Tests never talk to wandb's servers.
os.environ.setdefault("WANDB_MODE", "disabled")
# Two cores: keep intra-op threads fixed so timings and reductions are repeatable.
torch.set_num_threads(2)

# Whether pytest_configure hid the GPUs, and CUDA_VISIBLE_DEVICES as the run found it.
CUDA_HIDDEN = pytest.StashKey[bool]()
CUDA_FOUND = pytest.StashKey["str | None"]()


def gpu_tests_excluded(markexpr: str) -> bool:
    """Whether the `-m` expression selects no test marked gpu, whatever its other markers.

    "not slow and not gpu" (make test) and "slow and not gpu" (make test-slow) exclude them;
    "gpu", "not slow" and no expression (make test-all) do not.
    """
    from _pytest.mark.expression import Expression

    if not markexpr.strip():
        return False  # no -m: every test is selected
    expression = Expression.compile(markexpr)
    names = {"gpu"}
    while True:
        # Every combination of the markers the expression asks about, gpu always present;
        # a marker it asks about only in some combinations joins the set, and all are tried again.
        asked: set[str] = set()
        others = sorted(names - {"gpu"})
        for bits in range(2 ** len(others)):
            present = {"gpu"} | {name for i, name in enumerate(others) if bits >> i & 1}

            def matcher(name: str, **kwargs) -> bool:
                asked.add(name)
                return name in present

            if expression.evaluate(matcher):
                return False
        if asked <= names:
            return True
        names |= asked


def pytest_configure(config: pytest.Config) -> None:
    # A run that selects no gpu test checks the same thing on every machine: hide the GPUs
    # from it and from every process it starts (spawned gloo ranks, train.py, torchrun), so
    # that trainer.device=auto, precision=auto and device counts read as on a CPU-only host.
    # Here, before any test module is imported: CUDA reads the variable once, at its first use
    # in a process (import torch does not use it), and test modules ask torch.cuda at import.
    config.stash[CUDA_FOUND] = os.environ.get("CUDA_VISIBLE_DEVICES")
    config.stash[CUDA_HIDDEN] = gpu_tests_excluded(config.getoption("markexpr") or "")
    if config.stash[CUDA_HIDDEN]:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_finish(session: pytest.Session) -> None:
    """A test module's long, independent work (a `start_beside_the_suite` function) starts now,
    to run beside the tests collected before it: serially, the suite leaves part of two cores
    idle (pytest's process waiting on gloo ranks and commands)."""
    # What collection imported is set aside from later garbage collections, which then scan only
    # what the tests make: a full collection of torch's and the project's objects takes a tenth
    # of a second, and runs often in a process that trains.
    gc.freeze()
    if "tests.distributed" in sys.modules:  # the gloo ranks' fork server imports as the first tests run
        sys.modules["tests.distributed"].start_fork_server()
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: its tests are not known yet
        return
    modules = {item.module for item in session.items if getattr(item, "module", None) is not None}
    for module in sorted(modules, key=lambda m: m.__name__):
        start = getattr(module, "start_beside_the_suite", None)
        if start is not None:
            start()


def pytest_report_header(config: pytest.Config) -> str:
    if config.stash[CUDA_HIDDEN]:
        return "CUDA hidden (CUDA_VISIBLE_DEVICES=''): the -m expression selects no gpu test"
    return f"CUDA_VISIBLE_DEVICES as found: {config.stash[CUDA_FOUND]!r}"


@pytest.fixture
def cuda_visibility(request) -> tuple[bool, "str | None"]:
    """(whether this run hid the GPUs, CUDA_VISIBLE_DEVICES as the run found it)."""
    return request.config.stash[CUDA_HIDDEN], request.config.stash[CUDA_FOUND]


def requires(module: str, what: str) -> pytest.MarkDecorator:
    """Skip, saying why, where an installed-by-requirements package is missing.

    requirements.txt installs all of these, so CI and `make test` run these tests; a bare GPU
    image used with its own python (no datasets, wandb or Hydra launcher plugins) skips them.
    """
    try:
        missing = importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # its parent package is missing too
        missing = True
    return pytest.mark.skipif(missing, reason=f"needs {module} for {what}; not installed here (requirements.txt has it)")


def compose(overrides: list[str] | None = None):
    """The composed DictConfig for `overrides`, as `python train.py <overrides>` sees it."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from trainer.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides or [])


@pytest.fixture
def compose_cfg():
    return compose


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """Keep `datasets`' own arrow cache inside the test's directory (and skip, saying so,
    where `datasets` is not installed)."""
    datasets = pytest.importorskip("datasets", reason="data=hf loads files with datasets; not installed here "
                                                      "(requirements.txt has it)")

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


# A small fair study (scripts/fair_compare.py) with every stage but the screen (tested on a
# synthetic launcher, and whole by the slow smoke test): 2 tuning trials a side, 3 lr retuning
# trials a side at each longer budget, 3 budgets, 2 fresh seeds: 28 runs of 4 to 8 steps. One is
# made per test session, for every test that reads a study's records.
FAIR_SMALL = ["--smoke", "tuning.screen=false", "tuning.trials=2", "compare.retune.trials=3", "compare.steps=4"]


@pytest.fixture(scope="session")
def fair_study(tmp_path_factory) -> tuple[Path, str]:
    """(the study dir, what the study printed): tests copy it before they change anything."""
    from tests.prestarted import run_python

    out = tmp_path_factory.mktemp("fair") / "study"
    proc = run_python(["scripts/fair_compare.py", *FAIR_SMALL, "--out", str(out)], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


# Numeric comparisons (tests/closeness.py): how close each came to its tolerance.
def _comparisons(config: pytest.Config) -> list:
    from tests import closeness

    return [*getattr(config, "_closeness_from_workers", []), *closeness.take()]


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker hands its records to the controller
        from dataclasses import astuple

        workeroutput["closeness"] = [astuple(c) for c in _comparisons(session.config)]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # pytest-xdist's controller, as each worker ends
    from tests.closeness import Comparison

    rows = getattr(node, "workeroutput", {}).get("closeness", [])
    node.config._closeness_from_workers = [*getattr(node.config, "_closeness_from_workers", []),
                                           *(Comparison(*row) for row in rows)]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Every comparison that used more than half of its tolerance on this machine: a margin
    that may not hold on another CPU (tests/closeness.py)."""
    from tests.closeness import NEAR, near_tolerance

    comparisons = _comparisons(config)
    if not comparisons:
        return
    near = near_tolerance(comparisons)
    terminalreporter.section("numeric tolerances")
    terminalreporter.write_line(f"{len(comparisons)} comparisons recorded; {len(near)} passed using more than "
                                f"{NEAR:.0%} of their tolerance on this machine")
    for c in near:
        terminalreporter.write_line(f"  {c.used:5.2f} of tolerance  {c.test}  {c.what}: error {c.error:.3g}, "
                                    f"tolerance {c.allowed:.3g}")
