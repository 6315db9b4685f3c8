"""The training loop: mesh -> data -> model -> optimizer -> steps, with eval and metrics."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import torch

from data.loader import TrainBatches
from eval.evaluate import gather_stage_metrics
from eval.flops import train_flops_per_token
from eval.health import HealthStats
from parallel.comm import COUNTER as COMM, region
from model.moe import balance_experts, reset_routing_stats
from parallel.tp_ops import all_reduce
from optim.builder import build_optimizer, muon_ns_shapes
from optim.muon.ns_choice import resolve_ns_method
from optim.qk_clip import QKClip
from optim.schedule import lr_at, warmup_steps, warmup_words
from trainer.checkpoint import files as checkpoint_files
from trainer.checkpoint import state as checkpoint_state
from trainer.checkpoint import store as checkpoint
from trainer import device as dev
from trainer.simulation import one_rank as simulate
from trainer.config import TrainConfig
from parallel.fsdp import sync_gradients
from parallel.mesh import Mesh
from trainer.precision import resolve_run_precisions
from trainer.run.interrupts import exit_if_interrupted_during_start_up
from trainer.run.preemption import Preempted, PreemptionFlag
from trainer.profiling import StepProfiler
from trainer.run.progress import Progress
from trainer.run.sinks import MetricSinks, set_aside_rows_after
from trainer.run.start_records import write_start_records
from model.fp8 import refresh_weight_scales
from trainer.build import build_pipeline_model, measured_peak_flops, prepare_data_once
from trainer.evaluation import eval_sets, evaluate
from trainer.pipeline import PipelineRun, merged_over
from trainer.checkpoint.keeper import CheckpointKeeper
from trainer.skips import SkipCounter, flag_step

log = logging.getLogger("trainer")


# A loss within NOT_LEARNING_MARGIN nats of ln(vocab_size) after the warmup and at least
# NOT_LEARNING_AFTER steps: the model has learnt nothing. Any learning run is far below it by
# then (the unigram distribution alone is worth nats).
NOT_LEARNING_AFTER = 20
NOT_LEARNING_MARGIN = 0.05


class NonFiniteLoss(RuntimeError):
    """The run diverged: a NaN/inf step under trainer.nonfinite=stop, too many consecutive
    skipped steps, a non-finite eval loss, or non-finite weights at a checkpoint."""


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, mesh: Optional[Mesh] = None) -> None:
        self.run_dir = run_dir
        # A simulation (parallel.simulate_world) resumes and saves nothing: trainer/simulation/one_rank.py.
        cfg = simulate.dry_run_config(cfg)
        dev.use_deterministic_kernels(cfg.trainer.deterministic)
        self.device = dev.resolve_device(cfg.trainer.device, dev.local_rank())
        dev.set_tf32(cfg.trainer.tf32)  # per job, like deterministic: a sweep's jobs share the process
        self.mesh = mesh if mesh is not None else simulate.init_run_mesh(cfg, self.device)
        # Rank 0 logs and writes the run's records; in a simulation the one process does.
        self.speaks = simulate.speaks_for_run(self.mesh)
        self.checkpoint_dir = run_dir / "checkpoints"
        resumed = checkpoint.find_resume(cfg.checkpoint.resume, self.checkpoint_dir, self.mesh,
                                         cfg.checkpoint.allow_suspect)
        # "auto" precisions become what runs (what a resumed run ran), before anything reads them.
        cfg, precision_line = resolve_run_precisions(
            cfg, self.device, self.mesh, resumed["config"] if resumed is not None else None
        )
        self.cfg = cfg
        t = cfg.trainer
        if self.speaks:
            log.info(precision_line)
        dev.seed_everything(cfg.seed)

        self.data = prepare_data_once(cfg, self.mesh)
        built = build_pipeline_model(cfg, self.data.vocab_size, self.mesh, self.device)
        self.model, stages, plan, self.fp8 = built.model, built.stages, built.plan, built.fp8
        self.n_params = built.n_params
        self.model_cfg = self.model.cfg
        self.sharded = self.mesh.layout.dp_shard > 1
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        # optim.muon.ns_method=auto: Gram or standard Newton-Schulz per matrix shape, timed once
        # here (or kept from the checkpoint), then recorded in the config the optimizer is built from.
        auto_ns = cfg.optim.name == "muon" and cfg.optim.muon.ns_method == "auto"
        # Under a pipeline every stage decides for the shapes of all of them, together.
        ns_shapes = merged_over(muon_ns_shapes(self.model, cfg.optim, self.model_cfg, self.mesh),
                                self.mesh.pp_group) if auto_ns else {}
        optim_cfg, ns_line = resolve_ns_method(cfg.optim, ns_shapes, self.device,
                                               resumed["config"] if resumed is not None else None, self.mesh.host_group)
        self.cfg = cfg = replace(cfg, optim=optim_cfg)
        if ns_line is not None and self.speaks:
            log.info(ns_line)
        if t.compile and (self.sharded or t.activation_checkpointing != "none" or plan is not None):
            # Block by block. Under FSDP2: each block's gathers and reduce-scatters stay FSDP2's
            # hooks around a compiled body, so communication still overlaps compute. Under
            # activation checkpointing: each compiled graph holds one block's checkpointed region,
            # whose recompute the partitioner plans as the policy says (model/activation_checkpoint.py).
            # Under a pipeline: a stage is a schedule's unit, its blocks the compiled ones.
            for block in self.model.blocks:
                block.compile()
            self.forward = self.model
        else:
            self.forward = dev.maybe_compile(self.model, t.compile)
        # Compiling Muon's elementwise work pays where memory passes are the cost: on GPUs.
        self.optimizer = build_optimizer(self.model, cfg.optim, self.model_cfg, self.mesh,
                                         compile_updates=t.compile and self.device.type == "cuda")
        self.health = HealthStats(self.model, self.mesh.tp_group,
                                  self.mesh.device_mesh.get_group("dp_shard") if self.sharded else None,
                                  self.mesh.ep_group, self.mesh.pp_group)
        clip = cfg.optim.qk_clip
        self.qk_clip = (QKClip(self.model, clip.tau, self.mesh.dp_group, self.mesh.tp_group, self.mesh.pp_group)
                        if clip.enabled else None)
        # Under a pipeline (parallel.pp > 1) the step's forwards and backwards run in torch's
        # schedule over this rank's stages (trainer/pipeline.py).
        self.pipeline = PipelineRun(cfg, self.model, stages, plan, self.mesh, self.device, self.autocast) \
            if plan is not None else None
        self.fsdp_roots = stages or [self.model]

        self.global_batch = t.batch_size * t.grad_accum * self.mesh.dp
        self.tokens_per_step = self.global_batch * t.seq_len
        # perf/mfu = model FLOP/s / (world size * one device's peak).
        self.flops_per_token = train_flops_per_token(self.model_cfg, t.seq_len)
        self.peak_flops = t.peak_tflops * 1e12 or measured_peak_flops(self.device, t.precision, self.speaks)
        self.train_batches = TrainBatches(self.data.train, t.seq_len, self.global_batch, cfg.seed)
        self.eval_sets, self.eval_counted, self.max_logit_batch = eval_sets(self)
        self.step = 0
        # Tokens trained on so far, counted (and checkpointed) rather than derived from the
        # step, so the count stays right across a resume with a different global batch.
        self.tokens = 0
        self.skipped_steps = 0
        # Steps skipped on the device since the host last looked.
        self.skips = SkipCounter(self.device)
        self.checkpoints = CheckpointKeeper(self, self.checkpoint_dir, simulate.writes_checkpoints(cfg))
        # [sum, count] of the finite train losses since the last logging step (train/loss): a
        # non-finite step is left out and not counted.
        self.loss_window = torch.zeros(2, device=self.device)
        # The step's skip flag, loss window and skip counts, fused by compile on a GPU.
        self.flag_step = torch.compile(flag_step) if t.compile and self.device.type == "cuda" else flag_step
        # See _warn_if_not_learning; a run that does not judge its losses has nothing to check.
        self._learning_checked = not simulate.judges_losses(cfg)
        # A simulation's own metrics and final summary (nothing for a training run).
        self.dry_run = simulate.DryRunReport(cfg, self.mesh, self.device)
        if resumed is not None:
            checkpoint_state.restore(self, resumed)
            if self.fp8.all_gather:
                refresh_weight_scales(self.fsdp_roots)
            log.info("resumed from step %d", self.step)
            if self.speaks:
                # Rows the stopped run logged past the checkpoint: this run logs those steps again.
                set_aside_rows_after(run_dir, self.step)
            path = Path(resumed["path"])
            self.checkpoints.resumed_from(path, checkpoint_files.suspicion(path) is not None)
        elif self.speaks:
            # Rows of an earlier start that this fresh one logs again (one killed before its
            # first checkpoint, or a checkpoint.resume=none rerun): one row per step, as after a resume.
            set_aside_rows_after(run_dir, 0, starts_fresh=(
                "a simulation resumes nothing" if simulate.simulating(cfg) else
                "checkpoint.resume=none" if cfg.checkpoint.resume == "none" else "no checkpoint to resume from"))
        # The run dir's start-up records and lines, from the rank that speaks.
        self.environment: dict = write_start_records(self, resumed, plan is not None) if self.speaks else {}

    def resolved_config(self) -> dict:
        """The config as it runs: "auto" precisions resolved, the model's vocabulary set, and
        the id of the exact corpus it trains on."""
        return {**asdict(replace(self.cfg, model=self.model_cfg)), "corpus_id": self.data.corpus_id}

    def autocast(self):
        return dev.autocast(self.device, self.cfg.trainer.precision)

    def train_step(self, measure: bool) -> dict[str, torch.Tensor | float]:
        """One optimizer step over grad_accum micro-batches. `measure` adds the health stats."""
        t, mesh = self.cfg.trainer, self.mesh
        lr = lr_at(self.step, self.cfg.optim, t.max_steps)
        self.optimizer.set_lr(lr)
        self.model.track_output_rms = measure
        with region("forward_backward"):
            if self.pipeline is not None:
                step_loss = self.pipeline.train_step([self._micro_batch(m) for m in range(t.grad_accum)])
            else:
                step_loss = self._forward_backward()
        self.model.track_output_rms = False

        with region("grad_sync"):
            grad_norm = self.optimizer.prepare_grads(self.cfg.optim.grad_clip)
        # The global gradient norm is the same on every rank, so all ranks agree on whether
        # this step is finite. A logging step reads it here (it syncs anyway); any other step
        # hands it to the optimizers, which skip a non-finite step on the device, and the
        # host learns of it at its next sync point (_collect_skips): no host sync per step.
        found_inf, self.loss_window, self.skips.counts = self.flag_step(
            grad_norm, step_loss, self.loss_window, self.skips.counts, self.step + 1)
        self.skips.through = self.step + 1
        stats: dict[str, torch.Tensor | float] = {"train/loss": step_loss}
        if measure:
            stats.update(self._pop_loss_window(step_loss))
            # Every logging step once any step was skipped: skips collected at a checkpoint
            # between logging steps must reach the metrics too.
            self._collect_skips()
            if self.skipped_steps:
                stats["train/skipped_steps"] = float(self.skipped_steps)
            if found_inf.item():
                return self._nonfinite_step(stats)
            found_inf = None  # known finite: the optimizers need no gate
            before = self.health.snapshot()
            dev.synchronize(self.device)
            t0 = time.perf_counter()
        else:
            stats["train/skipped_steps"] = self.skips.counts[SkipCounter.SKIPPED] + self.skipped_steps
        with region("optimizer"):
            self.optimizer.step(found_inf)
            self.optimizer.zero_grad()
            if self.qk_clip is not None:
                self.qk_clip.apply(found_inf)
            if self.fp8.all_gather:  # the float8 all-gather's scales, of the weights just written
                refresh_weight_scales(self.fsdp_roots)
        forwards = t.grad_accum * (self.pipeline.plan.spec.microbatches if self.pipeline is not None else 1)
        moe = balance_experts(self.model, mesh.dp_group, self.model_cfg.bias_update_rate, forwards, found_inf)
        if measure:
            dev.synchronize(self.device)
            stats["perf/optim_step_s"] = time.perf_counter() - t0
            if self.pipeline is not None:  # every pipeline rank steps its own stages' optimizers
                stats.update(self.pipeline.per_rank("perf/optim_step_s", stats["perf/optim_step_s"]))
            stats["optim/grad_norm"] = grad_norm
            stats["optim/lr"] = lr
            stats.update(self.health.update_rms(before, lr))
            stats.update(self.health.weight_rms())
            n_tokens = t.batch_size * t.grad_accum * t.seq_len
            rms = self.model.pop_output_rms(n_tokens)
            # Every DP rank saw as many tokens: the RMS over all of them is the root of the mean
            # square. Under a pipeline each layer's slot is filled on its own stage, zero elsewhere.
            rms = all_reduce((all_reduce(rms.square(), mesh.dp_group) / mesh.dp).sqrt(), mesh.pp_group).tolist()
            stats.update({f"model/output_rms/layer_{i}": v for i, v in enumerate(rms[:-1])})
            stats["model/output_rms/final"] = rms[-1]
            stats.update(gather_stage_metrics(moe, mesh.pp_group) if self.model_cfg.n_experts else moe)
            if self.qk_clip is not None:
                stats.update(self.qk_clip.metrics())
        self._advance()
        return stats

    def _micro_batch(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        t, mesh = self.cfg.trainer, self.mesh
        x, y = self.train_batches.micro_batch(self.step, micro, mesh.dp_rank, mesh.dp, t.grad_accum)
        return dev.to_device(x, self.device), dev.to_device(y, self.device)

    def _forward_backward(self) -> torch.Tensor:
        """Forward and backward of the step's grad_accum micro-batches; their mean loss."""
        accum = self.cfg.trainer.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(accum):
            x, y = self._micro_batch(micro)
            if self.sharded:  # FSDP2 reduce-scatters once, in the last micro-batch's backward
                sync_gradients(self.model, micro == accum - 1)
            with self.autocast():
                loss = self.forward(x, y)
            # Every micro-batch holds the same number of tokens, so the mean of the
            # micro-batch means (and then of the DP ranks' means) is the global token mean.
            (loss / accum).backward()
            loss_sum += loss.detach().float()
        return loss_sum / accum

    def _pop_loss_window(self, step_loss: torch.Tensor) -> dict[str, torch.Tensor]:
        """train/loss: the mean over the logging interval's finite steps, over every DP rank (NaN
        when none was finite); train/loss_last: this step's loss alone. Then a new window."""
        total, count, last = all_reduce(torch.cat([self.loss_window, step_loss.reshape(1)]), self.mesh.dp_group).unbind()
        self.loss_window.zero_()
        return {"train/loss": total / count, "train/loss_last": last / self.mesh.dp}

    def _advance(self) -> None:
        self.step += 1
        self.tokens += self.tokens_per_step

    def discard_step_statistics(self) -> None:
        """Forget what this step's forward passes accumulated (MoE routing counts, output
        sums of squares): a dropped step must not leak into the next step's expert-bias
        update or metrics, and a NaN in them would poison every later step."""
        reset_routing_stats(self.model)
        self.model.output_sq_sum.zero_()
        if self.qk_clip is not None:
            self.qk_clip.reset()

    def _collect_skips(self) -> int:
        """Read the steps the device skipped since the last call (a host sync: called on
        logging steps, before a checkpoint and at the end of training). Stops the run here,
        before any checkpoint after the skip is written, under trainer.nonfinite=stop or once
        trainer.nonfinite_max_consecutive steps in a row were skipped. Returns the number of
        steps skipped since the last call."""
        report = self.skips.collect()
        self.checkpoints.note_skips(report)
        if not report.skipped:
            return 0
        self.skipped_steps += report.skipped
        t = self.cfg.trainer
        if t.nonfinite == "stop":
            raise NonFiniteLoss(
                f"non-finite loss/gradients at step {report.first}; stopping with trainer.nonfinite=stop. "
                f"{self.checkpoints.last_good_line()}"
            )
        if report.longest_run >= t.nonfinite_max_consecutive:
            raise NonFiniteLoss(
                f"diverged: {report.longest_run} consecutive steps had non-finite loss/gradients "
                f"(trainer.nonfinite_max_consecutive={t.nonfinite_max_consecutive}; {self.skipped_steps} "
                f"skipped in all). {self.checkpoints.last_good_line()}"
            )
        log.warning("non-finite gradients: %d step(s) skipped since step %d (%d so far)",
                    report.skipped, report.first, self.skipped_steps)
        return report.skipped

    def _nonfinite_step(self, stats: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor | float]:
        """A logging step whose gradients are non-finite (already counted by _collect_skips):
        drop its gradients and what its forward passes accumulated."""
        self.optimizer.zero_grad()
        self.model.track_output_rms = False
        self.discard_step_statistics()
        self._advance()
        return {**stats, "train/skipped_steps": float(self.skipped_steps)}

    def save_checkpoint(self, evaluated: bool = False, final: bool = True) -> None:
        """Checkpoint the current step (see CheckpointKeeper.save), unless the run diverged or
        writes no checkpoint (a simulation)."""
        if not self.checkpoints.writes:
            return
        self._collect_skips()
        with region("checkpoint"):
            if not checkpoint_state.state_is_finite(self):
                raise NonFiniteLoss(
                    f"diverged: the weights or optimizer state hold NaN/inf at step {self.step}; no checkpoint "
                    f"was written. {self.checkpoints.last_good_line()}"
                )
            self.checkpoints.save(evaluated, final)

    def _warn_if_not_learning(self, step: int, loss: float) -> None:
        """Once, at the first logging step past the warmup (and past NOT_LEARNING_AFTER steps):
        a loss still at ln(vocab_size), what a uniform guess scores, means the model has learnt
        nothing (an lr of 0, a frozen model, labels unrelated to the inputs), and exit code 0
        would not say so."""
        o, max_steps = self.cfg.optim, self.cfg.trainer.max_steps
        if self._learning_checked or step <= max(warmup_steps(o, max_steps), NOT_LEARNING_AFTER):
            return
        self._learning_checked = True
        chance = math.log(self.data.vocab_size)
        if math.isfinite(loss) and loss > chance - NOT_LEARNING_MARGIN and self.speaks:
            log.warning("run %s is not learning: train/loss %.4f at step %d is still ln(vocab_size) = %.4f, "
                        "a uniform guess, past %s (optim.lr=%g)", self.cfg.name, loss, step,
                        chance, warmup_words(o, max_steps), o.lr)

    def _check_eval_finite(self, step: int, metrics: dict[str, float]) -> None:
        """Finite weights can still give a NaN/inf loss (weights grown past what the forward
        pass can hold): the run has diverged, and is stopped before it checkpoints."""
        bad = {k: v for k, v in metrics.items() if k.endswith("/loss") and not math.isfinite(v)}
        if bad:
            named = ", ".join(f"{k} {v}" for k, v in bad.items())
            raise NonFiniteLoss(f"diverged: {named} at step {step}. {self.checkpoints.last_good_line()}")
        self.checkpoints.eval_was_finite()

    def evaluate(self) -> dict[str, float]:
        return evaluate(self)

    def train(self) -> dict[str, float]:
        """Run to trainer.max_steps; return the metrics of the last log event."""
        exit_if_interrupted_during_start_up()  # before anything of training is written
        self.checkpoints.warn_if_next_save_will_not_fit()
        cfg, mesh = self.cfg, self.mesh
        t = cfg.trainer
        sinks = None
        if self.speaks:
            sinks = MetricSinks(
                self.run_dir, cfg.logger, cfg.name, {**self.resolved_config(), "environment": self.environment},
                metric_names=["train/loss", *(f"val/{name}/loss" for name in self.eval_sets)],
                row_fields=simulate.row_fields(cfg),
            )
        progress = Progress(t.max_steps, self.step, cfg.logger.progress if self.speaks else "none",
                            cfg.logger.progress_prefix)
        last: dict[str, float] = {}
        window_start, window_steps = time.perf_counter(), 0
        COMM.reset()
        preemption = PreemptionFlag(self.device)
        profiler = StepProfiler(cfg.profile, self.run_dir / "traces", mesh.rank, self.device)
        self.dry_run.start()
        try:
            while self.step < t.max_steps:
                done, metrics = self.step + 1, {}  # metrics: the step's row, if it logs one
                profiler.begin(done)
                stop_code = preemption.raised(mesh)
                if stop_code:
                    progress.message(f"preempted: {self.checkpoints.saving_words()} at step {self.step} and exiting")
                    self.save_checkpoint()
                    raise Preempted(stop_code)
                is_last = done == t.max_steps
                measure = done % cfg.logger.interval == 0 or is_last
                stats = self.train_step(measure)
                window_steps += 1
                progress.advance()
                if measure:
                    dev.synchronize(self.device)
                    elapsed = time.perf_counter() - window_start
                    metrics = {k: float(v) for k, v in stats.items()}
                    metrics["perf/step_s"] = elapsed / window_steps
                    metrics["perf/tokens_per_s"] = self.tokens_per_step * window_steps / elapsed
                    metrics["perf/mfu"] = metrics["perf/tokens_per_s"] * self.flops_per_token / (
                        mesh.world_size * self.peak_flops
                    )
                    metrics["mem/optim_state_bytes"] = float(self.optimizer.state_bytes())
                    if mesh.world_size > 1:
                        metrics.update(COMM.metrics(window_steps))
                    progress.report(done, metrics["train/loss"], metrics["perf/tokens_per_s"])
                    self._warn_if_not_learning(done, metrics["train/loss"])
                eval_due = is_last or (cfg.eval.interval > 0 and done % cfg.eval.interval == 0)
                if eval_due:
                    with region("eval"):
                        eval_metrics = self.evaluate()
                    if simulate.judges_losses(cfg):
                        self._check_eval_finite(done, eval_metrics)
                    progress.message(f"step {done}: " + ", ".join(
                        f"{k} {v:.4f}" for k, v in eval_metrics.items() if k.endswith("/loss")
                    ))
                    metrics.update(eval_metrics)
                # The step's row goes out before its checkpoint: a rank that dies once the
                # checkpoint is in place (at the closing barrier, say) must not leave a step to
                # resume from without its row. A row past the checkpoint a restart resumes from
                # is set aside and logged again, so this order loses nothing either way.
                if metrics:
                    metrics.update(self.dry_run.metrics(metrics))
                    if sinks is not None:
                        sinks.log(done, self.tokens, metrics)
                    last = metrics
                interval = cfg.checkpoint.interval
                saves = (is_last and cfg.checkpoint.at_end) or (interval > 0 and done % interval == 0)
                if saves:
                    self.save_checkpoint(evaluated=eval_due, final=is_last)
                if metrics or saves:
                    # Eval, logging and saving are not training: restart the throughput and comm window.
                    window_start, window_steps = time.perf_counter(), 0
                    COMM.reset()
                if profiler.end(done):
                    # Writing the trace is not training either.
                    window_start, window_steps = time.perf_counter(), 0
                    COMM.reset()
            # A signal after the last step's check (during its evaluation or checkpoint) would
            # be lost with the flag: the run is complete, but whoever runs it (a sweep, a study)
            # was asked to stop and must not start the next one.
            stop_code = preemption.raised(mesh)
            if stop_code:
                progress.message(f"stopping: asked to during the last step's evaluation or checkpoint; the run "
                                 f"is complete at step {self.step}")
                raise Preempted(stop_code)
        except NonFiniteLoss:
            # Every rank stops here together (the counts and losses are global): a checkpoint
            # still being written predates the divergence, so it is finished, not dropped.
            self.checkpoints.commit()
            self.checkpoints.diverged(self.step + 1)
            raise
        finally:
            self.checkpoints.close()
            profiler.close()
            preemption.restore()
            progress.close()
            if sinks is not None:
                sinks.close()
        if self.dry_run.active:
            self.dry_run.finish(last, simulate.planned_memory_of(self.cfg, self.model_cfg, self.mesh))
        return last
