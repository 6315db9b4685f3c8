"""Readers of the logs `make check-gpu` (lab/tools/gpu/check_gpu.py) writes: pytest's counts, Markdown
tables, numbers in table cells and the figures of bench_train.py and the plain step. Pure text
in, values out, so the summary's arithmetic is tested without a GPU (tests/test_check_gpu.py)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)\b")
PYTEST_FINAL = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s\b", re.MULTILINE)
PYTEST_PROGRESS = re.compile(r"^([.sFExX]+)\s*(\[\s*\d+%\])?\s*$", re.MULTILINE)


def pytest_outcome(text: str) -> dict:
    """Counts (passed, failed, skipped, error, ...), the failing test ids and the seconds from a
    pytest log. Without a final summary line (a run stopped at its time limit) the counts come
    from the progress characters printed so far, and `complete` is False."""
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.MULTILINE)
    finals = PYTEST_FINAL.findall(text)
    counts: dict[str, int] = {}
    if finals:
        summary, seconds = finals[-1]
        for n, kind in PYTEST_COUNT.findall(summary):
            counts[kind.rstrip("s") if kind in ("errors", "warnings") else kind] = int(n)
        return {"counts": counts, "failures": failures, "seconds": float(seconds), "complete": True}
    chars = "".join(m[0] for m in PYTEST_PROGRESS.findall(text))
    for ch, kind in ((".", "passed"), ("F", "failed"), ("s", "skipped"), ("E", "error")):
        if chars.count(ch):
            counts[kind] = chars.count(ch)
    return {"counts": counts, "failures": failures, "seconds": None, "complete": False}


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
    """Every Markdown table in `text`, as rows of {header: cell}."""
    tables, lines = [], text.splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip()):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                rows.append(dict(zip(header, cells)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def table_blocks(text: str) -> list[str]:
    """Every Markdown table in `text`, verbatim."""
    blocks, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            if len(current) > 1 and set(current[1].replace("|", "").strip()) <= set("-: "):
                blocks.append("\n".join(current))
            current = []
    return blocks


def number(cell: str) -> Optional[float]:
    """A table cell's number ("577,695", "45.5%", "**1.12x**", "0.028"), or None."""
    m = re.search(r"-?[\d,]*\.?\d+", cell or "")
    return float(m.group(0).replace(",", "")) if m else None


def bench_rows(text: str) -> list[dict[str, str]]:
    """bench_train.py's result rows: the table with impl and tokens/s columns."""
    return [row for table in markdown_tables(text) for row in table if "impl" in row and "tokens/s" in row]


def plain_figures(text: str) -> Optional[dict[str, float]]:
    """tokens/s, ms/step and MFU % of plain_gpt_step.py's REF line; torch.optim.Muon's ms/step
    when it printed that line too."""
    m = re.search(r"^REF \w+ .*?: ([\d.]+) ms/step ([\d,]+) tok/s\s+MFU ([\d.]+)%", text, re.MULTILINE)
    if not m:
        return None
    out = {"ms": float(m.group(1)), "tokens_s": float(m.group(2).replace(",", "")), "mfu": float(m.group(3))}
    muon = re.search(r"^REF torch\.optim\.Muon on (\d+) hidden matrices: ([\d.]+) ms/step", text, re.MULTILINE)
    if muon:
        out["torch_muon_matrices"], out["torch_muon_ms"] = float(muon.group(1)), float(muon.group(2))
    return out


def muon_over_adamw(rows: list[dict[str, str]]) -> dict[int, float]:
    """{tokens per optimizer step: ours Muon tokens/s / ours AdamW tokens/s} from bench rows."""
    rate = {(r["optim"], int(number(r["tokens/step"]) or 0)): number(r["tokens/s"])
            for r in rows if r.get("impl") == "ours" and number(r.get("tokens/s", ""))}
    return {tokens: rate["muon", tokens] / rate["adamw", tokens]
            for (optim, tokens) in rate if optim == "muon" and ("adamw", tokens) in rate}




# ----------------------------------------------------------------------------- the goals' figures


def planner_line(text: str) -> Optional[str]:
    """bench_train.py --batch-size plan's line: the micro-batch the planner picked, and why."""
    m = re.search(r"^Micro-batch from the planner: .*$", text, re.MULTILINE)
    return m.group(0) if m else None


def run_line(text: str) -> Optional[str]:
    """bench_train.py's line of the micro-batch, tokens per step, warm-up and rounds."""
    m = re.search(r"^Micro-batch \d+ x \d+ tokens; .*$", text, re.MULTILINE)
    return m.group(0) if m else None


def fp8_over_bf16(rows: list[dict[str, str]]) -> dict[str, tuple[str, float]]:
    """{optimizer: (FP8 precision cell, its tokens/s over the bf16 row's)} of our bench rows."""
    rate = {(r["optim"], r["precision"]): number(r["tokens/s"]) for r in rows
            if r.get("impl") == "ours" and number(r.get("tokens/s", ""))}
    return {optim: (prec, tps / rate[optim, "bf16"]) for (optim, prec), tps in rate.items()
            if "+fp8" in prec and (optim, "bf16") in rate}


def loss_rows(text: str) -> list[dict[str, str]]:
    """bench_train.py --losses' rows: the table with a `steps trained` column."""
    return [row for table in markdown_tables(text) for row in table if "steps trained" in row]


def fp8_loss_change(rows: list[dict[str, str]], column: str) -> dict[str, tuple[str, float]]:
    """{optimizer: (FP8 precision cell, (FP8 loss - bf16 loss) / bf16 loss)} in `column`."""
    loss = {(r["optim"], r["precision"]): number(r.get(column, "")) for r in rows}
    return {optim: (prec, value / loss[optim, "bf16"] - 1) for (optim, prec), value in loss.items()
            if "+fp8" in prec and value is not None and loss.get((optim, "bf16"))}


def muon_step_ms(text: str) -> dict[str, float]:
    """bench_optimizer.py's bf16 row of the table against the Newton-Schulz floor: {column: ms}
    for the floor and every variant's time (not their `x floor` multiples)."""
    for table in markdown_tables(text):
        for row in table:
            if row.get("NS dtype") == "bf16" and "floor ms" in row:
                return {k: v for k, v in ((k, number(v)) for k, v in row.items() if k.endswith(" ms")) if v is not None}
    return {}


def bench_row(rows: list[dict[str, str]], optim: str, tokens: Optional[int] = None,
              precision: Optional[str] = None) -> Optional[dict[str, str]]:
    """Our bench row of `optim` (at `tokens` per step, in `precision`, where given)."""
    for r in rows:
        if (r.get("impl") == "ours" and r.get("optim") == optim
                and (tokens is None or number(r.get("tokens/step", "")) == tokens)
                and (precision is None or r.get("precision") == precision)):
            return r
    return None


def verdict(value: float, goal: float, at_least: bool = True) -> str:
    """**met** or **not met**: `value` at least (or, at_least=False, at most) `goal`."""
    return "**met**" if (value >= goal if at_least else value <= goal) else "**not met**"
