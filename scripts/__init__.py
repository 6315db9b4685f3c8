"""The commands users run around the trainer: comparing and recording runs, the fair study,
export and generation, torchrun with our exit codes, and the planners' front ends (plan/). Each
file runs as `python scripts/<name>.py`; they import the project's packages, installed in
editable mode by `make setup` (pyproject.toml), and each other as `scripts.<name>`. Benchmarks
and the GPU check are lab tooling (lab/tools/)."""
from pathlib import Path

# The repository's root: what the tools read beside the packages (conf/, train.py, lab/).
REPO = Path(__file__).resolve().parent.parent
