"""The run dir's lock: one run per dir; a second run stops with one line and writes nothing;
a stale lock is taken over with one warning; torchrun's ranks share their rank 0's lock."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.prestarted import Started, run_python, start_python
from tests.test_faults import wait_for_step
from trainer.run import lock as run_lock
from trainer.run.lock import LOCK_NAME, RunLock, RunLocked, claim, held, planned_run_dir, read_holder

HOST = socket.gethostname()


def iso(seconds_ago: float = 0.0) -> str:
    return datetime.fromtimestamp(time.time() - seconds_ago).astimezone().isoformat(timespec="seconds")


def hold_by_hand(run_dir: Path, **fields) -> dict:
    """A lock as another run would have written it: by default a live one on this host (this
    test process's pid stands in for the run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = {"host": HOST, "pid": os.getpid(), "started": iso(60), "heartbeat": iso(), "token": "by-hand", **fields}
    (run_dir / LOCK_NAME).write_text(json.dumps(lock))
    return lock


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root` (dot files too) with its mtime, and its bytes if a file; and the
    root's own mtime, which a file made and removed again would change."""
    out: dict[str, tuple] = {".": (root.stat().st_mtime_ns,)}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[p.relative_to(root).as_posix()] = (st.st_mtime_ns, None if p.is_dir() else p.read_bytes())
    return out


@pytest.fixture(autouse=True)
def no_lock_left_held():
    yield
    run_lock.release_all()


# ---- the module itself ----

def test_acquire_writes_the_holder_as_json_and_release_removes_it(tmp_path):
    lock = RunLock.acquire(tmp_path / "run", env={})
    path = tmp_path / "run" / LOCK_NAME
    saved = json.loads(path.read_text())
    assert (saved["host"], saved["pid"]) == (HOST, os.getpid())
    assert abs(datetime.fromisoformat(saved["started"]).timestamp() - time.time()) < 60
    assert saved["heartbeat"] == saved["started"] and saved["launch"] is None
    assert held(tmp_path / "run") is lock and lock.took_over is None
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK_NAME]  # no temp file left
    lock.release()
    assert not path.exists() and held(tmp_path / "run") is None
    assert not (tmp_path / "run").exists()  # made for the lock, and nothing else was written


def test_a_live_holder_refuses_and_the_refused_run_writes_nothing(tmp_path):
    first = RunLock.acquire(tmp_path, env={})
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(tmp_path)
    with pytest.raises(RunLocked) as refused:
        RunLock.acquire(tmp_path, env={})
    assert str(refused.value) == (
        f"run dir {tmp_path} is in use by another run (host {HOST}, pid {os.getpid()}, started "
        f"{first.me.started}): give this run another hydra.run.dir or TRAIN_RUN_ID, or wait for that run to end")
    assert snapshot(tmp_path) == before
    first.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]  # the dir was there before


def test_a_fresh_heartbeat_on_another_host_refuses(tmp_path):
    hold_by_hand(tmp_path, host="node-b", pid=4242, heartbeat=iso(20))
    with pytest.raises(RunLocked, match=r"host node-b, pid 4242, started .*, last heartbeat 2\d s ago"):
        RunLock.acquire(tmp_path, env={})


def test_an_unreadable_lock_counts_until_it_is_old(tmp_path):
    (tmp_path / LOCK_NAME).write_text("not json")
    with pytest.raises(RunLocked, match="unreadable lock file"):
        RunLock.acquire(tmp_path, env={})
    old = time.time() - 2 * run_lock.STALE_AFTER_S
    os.utime(tmp_path / LOCK_NAME, (old, old))
    lock = RunLock.acquire(tmp_path, env={})
    assert "heartbeat is" in lock.took_over and read_holder(tmp_path / LOCK_NAME).token == lock.me.token


@pytest.mark.parametrize("case", ["dead pid", "rebooted host", "old heartbeat elsewhere",
                                  "earlier torchrun attempt"])
def test_a_stale_lock_is_taken_over_saying_why(tmp_path, case):
    fields, env, reason = {
        "dead pid": ({"pid": dead_pid()}, {}, "its pid is gone"),
        "rebooted host": ({"boot_id": "another-boot"}, {}, "left before this host restarted"),
        "old heartbeat elsewhere": ({"host": "node-b", "heartbeat": iso(3600)}, {},
                                    "its heartbeat is 36NN s old (stale after 300 s)"),
        # torchrun stopped attempt 0 before it started attempt 1, wherever its rank 0 ran.
        "earlier torchrun attempt": ({"host": "node-b", "launch": "torchrun:job7", "attempt": 0},
                                     {"TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "1"},
                                     "left by attempt 0 of this launch, which torchrun has stopped"),
    }[case]
    stale = hold_by_hand(tmp_path, **fields)
    lock = RunLock.acquire(tmp_path, env=env)
    said = (f"took over the stale lock of run dir {tmp_path} (host {stale['host']}, "
            f"pid {stale['pid']}, started {stale['started']}): {reason}")
    # The heartbeat is written to the second: its age is 3600 s and a fraction, and some.
    assert re.fullmatch(re.escape(said).replace("NN", r"0\d"), lock.took_over), lock.took_over
    assert read_holder(tmp_path / LOCK_NAME) == lock.me
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # no takeover or temp file left


def test_a_lock_whose_pid_is_now_another_process_says_which_process_it_found(tmp_path):
    """Before: "its pid is gone", while `ps` showed that pid alive (as another program)."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        # Until it has exec'd, the child is a copy of this process, command line included.
        while Path(f"/proc/{other.pid}/cmdline").read_bytes() != b"sleep\x0030\x00":
            assert time.monotonic() < deadline, "sleep never started"
            time.sleep(0.01)
        started = run_lock._process_start(other.pid)
        assert started is not None
        ticks_per_hour = 3600 * os.sysconf("SC_CLK_TCK")
        # The lock's process started an hour before the one that now has its pid.
        stale = hold_by_hand(tmp_path, pid=other.pid, pid_start=started - ticks_per_hour)
        lock = RunLock.acquire(tmp_path)
    finally:
        other.kill()
        other.wait()
    iso_time = r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d)"
    said = re.fullmatch(
        re.escape(f"took over the stale lock of run dir {tmp_path} (host {HOST}, pid {other.pid}, started "
                  f"{stale['started']}): its pid {other.pid} is now another process (`sleep 30`, started ")
        + iso_time + re.escape("; the lock's process started ") + iso_time + re.escape(")"),
        lock.took_over)
    assert said, lock.took_over
    found, lock_process = (datetime.fromisoformat(t).timestamp() for t in said.groups())
    assert abs(time.time() - found) < 60 and abs(found - lock_process - 3600) <= 1
    assert "pid is gone" not in lock.took_over
    assert read_holder(tmp_path / LOCK_NAME) == lock.me


@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_runs_racing_for_one_dir_let_exactly_one_in(tmp_path, stale):
    """Threads of one process race like processes do: each sees the others' locks as held by a
    live pid. Whatever the interleaving, one takes the lock and the rest are refused."""
    if stale:
        hold_by_hand(tmp_path, pid=dead_pid())
    start = threading.Barrier(8)
    won, refused = [], []

    def attempt() -> None:
        start.wait()
        try:
            won.append(RunLock.acquire(tmp_path, env={}))
        except RunLocked as err:
            refused.append(str(err))

    threads = [threading.Thread(target=attempt) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7, refused
    assert read_holder(tmp_path / LOCK_NAME).token == won[0].me.token
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]


def test_the_holder_refreshes_its_heartbeat(tmp_path):
    lock = RunLock.acquire(tmp_path, env={}, heartbeat_s=0.05)
    started = lock.me.started
    deadline = time.time() + 5
    while read_holder(tmp_path / LOCK_NAME).heartbeat == started:  # ISO seconds: a tick away
        assert time.time() < deadline, "the heartbeat was never refreshed"
        time.sleep(0.05)
    saved = read_holder(tmp_path / LOCK_NAME)
    assert saved.heartbeat > started and (saved.started, saved.token) == (started, lock.me.token)
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    assert sorted(tmp_path.iterdir()) == []  # no heartbeat temp file left


def test_release_leaves_the_lock_of_a_run_that_took_it_over_alone(tmp_path):
    lock = RunLock.acquire(tmp_path, env={}, heartbeat_s=3600)
    hold_by_hand(tmp_path, host="node-b", pid=99, token="new-holder")  # judged stale from node-b
    lock.release()
    assert read_holder(tmp_path / LOCK_NAME).token == "new-holder"


def test_other_ranks_look_at_the_lock_but_never_take_it(tmp_path):
    rank1 = {"RANK": "1", "TORCHELASTIC_RUN_ID": "job7"}
    assert claim(tmp_path / "run", rank1) is None
    assert not (tmp_path / "run").exists()  # rank 0 makes the dir and the lock
    hold_by_hand(tmp_path / "run", launch="torchrun:job7")
    assert claim(tmp_path / "run", rank1) is None  # their own rank 0's lock
    hold_by_hand(tmp_path / "run", launch="torchrun:job7", attempt=0, pid=dead_pid())
    assert claim(tmp_path / "run", {**rank1, "TORCHELASTIC_RESTART_COUNT": "1"}) is None
    hold_by_hand(tmp_path / "run", pid=dead_pid(), launch="torchrun:other")
    assert claim(tmp_path / "run", rank1) is None  # stale: their rank 0 takes it over
    hold_by_hand(tmp_path / "run", launch="torchrun:other")
    with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):
        claim(tmp_path / "run", rank1)
    assert json.loads((tmp_path / "run" / LOCK_NAME).read_text())["token"] == "by-hand"


def test_launch_ids_tell_launches_apart():
    assert run_lock.launch_id({}) is None
    assert run_lock.launch_id({"TORCHELASTIC_RUN_ID": "abc", "SLURM_JOB_ID": "5"}) == "torchrun:abc"
    # A requeued SLURM job keeps its id: the requeue count tells it from the job it replaces.
    slurm = {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}
    assert run_lock.launch_id(slurm) != run_lock.launch_id({**slurm, "SLURM_RESTART_COUNT": "1"})
    assert run_lock.launch_id({"MASTER_ADDR": "n1", "MASTER_PORT": "29500"}) == "master:n1:29500"


def test_the_planned_run_dir_is_hydras_and_a_clock_stamp_is_pinned(tmp_path, monkeypatch):
    from trainer.config import register_configs

    register_configs()
    conf = str(REPO / "conf")
    assert planned_run_dir([f"hydra.run.dir={tmp_path}/x", "optim=adamw"], conf) == (tmp_path / "x", [])
    monkeypatch.delenv("TRAIN_RUN_ID", raising=False)
    run_dir, pin = planned_run_dir(["optim=adamw"], conf)
    assert run_dir.parent == Path.cwd() / "outputs" / "adamw_gpt_tiny"
    assert pin == [f"hydra.run.dir='outputs/adamw_gpt_tiny/{run_dir.name}'"]
    monkeypatch.setenv("TRAIN_RUN_ID", "x7")
    assert planned_run_dir([], conf)[0] == Path.cwd() / "outputs" / "muon_gpt_tiny" / "x7"
    # Left to main(), once Hydra has named the dir: a sweep's jobs, --cfg, a command line Hydra refuses.
    for argv in (["-m", "optim=muon,adamw"], ["--cfg", "job"], ["trainer.max_stepz=3"]):
        assert planned_run_dir(argv, conf) is None, argv


# ---- train.py ----

TINY = [
    "model=gpt_tiny", "trainer.batch_size=2", "trainer.seq_len=32", "trainer.precision=fp32",
    "trainer.device=cpu", "eval.interval=0", "eval.batches=1", "logger.interval=1",
    "logger.wandb.mode=disabled", "logger.tensorboard=false", "logger.progress=none",
    "optim.muon.ns_dtype=fp32", f"data.cache_dir={REPO / '.cache' / 'data'}",
]


def train_cmd(run_dir: Path, *extra: str, torchrun: bool = False) -> list[str]:
    """train.py on TINY for 3 steps, `extra` replacing any value of the same key."""
    keys = {e.split("=", 1)[0] for e in extra}
    args = [a for a in [*TINY, "trainer.max_steps=3"] if a.split("=", 1)[0] not in keys]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if torchrun else []
    return [sys.executable, *launcher, "train.py", f"hydra.run.dir={run_dir}", *args, *extra]


def train(run_dir: Path, *extra: str, torchrun: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if torchrun:  # torchrun's own process tree: a fresh interpreter
        return subprocess.run(train_cmd(run_dir, *extra, torchrun=True), cwd=REPO, capture_output=True,
                              text=True, timeout=600, env=env)
    return run_python(train_cmd(run_dir, *extra)[1:], env=env, timeout=600)


def start(run_dir: Path, *extra: str) -> Started:
    return start_python(train_cmd(run_dir, *extra)[1:], env={**os.environ, "OMP_NUM_THREADS": "1"})


def logged(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def refusal_line(run_dir: Path, holder: dict) -> str:
    return (f"error: run dir {run_dir} is in use by another run (host {holder['host']}, pid {holder['pid']}, "
            f"started {holder['started']}): give this run another hydra.run.dir or TRAIN_RUN_ID, or wait for "
            f"that run to end")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished run dir: what a second run must leave as it is."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = train(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (run_dir / LOCK_NAME).exists()  # released at the end
    return run_dir


def test_a_second_run_on_a_held_dir_exits_2_with_one_line_and_changes_nothing(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    subprocess.run(["cp", "-a", str(finished_run), str(run_dir)], check=True)
    holder = hold_by_hand(run_dir)  # a live run on this host: this test process
    before = snapshot(run_dir)
    proc = train(run_dir, "optim.lr=0.5")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [refusal_line(run_dir, holder)], proc.stderr[-3000:]
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("holder", ["dead pid here", "old heartbeat elsewhere"])
def test_a_stale_lock_is_taken_over_with_one_warning_and_the_run_completes(tmp_path, holder):
    stale = hold_by_hand(tmp_path, **({"pid": dead_pid()} if holder == "dead pid here"
                                      else {"host": "node-b", "heartbeat": iso(3600)}))
    proc = train(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = (f"[WARNING] - took over the stale lock of run dir {tmp_path} (host {stale['host']}, "
            f"pid {stale['pid']}, started {stale['started']}): ")
    lines = [l for l in (proc.stdout + proc.stderr).splitlines() if "stale lock" in l]
    assert len(lines) == 1 and said in lines[0], proc.stdout[-3000:]
    assert (tmp_path / "train.log").read_text().count("took over the stale lock") == 1
    assert [r["step"] for r in logged(tmp_path)] == [1, 2, 3]
    assert not (tmp_path / LOCK_NAME).exists()


def test_ctrl_c_releases_the_lock(tmp_path):
    proc = start(tmp_path, "trainer.max_steps=400")
    wait_for_step(tmp_path, proc, 2)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == proc.pid
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130  # checkpointed at a step boundary, then exited as 128 + SIGINT
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_job_of_a_sweep_is_refused_on_its_own_dir_and_the_others_release_theirs(tmp_path):
    holder = hold_by_hand(tmp_path / "1_optim=adamw")
    proc = run_python(["train.py", "-m", "optim=muon,adamw", f"hydra.sweep.dir={tmp_path}", *TINY,
                       "trainer.max_steps=2"], env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == 2
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert errors == [refusal_line(tmp_path / "1_optim=adamw", holder)], proc.stderr[-3000:]
    assert [r["step"] for r in logged(tmp_path / "0_optim=muon")] == [1, 2]
    assert not (tmp_path / "0_optim=muon" / LOCK_NAME).exists()
    assert not (tmp_path / "1_optim=adamw" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_two_concurrent_runs_the_second_is_refused_and_the_first_ends_as_if_alone(tmp_path):
    alone = train(tmp_path / "alone", "trainer.max_steps=30")
    assert alone.returncode == 0, alone.stderr[-3000:]
    run_dir = tmp_path / "shared"
    first = start(run_dir, "trainer.max_steps=30")
    wait_for_step(run_dir, first, 2)
    first.send_signal(signal.SIGSTOP)  # frozen mid-run, lock held: its dir stays still
    try:
        holder = json.loads((run_dir / LOCK_NAME).read_text())
        assert (holder["host"], holder["pid"]) == (HOST, first.pid)
        before = snapshot(run_dir)
        second = train(run_dir, "trainer.max_steps=30", "optim.lr=0.5")
        assert second.returncode == 2
        assert second.stderr.splitlines() == [refusal_line(run_dir, holder)], second.stderr[-3000:]
        assert snapshot(run_dir) == before
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    assert [(r["step"], r["train/loss"], r["optim/lr"]) for r in logged(run_dir)] == [
        (r["step"], r["train/loss"], r["optim/lr"]) for r in logged(tmp_path / "alone")]
    assert not (run_dir / LOCK_NAME).exists()


@pytest.mark.slow
def test_two_runs_started_together_on_a_free_dir_one_runs_and_one_is_refused(tmp_path):
    # Long enough that the winner still holds the lock whenever the other gets to it.
    procs = [start(tmp_path, "trainer.max_steps=200", f"seed={seed}") for seed in (0, 1)]
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]
    assert sorted(code for code, _ in results) == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert len(refused.splitlines()) == 1 and refused.startswith(f"error: run dir {tmp_path} is in use"), refused
    assert "Traceback" not in "".join(err for _, err in results)
    assert [r["step"] for r in logged(tmp_path)] == list(range(1, 201))


@pytest.mark.slow  # tests/test_multirun.py runs torchrun on a free dir in the quick suite
def test_torchrun_ranks_are_not_refused_by_their_own_rank_0s_lock(tmp_path):
    proc = train(tmp_path, torchrun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in logged(tmp_path)] == [1, 2, 3]
    assert "error:" not in proc.stderr
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.slow  # a torchrun launch or a six-job sweep: with the longer tests (make test's budget)
def test_torchrun_on_a_held_dir_stops_with_one_line_from_rank_0_and_changes_nothing(finished_run, tmp_path):
    run_dir = tmp_path / "run"
    subprocess.run(["cp", "-a", str(finished_run), str(run_dir)], check=True)
    holder = hold_by_hand(run_dir)
    before = snapshot(run_dir)
    proc = train(run_dir, torchrun=True)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert errors == [refusal_line(run_dir, holder)], proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr  # rank 0's code, in torchrun's summary
    assert 'train.py", line' not in proc.stderr  # no traceback from our code (torchrun prints its own)
    assert snapshot(run_dir) == before
