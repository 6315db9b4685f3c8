"""Metric sinks: metrics.jsonl always, TensorBoard and wandb when enabled. Rank 0 only.

Every sink receives the same names, so a curve found in one is found in the others.
"""
from __future__ import annotations

import json
import logging
import os
import shlex
from pathlib import Path
from typing import Any, Iterable, Optional, Union

from data.atomic import atomic_output
from data.source_checks import require_package
from data.sources import DataConfigError
from trainer.config import LoggerConfig, WandbConfig

log = logging.getLogger("sinks")


HParam = Union[str, int, float, bool]


def flat_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, HParam]:
    """A nested config as TensorBoard hparams: dotted keys, and scalar values (null and lists as text)."""
    flat: dict[str, HParam] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_hparams(value, f"{name}."))
        elif isinstance(value, (str, int, float, bool)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


def check_sink_packages(cfg: LoggerConfig) -> None:
    """The packages the enabled sinks import, checked at start-up: MetricSinks imports them
    only once the corpus is built and the matmul peak measured."""
    if cfg.wandb.mode != "disabled":
        require_package("wandb", f"logger.wandb.mode={cfg.wandb.mode}", "switch wandb off with logger.wandb.mode=disabled")
    if cfg.tensorboard:
        require_package("tensorboard", "logger.tensorboard=true", "switch TensorBoard off with logger.tensorboard=false")


class WandbOnlineError(DataConfigError):
    """logger.wandb.require_online=true and wandb could not start online.

    A DataConfigError only because train.py turns those, raised by the Trainer, into one line
    on stderr and exit code 2: the user's to fix (network, key, or the switch), not a crash."""


def failure_reason(err: BaseException) -> str:
    """The exception's type and first line: wandb's messages go on with advice over more lines."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def wandb_destination(run: Any) -> str:
    """Where the run's data goes: its URL when online; offline, its dir and the command that
    uploads it. WANDB_SILENT keeps wandb from saying so itself."""
    local = os.path.abspath(run.settings.sync_dir)
    if run.offline:
        return f"wandb: offline run in {local}; upload it with `wandb sync {shlex.quote(local)}`"
    return f"wandb: run {run.url} (local files in {local})"


def waiting_line(cfg: WandbConfig) -> str:
    """What an online start is about to wait for, how long, and what follows a failure."""
    after = ("the run stops (logger.wandb.require_online=true)" if cfg.require_online
             else "the run goes on offline")
    return (f"wandb: connecting to wandb's server, waiting up to {cfg.init_timeout_s:g} s "
            f"(logger.wandb.init_timeout_s); if it does not answer, {after}")


def start_wandb(run_dir: Path, cfg: WandbConfig, name: str, config: dict[str, Any]) -> Any:
    """The wandb run, under <run_dir>/wandb. An online start that fails (no network, a server
    that does not answer within cfg.init_timeout_s, a rejected key) goes on offline, with one
    warning, unless cfg.require_online: then it raises WandbOnlineError."""
    import wandb

    def init(mode: str) -> Any:
        return wandb.init(
            dir=str(run_dir),
            mode=mode,
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group,
            name=name,
            config=config,
            reinit="finish_previous",
            settings=wandb.Settings(init_timeout=cfg.init_timeout_s),
        )

    if cfg.mode != "online":
        run = init(cfg.mode)
    else:
        # Said before the wait, not after it: without a network wandb is silent for the whole
        # init_timeout_s, which looks like a hang.
        log.info(waiting_line(cfg))
        try:
            run = init("online")
        # wandb.errors.Error: CommError (no network, no answer in init_timeout_s) and its
        # AuthenticationError; TimeoutError: wandb's own wait, a few seconds longer, for a
        # service that never answered.
        except (wandb.errors.Error, TimeoutError) as err:
            if cfg.require_online:
                raise WandbOnlineError(
                    f"logger.wandb.require_online=true: wandb could not start online ({failure_reason(err)}); "
                    "fix the network or the key, or let the run go on offline with "
                    "logger.wandb.require_online=false"
                ) from err
            log.warning("wandb: online start failed (%s); the run goes on offline "
                        "(logger.wandb.require_online=true makes this an error)", failure_reason(err))
            run = init("offline")
    log.info(wandb_destination(run))
    return run


METRICS_FILE = "metrics.jsonl"
# Rows a stopped run logged past the checkpoint a resume went back to: the resumed run logs
# those steps again, and readers expect one row per step in METRICS_FILE.
SET_ASIDE_FILE = "metrics.set_aside.jsonl"


def _row_step(line: bytes) -> Optional[int]:
    """The step of one metrics.jsonl line; None for a line that is not a whole row (the torn
    last line of a run killed while writing it)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None


def set_aside_rows_after(run_dir: Path, step: int, starts_fresh: Optional[str] = None) -> list[int]:
    """Move the rows of metrics.jsonl past `step` (the resumed checkpoint's), and any torn line,
    to the end of metrics.set_aside.jsonl; return the steps moved. `starts_fresh`: why this run
    starts from the seed instead (`step` is then 0 and every row goes), for the line that says so.

    The set-aside file is written first and each file replaced whole (temp file + rename):
    a crash in between leaves a row in both files, never in neither.
    """
    path = run_dir / METRICS_FILE
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    keep: list[bytes] = []
    aside: list[bytes] = []
    moved: list[int] = []
    for line in lines:
        if not line.strip():
            continue
        row_step = _row_step(line)
        if row_step is not None and row_step <= step:
            keep.append(line)
        else:
            aside.append(line)
            if row_step is not None:
                moved.append(row_step)
    if not aside:
        return []
    target = run_dir / SET_ASIDE_FILE
    earlier = target.read_bytes() if target.exists() else b""
    # A line cut short by a kill lacks its newline; the next row must not be glued onto it.
    with atomic_output(target) as f:
        f.write(earlier + b"".join(line.rstrip(b"\n") + b"\n" for line in aside))
    with atomic_output(path) as f:
        f.write(b"".join(line.rstrip(b"\n") + b"\n" for line in keep))
    torn = len(aside) - len(moved)
    if len(moved) == 1:
        what = f"1 row (step {moved[0]})"
    else:
        what = f"{len(moved)} rows (steps {min(moved)}-{max(moved)})" if moved else "no whole row"
    what += f" and {torn} torn line{'s' if torn > 1 else ''}" if torn else ""
    if starts_fresh is not None:
        log.info("%s: set aside %s that an earlier start of this run logged, in %s: this run starts from step 0 "
                 "(%s)", METRICS_FILE, what, SET_ASIDE_FILE, starts_fresh)
    else:
        log.info("%s: set aside %s that the stopped run logged after the checkpoint of step %d, in %s; "
                 "this run logs those steps again", METRICS_FILE, what, step, SET_ASIDE_FILE)
    return moved


class MetricSinks:
    """`config` (the resolved config, corpus id and environment) goes to wandb's config and
    TensorBoard's hparams, where `metric_names` are the metrics its table shows. `row_fields`
    go into every row of every sink beside the metrics: what each row must say about the run
    itself, such as {"simulated": 1} for a simulation whose losses mean nothing."""

    def __init__(self, run_dir: Path, cfg: LoggerConfig, run_name: str, config: dict[str, Any],
                 metric_names: Iterable[str] = (), row_fields: Optional[dict[str, float]] = None) -> None:
        self.row_fields = dict(row_fields or {})
        run_dir.mkdir(parents=True, exist_ok=True)
        self.wandb_run = None
        if cfg.wandb.mode != "disabled":
            # wandb first: a run that must go online and cannot stops before writing anything.
            # wandb writes its run files under <dir>/wandb.
            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb_run = start_wandb(run_dir, cfg.wandb, cfg.wandb.name or run_name, config)
            # Tokens as the x-axis of every panel: runs with other batch sizes line up by data
            # seen (the step stays selectable).
            self.wandb_run.define_metric("tokens")
            self.wandb_run.define_metric("*", step_metric="tokens")
        self.jsonl = open(run_dir / METRICS_FILE, "a", encoding="utf-8")
        self.tb = None
        self.tb_session_end = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))
            # Written into the run's own event file (add_hparams would start a second run
            # dir), so the hparams table lines up with this run's scalars.
            experiment, session_start, self.tb_session_end = hparams(
                flat_hparams(config), {name: 0.0 for name in metric_names}
            )
            self.tb.file_writer.add_summary(experiment)
            self.tb.file_writer.add_summary(session_start)

    def log(self, step: int, tokens: int, metrics: dict[str, float]) -> None:
        metrics = {**self.row_fields, **metrics}
        record = {"step": step, "tokens": tokens, **metrics}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            self.tb.add_scalar("tokens", tokens, global_step=step)
            for name, value in metrics.items():
                self.tb.add_scalar(name, value, global_step=step)
        if self.wandb_run is not None:
            self.wandb_run.log({"tokens": tokens, **metrics}, step=step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.file_writer.add_summary(self.tb_session_end)
            self.tb.close()
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.finish()
            # finish() only tells wandb's service process that the run is over; the service
            # closes the run's .wandb file later, and 1 close in 6 returned with only its
            # 7-byte header on disk. teardown() waits for the service to exit, so the offline
            # run is complete (ready for `wandb sync`) when the sinks are closed. The next job of
            # a multirun starts a fresh service.
            wandb.teardown()
