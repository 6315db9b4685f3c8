"""Shared helpers of the benchmark scripts: machine description, interleaved timing with a
filter for other processes' CPU load, and measured matmul peaks (MFU needs a peak measured
in the same run, not a datasheet figure)."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from scripts import REPO
from model.config import ModelConfig


# ----------------------------------------------------------------------------- runs


def add_run_arguments(ap) -> None:
    """The options every torchrun_train benchmark takes: steps, warm-up, precision, timeout and
    trailing Hydra overrides (check them with parse_run_arguments)."""
    ap.add_argument("--steps", type=int, default=8, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="leading steps left out of the medians")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run")


def parse_run_arguments(ap):
    args = ap.parse_args()
    if args.warmup >= args.steps:
        ap.error("--warmup must be smaller than --steps")
    return args


def torchrun_train(nproc: int, overrides: list[str], run_dir: Path, timeout: float, label: str) -> list[dict]:
    """A real training run of `nproc` ranks (one intra-op thread each: the ranks already share
    the cores), logging every step and evaluating only at its end; its metrics.jsonl rows."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
        "train.py", "logger.interval=1", "eval.interval=0",
        # The run always evaluates at its end: keep that (untimed) eval small.
        "eval.batches=1", "eval.batch_size=4", "checkpoint.interval=0", "logger.wandb.mode=disabled",
        "logger.tensorboard=false", "logger.progress=none", f"hydra.run.dir={run_dir}", *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"  {label}: {time.perf_counter() - t0:.0f} s wall", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{label} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- machine


def machine_info() -> dict[str, str]:
    fields: dict[str, str] = {}
    flags: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "flags" and not flags:
                flags = set(value.split())
            elif key in ("model name", "cpu family", "model", "stepping") and key not in fields:
                fields[key] = value
    caches = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        with contextlib.suppress(OSError):
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            size, shared = (index / "size").read_text().strip(), (index / "shared_cpu_list").read_text().strip()
            caches.append(f"L{level} {kind.lower()} {size} (cpus {shared})")
    isa = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if x in flags]
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": f"{fields.get('model name', 'unknown')} (family {fields.get('cpu family', '?')}, "
               f"model {fields.get('model', '?')}, stepping {fields.get('stepping', '?')})",
        "cpu flags (matmul)": " ".join(isa) or "-",
        "caches (cpu0)": "; ".join(caches) or "unknown",
        "logical cpus": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "torch cpu capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn (oneDNN)": str(torch.backends.mkldnn.is_available()),
    }
    if torch.cuda.is_available():
        info["cuda device"] = torch.cuda.get_device_name()
    with contextlib.suppress(OSError):
        info["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return info


def tensor_bytes(tensors) -> int:
    """Bytes held by `tensors` (parameters, optimizer state)."""
    return sum(t.numel() * t.element_size() for t in tensors)


# ----------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _jiffies() -> tuple[int, int] | None:
    """(busy jiffies of the whole machine, jiffies of this process), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(v) - v[3] - v[4], int(own[11]) + int(own[12])  # minus idle, iowait; utime + stime


FOREIGN_LIMIT = 0.10  # cores' worth of other processes' CPU time tolerated during a round
ROUND_STATS = {"kept": 0, "redone": 0}


def interleaved_times(
    fns: dict[str, Callable[[], object]], warmup: int, repeats: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds per call of each fn, one entry per round; each round calls every fn once.

    This machine may be shared: a round during which other processes used more than
    FOREIGN_LIMIT of a core (from /proc/stat minus our own CPU time) is thrown away and
    redone, up to 3 * repeats extra rounds.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    redo_budget = 3 * repeats
    while len(next(iter(times.values()))) < repeats:
        before, t_round = _jiffies(), time.perf_counter()
        took = {}
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            took[name] = time.perf_counter() - t0
        after, t_round = _jiffies(), time.perf_counter() - t_round
        if before is not None and after is not None and redo_budget > 0:
            hz = os.sysconf("SC_CLK_TCK")
            foreign = ((after[0] - before[0]) - (after[1] - before[1])) / hz / t_round
            if foreign > FOREIGN_LIMIT:
                redo_budget -= 1
                ROUND_STATS["redone"] += 1
                continue
        ROUND_STATS["kept"] += 1
        for name, secs in took.items():
            times[name].append(secs)
    return times


def interleaved_medians(
    fns: dict[str, Callable[[], object]], warmup: int, repeats: int, device: torch.device
) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in interleaved_times(fns, warmup, repeats, device).items()}


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of time(a) / time(b): robust to drifts that hit a whole round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


# ----------------------------------------------------------------------------- peaks


def peak_size(device: torch.device, on_cpu: int = 1024) -> int:
    """Side of a square matmul that reaches the device's peak. A GPU needs a big one: on an
    H100 a 1024^2 F.linear reads 38 TFLOP/s (launch- and sync-bound), 8192^2 its real peak."""
    return 8192 if device.type == "cuda" else on_cpu


def _square_peak(op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 device: torch.device, n: int, warmup: int, repeats: int) -> float:
    """GFLOP/s of op on n x n operands (median of interleaved, load-filtered samples). On CUDA
    a sample makes 10 calls, so the host's sync after each sample does not count against them."""
    calls = 10 if device.type == "cuda" else 1
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)

    def sample() -> None:
        for _ in range(calls):
            op(a, b)

    t = interleaved_medians({"op": sample}, warmup, repeats, device)["op"] / calls
    return 2 * n**3 / t / 1e9


