"""A dry run of one rank of a large layout, on the one device at hand (parallel.simulate_world).

`parallel.simulate_world=N parallel.simulate_rank=R` runs this single process as rank R of the
N-rank layout the parallel.* keys describe, over torch's fake process groups
(parallel/mesh.py, init_simulated_mesh): the real mesh, every group with its real ranks and
sizes, so the rank's parameter shards, Muon owner plan, experts, micro-batches and memory are
the real ones, and its steps run its real share of the compute. No data moves between ranks,
so values that other ranks would contribute are not there: the losses mean nothing.

What a simulation does differently from a training run, all of it decided here:
- it starts only as one process (never under torchrun), from the seed: checkpoint.resume=auto
  is taken as none and a path is refused (`check_simulation`, `dry_run_config`);
- it writes no checkpoint: no periodic save, no final save, none on an interrupt
  (`dry_run_config`, and `writes_checkpoints` for the CheckpointKeeper);
- the one process speaks for the run whatever its rank: it logs, and writes the metrics and
  the run records (`speaks_for_run`);
- it does not judge its losses (`judges_losses`): no stop on a non-finite eval loss, no
  not-learning warning; and its eval losses average the batches this rank runs, padding
  included (`eval_counted`), since no other rank's counts reach it;
- every record says it is a simulation: the start-up warning (`start_line`), a
  `"simulated": 1` field in every metrics row and TensorBoard/wandb log (`row_fields`),
  parallel.simulate_world / simulate_rank in the resolved config, wandb's config and
  TensorBoard's hparams, and a "simulation" entry in environment.json;
- it reports what it is for: the peak device memory (`PeakMemory`) and the rank's compute
  time per step (perf/simulated_step_s), in metrics and in a summary at the end.

Collectives over fake groups (what each does is parallel/comm.py's to say): all-reduces and
broadcasts leave this rank's input, all-gathers repeat it, and an all-to-all hands this rank's
input back as its output. So cross-rank agreements (the corpus id, precision, preemption
flags) see every rank agree with this one, and under expert parallelism this rank's E/ep
experts receive exactly the (token, expert) pairs this rank routed: on average what each rank
receives when the routing is balanced, not a skewed rank's load.
"""
from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass, replace
from typing import Mapping, Optional

import torch

from parallel.mesh import Mesh, _world_words, check_layout, init_mesh, init_simulated_mesh, is_simulated
from planning.memory_plan import planned_memory
from model.config import ModelConfig
from trainer.config import ConfigError, TrainConfig, layout_keys

log = logging.getLogger("simulate")

# The field every metrics row of a simulation carries (and TensorBoard and wandb with it).
ROW_FLAG = {"simulated": 1}
GIB = 1 << 30


def simulating(cfg: TrainConfig) -> bool:
    return cfg.parallel.simulate_world > 0


def check_simulation(cfg: TrainConfig, launched_world: int) -> int:
    """The world size the parallel.* keys describe: parallel.simulate_world in a simulation,
    else the processes launched. A simulation that cannot run raises ConfigError in one line:
    under torchrun, of a single rank, with a checkpoint to resume, or a simulated world the
    layout does not fit; so does a simulate_rank without a simulated world. (validate() has
    already checked that simulate_rank lies in the simulated world.)"""
    world = cfg.parallel.simulate_world
    if not world:
        if cfg.parallel.simulate_rank:
            raise ConfigError(f"parallel.simulate_rank={cfg.parallel.simulate_rank} is read only in a simulation: "
                              "set parallel.simulate_world=<ranks> too")
        return launched_world
    key = f"parallel.simulate_world={world}"
    if launched_world > 1:
        raise ConfigError(f"{key}: a simulation is one process; start it with python train.py, not under torchrun "
                          f"(WORLD_SIZE={launched_world})")
    if world < 2:
        raise ConfigError(f"{key}: a simulated layout needs at least 2 ranks (0 trains for real)")
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "none"):
        raise ConfigError(f"checkpoint.resume={resume}: a simulation ({key}) starts from the seed and resumes "
                          "nothing; leave checkpoint.resume at auto or none")
    try:
        check_layout(world, layout_keys(cfg.parallel))
    except ValueError as err:
        # The layout's own words count launched processes; here the ranks are simulated.
        raise ConfigError(str(err).replace(_world_words(world), f"the {world} ranks of {key}")) from err
    return world


