"""A fair study as users break it: Ctrl-C in the middle of a run, records that are corrupt,
truncated or another study's, and a study dir (--out) that cannot be one. Each is one line naming
what is wrong (exit 2), or for a signal one line that resumes the study (exit 130), and nothing
recorded is lost. The study itself is tests/test_fair_compare.py's."""
from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from study.records import INDEX_FILE, read_index
from tests.conftest import FAIR_SMALL, REPO
from tests.prestarted import run_python

SCRIPT = "scripts/fair_compare.py"


def fair(*args: str):
    return run_python([SCRIPT, *args], timeout=900)


def copy_study(fair_study, tmp_path: Path) -> Path:
    out, _ = fair_study
    copy = tmp_path / "study"
    shutil.copytree(out / "records", copy / "records")
    return copy


def files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


# ---- signals ----


# The study, with a Ctrl-C sent to itself at the start of the first run's first evaluation (its
# last step's: a trial evaluates once), so that it lands there on any machine.
CTRL_C_IN_THE_FIRST_EVALUATION = """
import os, runpy, signal, sys
import trainer.loop as loop

evaluate = loop.Trainer.evaluate
def evaluate_after_a_ctrl_c(self):
    if not os.environ.get("CTRL_C_SENT"):
        os.environ["CTRL_C_SENT"] = "1"
        os.kill(os.getpid(), signal.SIGINT)
    return evaluate(self)
loop.Trainer.evaluate = evaluate_after_a_ctrl_c
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_ctrl_c_during_a_runs_last_evaluation_stops_the_study_with_its_own_resume_line(tmp_path):
    """Before: a Ctrl-C during a run's end-of-run evaluation was swallowed and the study went on.
    Now it stops there (exit 130), says what is recorded and prints one line: the study's own
    command, never train.py's internal one; that line finishes the study, taking the run that
    was stopped from its run dir rather than training it again."""
    out = tmp_path / "study"
    # One trial a side and no retuning: 14 runs of 2 to 4 steps.
    args = [*FAIR_SMALL, "tuning.trials=1", "compare.retune.trials=0", "compare.steps=2", "--out", str(out)]
    proc = run_python(["-c", CTRL_C_IN_THE_FIRST_EVALUATION, SCRIPT, *args], timeout=600)
    assert proc.returncode == 130, proc.stdout[-3000:] + proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output and "train.py" not in output, output[-3000:]
    resume = [line for line in proc.stderr.splitlines() if line.startswith("to resume: ")]
    assert resume == [f"to resume: {shlex.join(['python', SCRIPT, *args])}"]
    assert any(line.startswith("stopped (Ctrl-C): 0 of 14 runs are recorded in ") for line in proc.stderr.splitlines())
    again = fair(*shlex.split(resume[0])[4:])  # to resume: python SCRIPT ...
    assert again.returncode == 0, again.stderr[-3000:]
    first = next(line for line in again.stdout.splitlines() if line.startswith("[fair] run 1 of 14: "))
    assert first.endswith("(finished before the stop; recorded now)"), first
    assert "[fair] done: 14 runs, 13 trained now, 0 taken from the records" in again.stdout


def test_a_signal_whose_exit_was_lost_still_stops_the_study_before_its_next_run(fair_study, tmp_path, monkeypatch):
    """The start-up handler's SystemExit can be lost where it lands (trainer/run/interrupts.py):
    the runner asks the flag before each launch, so no run starts after a SIGTERM."""
    from study.runner import StudyRunner
    from trainer.run import interrupts

    out, _ = fair_study
    records = tmp_path / "records"
    records.mkdir()
    shutil.copy(out / "records" / "plan.json", records / "plan.json")  # a study with nothing run yet
    launched = []

    class Launch:
        in_flight, local = 1, False

        def __call__(self, jobs):
            launched.extend(jobs)
            return []

    monkeypatch.setattr(interrupts, "_interrupted", 143)
    with pytest.raises(SystemExit) as stopped:
        StudyRunner(records, tmp_path / "runs", Launch()).run()
    assert stopped.value.code == 143 and launched == []


def test_a_stopped_study_says_why_what_is_recorded_and_how_to_resume(fair_study):
    from study.driver import stop_lines
    from study.plan import Plan

    out, _ = fair_study
    plan = Plan.from_json((out / "records" / "plan.json").read_text())
    assert stop_lines(plan, out / "records", 143, "python x.py") == [
        f"stopped (SIGTERM): 28 of 28 runs are recorded in {out / 'records'}; a run cut short is not (the same "
        "command takes it from its run dir if it finished, or trains it again, from its checkpoint where it saved one)",
        "to resume: python x.py"]
    assert stop_lines(plan, out / "records", 1, "python x.py")[0].startswith("training stopped (exit 1): 28 of 28")


# ---- records ----


def test_a_corrupt_record_is_named_in_one_line_and_the_study_runs_it_again_once_moved_aside(fair_study, tmp_path):
    study = copy_study(fair_study, tmp_path)
    entry = read_index(study / "records")[5]
    metrics = study / "records" / entry.name / "metrics.jsonl.gz"
    metrics.write_bytes(metrics.read_bytes()[: len(metrics.read_bytes()) // 2])
    said = f"error: {study / 'records' / entry.name}/metrics.jsonl.gz: unreadable (EOFError: "
    assert one_error_line(fair("--report", str(study))).startswith(said)
    before = files(study)
    line = one_error_line(fair(*FAIR_SMALL, "--out", str(study)))  # the study's command: refused, not crashed
    assert line.startswith(said) and line.endswith("move it out of records/ (nothing is lost) and run the study's "
                                                   "command again: it trains that run anew")
    assert files(study) == before
    shutil.move(study / "records" / entry.name, tmp_path / "aside")
    proc = fair(*FAIR_SMALL, "--out", str(study))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[fair] done: 28 runs, 1 trained now, 27 taken from the records" in proc.stdout


def test_a_truncated_last_index_line_is_refused_by_the_report_and_repaired_by_the_study(fair_study, tmp_path):
    study = copy_study(fair_study, tmp_path)
    index = study / "records" / INDEX_FILE
    whole = index.read_bytes()
    index.write_bytes(whole[: len(whole) - 60])  # a copy cut short
    line = one_error_line(fair("--report", str(study)))
    assert line.startswith(f"error: {index}:28: its last line is cut short; the study's command repairs it")
    proc = fair(*FAIR_SMALL, "--out", str(study))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[fair] {index}: its last line was cut short" in proc.stdout
    assert "[fair] done: 28 runs, 0 trained now, 27 taken from the records" in proc.stdout  # the 28th: its record
    assert index.read_bytes() == whole  # the same line, made again from its record


@pytest.mark.parametrize("where", ["index", "config"])
def test_a_record_of_another_study_is_refused_by_name(fair_study, tmp_path, where):
    """Records carry the study's id (plan.json, each index line, each run's logger.run_info.study):
    one of another study merged in is named, never pooled."""
    study = copy_study(fair_study, tmp_path)
    records = study / "records"
    entries = read_index(records)
    foreign = entries[-1]
    ours = json.loads((records / "plan.json").read_text())["study_id"]
    if where == "index":
        lines = (records / INDEX_FILE).read_text().splitlines()
        lines[-1] = lines[-1].replace(f'"study": "{ours}"', '"study": "0123456789ab"')
        (records / INDEX_FILE).write_text("\n".join(lines) + "\n")
        what = "its index line"
    else:
        config = records / foreign.name / ".hydra" / "config.yaml"
        config.write_text(config.read_text().replace(f"study: {ours}", "study: 0123456789ab"))
        what = "its config (logger.run_info.study)"
    line = one_error_line(fair("--report", str(study)))
    assert line.startswith(f"error: records/{foreign.name}: {what} says it is a run of study 0123456789ab, not of "
                           f"this one ({ours}): records of another study mixed in; move it out of records/"), line


@pytest.mark.parametrize("change, said", [
    (lambda e: {**e, "name": e["name"] + "-other"}, "error: records/index.jsonl: tune/muon/000-"),
    (lambda e: {**e, "name": e["name"] + "-other", "seed": 7}, "seed 7 is not one of this study's tuning.seeds"),
])
def test_a_study_without_ids_still_refuses_records_that_are_not_its_runs(tmp_path, change, said):
    """The committed smoke study predates ids: a second record of the same trial (another study's,
    merged in) or one of a seed it never ran is refused by the plan's own shape."""
    study = tmp_path / "smoke"
    shutil.copytree(REPO / "lab" / "results" / "fair_smoke" / "records", study / "records")
    index = study / "records" / INDEX_FILE
    first = json.loads(index.read_text().splitlines()[0])
    other = change(first)
    shutil.copytree(study / "records" / first["name"], study / "records" / other["name"])
    index.write_text(index.read_text() + json.dumps(other) + "\n")
    line = one_error_line(fair("--report", str(study)))
    assert said in line and "another study mixed in" in line, line