def matmul_peak(dtype: torch.dtype, device: torch.device, n: int, warmup: int, repeats: int) -> float:
    """GFLOP/s of `a @ b` on n x n operands."""
    return _square_peak(torch.matmul, dtype, device, n, warmup, repeats)


def linear_peak(dtype: torch.dtype, device: torch.device, n: int, warmup: int, repeats: int) -> float:
    """GFLOP/s of F.linear on n x n operands, the op every model projection runs: on CPU
    its bf16 kernel can be several times faster or slower than that of `a @ b`."""
    return _square_peak(F.linear, dtype, device, n, warmup, repeats)


def percent_of_peak(achieved: float, peak: float) -> str:
    """achieved / peak as a table cell (MFU, % of peak). Above 100% the peak was mis-measured,
    so no figure is printed."""
    return f"{100 * achieved / peak:.1f}%" if achieved <= peak else "n/a (>100%)"


def cpu_snapshot() -> tuple[int, int] | None:
    """(busy jiffies of the whole machine, jiffies of this process), or None off Linux."""
    return _jiffies()


def foreign_cores(before: tuple[int, int] | None, after: tuple[int, int] | None, seconds: float) -> float | None:
    """Cores' worth of CPU time that other processes used between two cpu_snapshot()s."""
    if before is None or after is None or seconds <= 0:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    # Clamped: the two counters tick separately, so an idle machine can read a hair below 0.
    return max(0.0, ((after[0] - before[0]) - (after[1] - before[1])) / hz / seconds)


# ----------------------------------------------------------------------------- the planner's batch


def hardware_for_device(device_name: str) -> str:
    """The conf/hardware profile of a CUDA device, by the GPU model its name carries ("NVIDIA
    H200" -> h200_sxm); ValueError naming the profiles when none matches."""
    profiles = sorted(p.stem for p in (REPO / "conf" / "hardware").glob("*.yaml"))
    for name in profiles:
        if name.split("_")[0].upper() in device_name.upper():
            return name
    raise ValueError(f"no conf/hardware profile for {device_name!r} (profiles: {', '.join(profiles)}); "
                     "name one with --hardware or give --memory-gb")


def planned_batch(cfg: ModelConfig, optims: list[str], seq_len: int, memory_bytes: float, checkpointing: str = "none",
                  loss_chunks: int = 1, precision: str = "bf16", most: int = 4096) -> tuple[int, dict[str, float]]:
    """The largest micro-batch (sequences of seq_len tokens) whose planned peak on one GPU fits
    in memory_bytes for every optimizer in `optims`, by the planner's own rule (scripts/
    plan_scale.py: planning/memory_plan.planned_memory's total at most the memory), and the
    planned peak of each optimizer at it. (0, peaks at batch 1) when not even one sequence
    fits. One batch for all of them, so that their rows compare at the same tokens per step."""
    from planning.memory_plan import planned_memory
    from parallel.mesh import Layout

    def peaks(batch: int) -> dict[str, float]:
        return {o: planned_memory(cfg, Layout(), o, batch, seq_len, checkpointing, loss_chunks, precision)["total"]
                for o in optims}

    def fits(batch: int) -> bool:
        return max(peaks(batch).values()) <= memory_bytes

    if not fits(1):
        return 0, peaks(1)
    lo, hi = 1, 2  # fits(lo); find a hi that does not, then bisect (the peak grows with the batch)
    while hi <= most and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, most + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, peaks(lo)
