"""Why `datasets.load_dataset` failed on local files, in one line that names the file.

`datasets` reports an empty file as a bare StopIteration and a binary or malformed one as
"An error occurred while generating the dataset", without saying which of the data files it
was reading. Only after a load has failed, the local files are checked one by one, in the
order given, for the first that is empty, not text, or (for JSON) not parseable.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Optional

# Enough of a file to tell text from binary data; a multibyte character cut at the end of the
# sample is not an error.
SAMPLE_BYTES = 64 * 1024
# Beyond this size a file whose first line is not JSON is reported as such, rather than
# parsed whole to see whether it is one JSON document spread over lines.
WHOLE_JSON_MAX_BYTES = 64 * 1024 * 1024


def file_problem(path: Path, builder: str) -> Optional[str]:
    """What is wrong with one local data file, or None when nothing is found."""
    size = path.stat().st_size
    if size == 0:
        return "the file is empty"
    with path.open("rb") as f:
        sample = f.read(SAMPLE_BYTES)
    nul = sample.find(b"\0")
    if nul >= 0:
        return f"not text: a NUL byte at offset {nul} (a binary file?)"
    try:
        sample.decode("utf-8")
    except UnicodeDecodeError as err:
        if len(sample) == size or err.start < len(sample) - 3:
            return f"not UTF-8 text: byte 0x{sample[err.start]:02x} at offset {err.start}"
    if builder == "json" or path.suffix in (".json", ".jsonl"):
        return _json_problem(path, size)
    return None


def _json_problem(path: Path, size: int) -> Optional[str]:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                json.loads(line)
            except json.JSONDecodeError as err:
                if number == 1 and size <= WHOLE_JSON_MAX_BYTES and _is_one_json_document(path):
                    return None
                return f"line {number} is not valid JSON ({err.msg} at column {err.colno})"
    return None


def _is_one_json_document(path: Path) -> bool:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return False
    return True


def explain_load_failure(files: Iterable[Path], builder: str, err: BaseException) -> str:
    """'<file>: <problem>' for the first local file at fault, else the innermost error's
    first line (for a hub dataset or a failure the files do not explain)."""
    for path in files:
        if path.is_file():
            problem = file_problem(path, builder)
            if problem is not None:
                return f"{path}: {problem}"
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0]}" if text else type(cause).__name__