def dry_run_config(cfg: TrainConfig) -> TrainConfig:
    """The config a simulation runs: no resume (auto means none), no periodic checkpoint."""
    if not simulating(cfg):
        return cfg
    return replace(cfg, checkpoint=replace(cfg.checkpoint, resume="none", interval=0))


def writes_checkpoints(cfg: TrainConfig) -> bool:
    return not simulating(cfg)


def judges_losses(cfg: TrainConfig) -> bool:
    """Whether the run acts on its loss values (a divergence stop on a non-finite eval loss, the
    not-learning warning): a simulation's losses mean nothing."""
    return not simulating(cfg)


def eval_counted(cfg: TrainConfig, counted: int, run: int) -> int:
    """How many of the `run` eval batches this rank runs count toward its eval losses: its own
    `counted` share, whose sums the data-parallel all-reduce adds to the other ranks'; in a
    simulation, where that all-reduce brings no other rank's, every batch it runs (a rank whose
    share is empty still runs the padding batches under FSDP2 and EP)."""
    return run if simulating(cfg) else counted


def init_run_mesh(cfg: TrainConfig, device: torch.device) -> Mesh:
    """The run's mesh: the launched processes' (init_mesh), or the simulated rank's."""
    p = cfg.parallel
    if simulating(cfg):
        return init_simulated_mesh(layout_keys(p), p.simulate_world, p.simulate_rank, device)
    return init_mesh(layout_keys(p), device, p.backend, p.timeout_s)


def speaks_for_run(mesh: Mesh) -> bool:
    """Whether this process logs and writes the run's records: rank 0 of a launch, or the one
    process of a simulation, whichever rank it plays."""
    return mesh.is_main or is_simulated()


def start_line(mesh: Mesh, n_experts: int) -> str:
    """The warning a simulation starts with: what it is, and what its numbers are worth."""
    experts = ""
    if mesh.ep > 1:
        experts = (f"; its {n_experts // mesh.ep} of {n_experts} experts per MoE layer receive exactly the "
                   "(token, expert) pairs this rank routed (the average share under balanced routing)")
    return (f"SIMULATION: this process is rank {mesh.rank} of a {mesh.world_size}-rank layout "
            f"({mesh.layout.describe()}) over fake process groups that move no data: shapes, memory and "
            f"this rank's compute are real, its losses mean nothing, and no checkpoint is written{experts}")


@dataclass(frozen=True)
class MemoryPeak:
    """The peak memory of a run so far, in bytes. `allocated`: live tensors (None where the
    device's allocator does not count them: a CPU); `reserved`: what the process holds for them
    (CUDA: the caching allocator's reserve; CPU: the process's peak resident set, Python and
    libraries included)."""

    allocated: Optional[int]
    reserved: int
    device_type: str

    def metrics(self) -> dict[str, float]:
        out = {"mem/peak_reserved_bytes": float(self.reserved)}
        if self.allocated is not None:
            out["mem/peak_allocated_bytes"] = float(self.allocated)
        return out

    def describe(self) -> str:
        if self.allocated is None:
            return f"peak resident set {self.reserved / GIB:.3f} GiB (CPU: live tensor bytes are not counted)"
        return f"peak allocated {self.allocated / GIB:.3f} GiB, reserved {self.reserved / GIB:.3f} GiB ({self.device_type})"