# ---- --out ----


def test_out_is_checked_first(tmp_path):
    """A file, an unwritable place, a dir of something else, a dir another live study holds, or a
    dir holding another study: one line naming --out, exit 2, before the plan is built (a bad
    study key given beside it is not even read) and with nothing written."""
    from trainer.run.lock import claim

    file = tmp_path / "file"
    file.write_text("x")
    assert one_error_line(fair("--smoke", "tuning.trials=0", "--out", str(file))) == \
        f"error: --out {file}: a file, not a dir; give the study a dir of its own"
    assert one_error_line(fair("--smoke", "--out", str(file / "study"))) == \
        f"error: --out {file / 'study'}: {file} is a file, so the dir cannot be made"
    assert one_error_line(fair("--smoke", "--out", "/proc/fair")).startswith("error: --out /proc/fair: cannot be written (")
    run_dir = tmp_path / "a_run"
    run_dir.mkdir()
    (run_dir / "train.log").write_text("")
    assert one_error_line(fair("--smoke", "--out", str(run_dir))) == \
        f"error: --out {run_dir}: not a study's dir (it holds train.log); give the study a dir of its own"
    held = tmp_path / "held"
    lock = claim(held)
    try:
        line = one_error_line(fair("--smoke", "tuning.trials=0", "--out", str(held)))
    finally:
        lock.release()
    assert line.startswith(f"error: --out {held}: another study is running there (") and line.endswith(
        "give this one another --out, or wait for that one to end")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_run", "file"]


def test_out_holding_another_study_is_refused_before_anything_trains(fair_study, tmp_path):
    study = copy_study(fair_study, tmp_path)
    before = files(study)
    line = one_error_line(fair(*FAIR_SMALL, "trainer.seq_len=16", "--out", str(study)))
    assert line == (f"error: --out {study}: holds another study (its train differs from this one's); give this one "
                    "another --out")
    assert files(study) == before
