"""summary.md's sections for the goals of `make check-gpu` (lab/tools/gpu/check_gpu.py): gpt_1b in bf16
against FP8 (tokens/s, MFU, peak memory, the loss after 200 steps), the fair study's choice
rerun in bf16, and one line per goal with what this run measured against it. Text in, Markdown
lines out (the figures from lab/tools/gpu/check_gpu_logs.py's readers), so tests/test_check_gpu.py
checks the arithmetic without a GPU."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lab.tools.gpu.check_gpu_logs import (
    bench_row, bench_rows, fp8_loss_change, fp8_over_bf16, loss_rows, muon_step_ms, number, plain_figures,
    planner_line, run_line, table_blocks, verdict,
)

FP8_GOAL = 1.2  # FP8 tokens/s over bf16's, gpt_1b
LOSS_GOAL = 0.01  # |FP8 loss / bf16 loss - 1| after 200 steps
COMPARE_GOAL_S = 240  # the fair study's choice rerun in bf16, whole
MUON_STEP_GOAL_MS = 3.5  # the Muon step at gpt_124m, bf16
MOE_MFU_GOAL = 35.0  # moe_1b with Muon, %
PLAIN_GOAL = 1.0  # ours AdamW over the plain step at 16,384 tokens per step
LOSS_COLUMN = "val/val/loss"
MUON_VARIANT = "ours, all three + ns_method=auto ms"  # what a compiled GPU run of the trainer steps


@dataclass
class StepLog:
    """One step of the check as the summary sees it."""

    text: str  # its log ("" when it did not run)
    state: str = ""  # why there is no log to read ("" when the step ran, whatever its result)
    seconds: float = 0.0
    what: str = ""


def _absent(logs: dict[str, StepLog], name: str) -> Optional[str]:
    """Why step `name` has no figures: not planned, or its own state; None when it ran."""
    if name not in logs:
        return "not planned in this check"
    return logs[name].state or None


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def section_gpt_1b(logs: dict[str, StepLog]) -> list[str]:
    out = ["## gpt_1b: bf16 against FP8", ""]
    why = _absent(logs, "gpt_1b")
    if why:
        out += [f"Throughput: {why}", ""]
    else:
        text = logs["gpt_1b"].text
        out += [f"Throughput ({logs['gpt_1b'].what}): " + " ".join(x for x in (planner_line(text), run_line(text)) if x)
                or "Throughput: no batch line in the log.", ""]
        out += _speed_table(bench_rows(text))
    why = _absent(logs, "gpt_1b-loss")
    if why:
        return out + [f"Loss after 200 steps: {why}", ""]
    text = logs["gpt_1b-loss"].text
    out += [f"Loss ({logs['gpt_1b-loss'].what}; beside test-gpu, so its times are not speeds): "
            + (run_line(text) or "no batch line in the log."), ""]
    return out + _loss_table(loss_rows(text))


def _speed_table(rows: list[dict[str, str]]) -> list[str]:
    if not rows:
        return ["No bench_train rows (see the steps table and the log).", ""]
    ratios = fp8_over_bf16(rows)
    out = ["| precision | optimizer | tokens/step | tokens/s | MFU | peak GiB | FP8 / bf16 tokens/s | "
           f"goal {FP8_GOAL}x | notes |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        ratio = ratios.get(r["optim"]) if "+fp8" in r.get("precision", "") else None
        out.append(f"| {r.get('precision', '')} | {r.get('optim', '')} | {r.get('tokens/step', '')} "
                   f"| {r.get('tokens/s', '')} | {r.get('MFU', '')} | {r.get('peak GiB', '')} "
                   f"| {f'**{ratio[1]:.3f}**' if ratio else ''} | {verdict(ratio[1], FP8_GOAL) if ratio else ''} "
                   f"| {r.get('notes', '')} |")
    return out + ["", "MFU divides by the run's measured bf16 matmul peak, FP8 rows too.", ""]


def _loss_table(rows: list[dict[str, str]]) -> list[str]:
    if not rows:
        return ["No loss table in the log.", ""]
    change = fp8_loss_change(rows, LOSS_COLUMN)
    out = [f"| precision | optimizer | steps trained | train/loss, last step | {LOSS_COLUMN} | FP8 against bf16 "
           f"| goal within {100 * LOSS_GOAL:.0f}% |", "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        c = change.get(r["optim"]) if "+fp8" in r.get("precision", "") else None
        out.append(f"| {r.get('precision', '')} | {r.get('optim', '')} | {r.get('steps trained', '')} "
                   f"| {r.get('train/loss, last step', '')} | {r.get(LOSS_COLUMN, '')} | {_pct(c[1]) if c else ''} "
                   f"| {verdict(abs(c[1]), LOSS_GOAL, at_least=False) if c else ''} |")
    return out + [""]


def section_compare(logs: dict[str, StepLog]) -> list[str]:
    out = ["## The fair study's choice in bf16 (`lab/tools/gpu/reference_bf16.py`: `fair_compare.py --rerun`)", ""]
    why = _absent(logs, "compare-bf16")
    if why:
        return out + [why, ""]
    step = logs["compare-bf16"]
    out += [f"Took {step.seconds:.0f} s (goal: at most {COMPARE_GOAL_S} s). The study dir is `compare-bf16/`: "
            "commit its `records/` and `report/` as `lab/results/fair_bf16/<rung>/`.", ""]
    blocks = [b for b in table_blocks(step.text) if "| split | speedup |" in b]
    return out + ([x for b in blocks for x in (b, "")] or ["No comparison table in the log.", ""])


def goal_lines(logs: dict[str, StepLog]) -> list[str]:
    """One line per goal: the figure this run measured against it, or why there is none."""
    lines = [_muon_step_goal(logs), _moe_goal(logs), _plain_goal(logs)]
    lines += _fp8_goals(logs)
    why = _absent(logs, "compare-bf16")
    seconds = logs["compare-bf16"].seconds if not why else 0.0
    lines.append(f"- The fair study's choice rerun in bf16 in at most {COMPARE_GOAL_S} s: "
                 + (f"no figure ({why})" if why else f"{seconds:.0f} s, {verdict(seconds, COMPARE_GOAL_S, False)}."))
    return ["## The goals against this run", ""] + lines + [""]


def _muon_step_goal(logs: dict[str, StepLog]) -> str:
    head = f"- Muon step at gpt_124m, bf16, at most {MUON_STEP_GOAL_MS} ms (bench_optimizer.py): "
    why = _absent(logs, "muon-step")
    ms = muon_step_ms(logs["muon-step"].text) if not why else {}
    variants = {k: v for k, v in ms.items() if k != "floor ms"}
    if not variants:
        return head + f"no figure ({why or 'no floor table in the log'})."
    name, value = (MUON_VARIANT, variants[MUON_VARIANT]) if MUON_VARIANT in variants else min(
        variants.items(), key=lambda kv: kv[1])
    fastest = min(variants.items(), key=lambda kv: kv[1])
    return (head + f"{value:.2f} ms ({name.removesuffix(' ms')}), {verdict(value, MUON_STEP_GOAL_MS, False)}; "
            f"fastest variant {fastest[1]:.2f} ms ({fastest[0].removesuffix(' ms')}); Newton-Schulz floor "
            f"{ms.get('floor ms', float('nan')):.2f} ms.")


def _moe_goal(logs: dict[str, StepLog]) -> str:
    head = f"- moe_1b with Muon, MFU at least {MOE_MFU_GOAL:.0f}%: "
    why = _absent(logs, "moe_1b")
    row = bench_row(bench_rows(logs["moe_1b"].text), "muon") if not why else None
    mfu = number(row.get("MFU", "")) if row else None
    if mfu is None:
        return head + f"no figure ({why or 'no moe_1b row with an MFU in the log'})."
    return head + f"{mfu:.1f}% ({row.get('tokens/s', '')} tokens/s), {verdict(mfu, MOE_MFU_GOAL)}."


def _plain_goal(logs: dict[str, StepLog]) -> str:
    head = f"- Ours with AdamW over the plain step at 16,384 tokens per step, at least {PLAIN_GOAL:.2f}x: "
    why = _absent(logs, "plain") or _absent(logs, "gpt_124m")
    plain = plain_figures(logs["plain"].text) if not why else None
    row = bench_row(bench_rows(logs["gpt_124m"].text), "adamw", 16384) if not why else None
    tps = number(row.get("tokens/s", "")) if row else None
    if not plain or not tps:
        return head + f"no figure ({why or 'no plain-step line or no AdamW row in the logs'})."
    ratio = tps / plain["tokens_s"]
    return head + f"**{ratio:.3f}** ({tps:,.0f} against {plain['tokens_s']:,.0f} tokens/s), {verdict(ratio, PLAIN_GOAL)}."


def _fp8_goals(logs: dict[str, StepLog]) -> list[str]:
    head = f"- gpt_1b, FP8 tokens/s at least {FP8_GOAL}x bf16's: "
    why = _absent(logs, "gpt_1b")
    ratios = fp8_over_bf16(bench_rows(logs["gpt_1b"].text)) if not why else {}
    speed = head + ("; ".join(f"{optim} **{r:.3f}** ({prec}), {verdict(r, FP8_GOAL)}" for optim, (prec, r) in ratios.items())
                    + "." if ratios else f"no figure ({why or 'no bf16 and FP8 rows of one optimizer'}).")
    head = f"- gpt_1b, FP8 loss after 200 steps within {100 * LOSS_GOAL:.0f}% of bf16's ({LOSS_COLUMN}): "
    why = _absent(logs, "gpt_1b-loss")
    change = fp8_loss_change(loss_rows(logs["gpt_1b-loss"].text), LOSS_COLUMN) if not why else {}
    loss = head + ("; ".join(f"{optim} {_pct(c)} ({prec}), {verdict(abs(c), LOSS_GOAL, False)}"
                             for optim, (prec, c) in change.items()) + "."
                   if change else f"no figure ({why or 'no bf16 and FP8 losses of one optimizer'}).")
    return [speed, loss]
