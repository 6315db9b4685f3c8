"""The import graph: the packages in one line (ORDER), parallel/ at the bottom, and no cycle anywhere.

Read from the source (ast), so lazy imports inside functions and imports under
`if TYPE_CHECKING:` count as arrows too: a cycle hidden in a function is still a cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

# Every package of the repository: the product's, in ORDER, and the lab's tooling and the tests
# (TOOLING), which may import anything, each other included.
PACKAGES = ("parallel", "model", "optim", "trainer", "eval", "data", "planning", "study", "hydra_plugins", "scripts",
            "lab", "tests")
# The product's package order, bottom first: a module may import its own package and those below
# it, never one above. parallel and data share the bottom and import neither each other nor
# anything else of ours; the fair study sits on the trainer, its Hydra sweeper on the study,
# the commands on all of them; train.py is the top.
ORDER = (("parallel", "data"), ("model",), ("optim",), ("eval",), ("planning",), ("trainer",), ("study",),
         ("hydra_plugins",), ("scripts",), ("train",))
TOOLING = ("lab", "tests")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    modules = {module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}
    modules["train"] = REPO / "train.py"
    return modules


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports, wherever the import statement is."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            # `from optim import muon` imports the module optim.muon
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name in modules}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported(path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), plus self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_parallel_package_imports_nothing_of_ours_outside_it():
    graph = import_graph()
    assert any(name.startswith("parallel.") for name in graph)
    upward = sorted((m, d) for m, deps in graph.items() if m.split(".")[0] == "parallel"
                    for d in deps if d.split(".")[0] != "parallel")
    assert upward == []


def tier(module: str) -> int:
    package = module.split(".")[0]
    if package in TOOLING:
        return len(ORDER)
    return next(i for i, packages in enumerate(ORDER) if package in packages)


def against_the_order(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The arrows from a package to one at its own level (another package) or above; the
    tooling (lab/, tests/) may import anything."""
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if m.split(".")[0] != d.split(".")[0] and m.split(".")[0] not in TOOLING and tier(d) >= tier(m))


def test_no_package_imports_one_above_it():
    graph = import_graph()
    assert {m.split(".")[0] for m in graph} == {p for packages in ORDER for p in packages} | set(TOOLING)
    assert against_the_order(graph) == []
    # It can fail: the arrow eval/compare -> trainer/run_env that made eval and trainer a cycle.
    assert against_the_order({"eval.compare": {"trainer.run.environment"}, "trainer.run.environment": set()}) == [
        ("eval.compare", "trainer.run.environment")]
    assert against_the_order({"data.x": {"parallel.y"}, "parallel.y": set()}) == [("data.x", "parallel.y")]


def test_no_product_module_imports_the_lab_or_the_tests():
    """Benchmarks and the GPU check are lab tooling (lab/tools/), and the test harness is the
    tests': nothing the product ships reaches into either."""
    graph = import_graph()
    product = {m: deps for m, deps in graph.items() if m.split(".")[0] not in TOOLING}
    assert len(product) > 100 and any(m.startswith("lab.tools.") for m in graph)
    reaching = sorted((m, d) for m, deps in product.items() for d in deps if d.split(".")[0] in TOOLING)
    assert reaching == []
    # It can fail: the arrow a benchmark inside scripts/ once made.
    assert against_the_order({"scripts.x": {"tests.distributed"}, "tests.distributed": set()}) == [
        ("scripts.x", "tests.distributed")]
    # The benchmarks have their own launcher (lab/tools/spawn.py), not the tests' process pool.
    assert sorted((m, d) for m, deps in graph.items() if m.startswith("lab.")
                  for d in deps if d.startswith("tests.")) == []


def test_scripts_holds_only_commands_users_run():
    """Every module under scripts/ is a command (it runs as __main__) or a helper of the
    commands; none is a benchmark or a GPU check (lab/tools/)."""
    names = {p.relative_to(REPO / "scripts").as_posix() for p in (REPO / "scripts").rglob("*.py")}
    assert not any(n.startswith(("bench", "gpu/")) or "/bench" in n for n in names), sorted(names)
    assert {"fair_compare.py", "compare_runs.py", "torchrun.py", "plan/estimate_memory.py"} <= names


def test_optim_imports_no_trainer_module():
    graph = import_graph()
    assert sorted((m, d) for m, deps in graph.items() if m.split(".")[0] == "optim"
                  for d in deps if d.split(".")[0] == "trainer") == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_checks_see_an_arrow_and_a_cycle(tmp_path):
    """The reader and the cycle finder on a planted graph and file: they can fail."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # The arrow that made the old cycle (optim/muon -> trainer/precision), hidden in a
    # function and under TYPE_CHECKING, is read; so is `from package import module`.
    planted = tmp_path / "planted.py"
    planted.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trainer.config\n"
                       "def f():\n    from trainer.precision import resolve_run_precisions\n"
                       "from optim import muon\nimport torch\n")
    assert imported(planted, project_modules()) == {"trainer.config", "trainer.precision", "optim", "optim.muon"}


def test_the_fair_study_is_one_package_and_its_sweeper_a_thin_adapter_over_it():
    """The study (plan, runner, tuner, spaces, records, statistics, reports) is study/, above the
    trainer; the Hydra sweeper imports the study and nothing of scripts/, and is found by Hydra
    beside the installed launchers (hydra_plugins/ holds no __init__.py of its own, which would
    hide theirs); scripts/fair_compare.py is the command over study/."""
    graph = import_graph()
    for name in ("study.speedup", "study.search_space", "study.space_config", "study.coordinate_descent",
                 "study.records", "study.plan", "study.runner", "study.report", "study.ladder", "study.driver"):
        assert name in graph, name
        assert not {d for d in graph[name] if d.split(".")[0] in ("scripts", "hydra_plugins", "train")}, name
    sweeper = graph["hydra_plugins.fair_sweeper.fair_sweeper"]
    assert sweeper and {d.split(".")[0] for d in sweeper} == {"study"}, sweeper
    assert {d for d in graph["scripts.fair_compare"] if d.startswith("study.")}
    assert not (REPO / "hydra_plugins" / "__init__.py").exists()
    assert not (REPO / "eval" / "fair").exists() and not (REPO / "scripts" / "fair").exists()
    from hydra.core.plugins import Plugins
    from hydra.plugins.launcher import Launcher
    from hydra.plugins.sweeper import Sweeper

    assert "FairSweeper" in {p.__name__ for p in Plugins.instance().discover(Sweeper)}
    assert {"BasicLauncher", "JoblibLauncher", "SlurmLauncher"} <= {p.__name__ for p in Plugins.instance().discover(Launcher)}
