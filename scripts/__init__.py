"""Command-line tools around the trainer: comparing and recording runs, the fair study, export
and generation, the planners' front ends, the GPU check and the benchmarks. Each file runs as
`python scripts/<name>.py`; they import the project's packages, installed in editable mode by
`make setup` (pyproject.toml), and each other as `scripts.<name>`."""
from pathlib import Path

# The repository's root: what the tools read beside the packages (conf/, train.py, lab/).
REPO = Path(__file__).resolve().parent.parent