class PeakMemory:
    """Peak memory over the training steps. On CUDA the allocator's peaks, reset when the steps
    begin, so that start-up's transients (the matmul peak measurement) do not count; on a CPU
    the process's peak resident set, which cannot be reset (since the process started)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> MemoryPeak:
        if self.device.type == "cuda":
            return MemoryPeak(torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device),
                              "cuda")
        # Linux counts ru_maxrss in KiB, macOS in bytes.
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return MemoryPeak(None, rss if sys.platform == "darwin" else rss * 1024, self.device.type)


def row_fields(cfg: TrainConfig) -> dict[str, int]:
    """The fields every metrics row of this run carries besides its metrics."""
    return dict(ROW_FLAG) if simulating(cfg) else {}


class DryRunReport:
    """What a simulation adds to its metrics (peak memory, perf/simulated_step_s) and says at
    its end; a training run's report adds and says nothing."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, device: torch.device) -> None:
        self.active = simulating(cfg)
        self.mesh = mesh
        self.peak = PeakMemory(device)

    def start(self) -> None:
        """The training steps begin."""
        if self.active:
            self.peak.start()

    def metrics(self, row: Mapping[str, float]) -> dict[str, float]:
        """What a simulation adds to a metrics row about to be logged: the peak memory so far
        (the row's eval included) and, on a logging step, perf/simulated_step_s, the row's
        perf/step_s: with no communication to wait for, this rank's compute per step."""
        if not self.active:
            return {}
        added = self.peak.read().metrics()
        if "perf/step_s" in row:
            added["perf/simulated_step_s"] = row["perf/step_s"]
        return added

    def finish(self, last: Mapping[str, float], planned: Optional[Mapping[str, float]] = None) -> None:
        """Log the summary of a simulation that ran to its end, `last` its last row; `planned`
        a memory plan's prediction for this rank to put beside the measured peak (memory_report)."""
        if not self.active or "perf/simulated_step_s" not in last:
            return
        peak = self.peak.read()
        for line in memory_report(peak, planned):
            log.info(line)
        log.warning(summary_line(self.mesh, last["perf/simulated_step_s"], peak))


def planned_memory_of(cfg: TrainConfig, model_cfg: ModelConfig, mesh: Mesh) -> dict[str, float]:
    """The planner's bytes for this run's layout (planning/memory_plan.py), to put beside the
    measured peak. The plan is rank 0's, of one micro-batch: for another simulated rank it is
    the same up to the uneven last FSDP2 rows and the Muon owner plan's balance."""
    t = cfg.trainer
    return planned_memory(model_cfg, mesh.layout, cfg.optim.name, t.batch_size, t.seq_len,
                          t.activation_checkpointing, model_cfg.loss_chunks, t.precision)


# ---- Whether a simulation fits this machine, checked before anything is built ----

def host_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are) of the memory one simulated rank on `device` can have: a GPU's
    own memory, else the machine's physical RAM (a CPU rank's tensors live there)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the memory of its {props.name}"
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "its RAM"


# What a CPU rank cannot have of the machine's RAM: the OS and the page cache, other processes, and
# this process's own Python and libraries (about 1 GiB resident before a tensor is made), which
# the plan's tensor bytes leave out. 10% of the RAM, at least 2 GiB: a 24 GiB host keeps 2.4 GiB.
HOST_MARGIN_FRACTION = 0.10
HOST_MARGIN_MIN = 2 * GIB


def memory_margin(total: int, device: torch.device) -> int:
    """The bytes of `total` (host_memory's) a simulated rank must leave: none of a GPU's own
    memory (its plan is of the allocator's live bytes there), the margin above of the RAM."""
    if device.type == "cuda":
        return 0
    return max(int(total * HOST_MARGIN_FRACTION), HOST_MARGIN_MIN)


def check_simulated_memory(cfg: TrainConfig) -> None:
    """Raise ConfigError, in one line, for a simulation that cannot fit this machine, unless
    parallel.simulate_force: a layout too large to plan (planning/layout_limits.py), or one whose
    planned memory for the rank exceeds what the host can give it (host_memory, less
    memory_margin). It would otherwise build the
    corpus and the model for minutes, printing nothing, and then swap or be killed. The plan
    takes the model with the vocabulary its tokenizer will have (data.vocab_size for the BPE
    the run trains, the preset's documented one for a pretrained tokenizer) and the precision
    "auto" resolves to here. Call after check_simulation has checked the layout."""
    from planning.layout_limits import oversized
    from model.presets import DEFAULT_VOCAB, PRESET_VOCAB
    from optim.fast_dtype import resolve_precision

    p, t = cfg.parallel, cfg.trainer
    if not simulating(cfg) or p.simulate_force:
        return
    world = f"parallel.simulate_world={p.simulate_world}"
    layout = check_layout(p.simulate_world, layout_keys(p))
    vocab = cfg.model.vocab_size or (cfg.data.vocab_size if cfg.data.tokenizer is None
                                     else PRESET_VOCAB.get(cfg.model.name, DEFAULT_VOCAB))
    model = replace(cfg.model, vocab_size=vocab)
    shard = f"parallel.dp_shard={p.dp_shard}" + (f" ({layout.dp_shard} ranks)" if p.dp_shard == -1 else "")
    too_large = oversized(model, layout, shard, world)
    if too_large is not None:
        raise ConfigError(too_large)
    device = torch.device("cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu")
    planned_cfg = replace(cfg, trainer=replace(t, precision=resolve_precision(t.precision, device).precision))
    planned = planned_memory_of(planned_cfg, model, Mesh(p.simulate_rank, p.simulate_world, layout))["total"]
    have, what = host_memory(device)
    margin = memory_margin(have, device)
    if planned > have - margin:
        kept = f", less {margin / GIB:.1f} GiB kept for the OS, the page cache and this process's libraries" if margin else ""
        raise ConfigError(f"{world}: the memory plan puts rank {p.simulate_rank} of this layout at "
                          f"{planned / GIB:.1f} GiB, more than this machine's {(have - margin) / GIB:.1f} GiB "
                          f"({what}, {have / GIB:.1f} GiB{kept}), so it would swap or be killed after minutes of "
                          "building; shrink the model, the batch or the layout's share per rank, or set "
                          "parallel.simulate_force=true to run it anyway")


def summary_line(mesh: Mesh, step_s: float, peak: MemoryPeak) -> str:
    """The simulation's result in one line, at the end of the run."""
    return (f"SIMULATION of rank {mesh.rank} of {mesh.world_size}: {step_s:.4f} s of compute per step "
            f"(perf/simulated_step_s, last logging window; a real rank also waits for communication, so it is "
            f"at best this fast); {peak.describe()}")


def memory_report(peak: MemoryPeak, planned: Optional[Mapping[str, float]]) -> list[str]:
    """Lines putting the measured peak next to a plan's prediction for this rank.

    `planned`: predicted bytes by part (e.g. parameters, gradients, optimizer state,
    activations), as a memory planner gives them for this rank and layout; a "total" entry is
    the prediction to compare, else the sum of the parts. None: no prediction, the measurement
    alone. The comparison is with live tensor bytes where the device counts them (CUDA), else
    with the CPU process's peak resident set, which also holds Python and its libraries."""
    measured = peak.allocated if peak.allocated is not None else peak.reserved
    what = "allocated" if peak.allocated is not None else "resident set"
    if planned is None:
        return [f"memory: measured peak {what} {measured / GIB:.3f} GiB (no planned figure given)"]
    parts = {k: float(v) for k, v in planned.items() if k != "total"}
    total = float(planned["total"]) if "total" in planned else sum(parts.values())
    lines = ["memory plan (GiB): " + ", ".join(f"{name} {value / GIB:.3f}" for name, value in parts.items())]
    ratio = f" ({measured / total:.2f}x the plan)" if total > 0 else ""
    lines.append(f"memory: planned {total / GIB:.3f} GiB, measured peak {what} {measured / GIB:.3f} GiB{ratio}")
    return lines
