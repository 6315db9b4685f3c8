"""What building the model costs at start-up: peak host memory and wall time of build_model.

    python lab/tools/bench/bench_startup.py                       # gpt_1b, vocab 8192, new build only
    python lab/tools/bench/bench_startup.py --old                 # and the old build, side by side
    python lab/tools/bench/bench_startup.py --model gpt_small --vocab 50304 --dp-shard 8 --old

Each measurement is a fresh process (so its peak RSS, /proc/self/status VmHWM, is the build's
own) that builds the model on the CPU: (a) as a single process, (b) as rank 0 of a dp_shard N
job over fake process groups (parallel.mesh.init_simulated_mesh: the real shapes and sharding,
collectives that move nothing). "new" is trainer/build.py's build_model: built on the meta
device, sharded there, then each rank draws one logical parameter at a time and keeps its
part. "old" (--old) is how it was built before, reproduced here: the whole model initialised
on the host, then sharded. Reported: the build's wall time, the process's peak RSS and its
RSS just before the build (imports, mesh), this rank's parameter bytes and the largest single
parameter's: the new build's peak should exceed the baseline by about the rank's share plus
one largest parameter; the old one's by the whole model.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from scripts import REPO

GB = 1024**3


def rss_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS: now, VmHWM: the peak so far), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def old_build(cfg, vocab_size: int, mesh, device: torch.device):
    """The build before meta-device construction: the whole model on the host on every rank,
    then this rank's TP / EP part cut out of it and FSDP2 applied to that."""
    from model.gpt import GPT
    from model.moe import moe_layers
    from model.parallelize import parallelize_moe, parallelize_tp
    from parallel.fsdp import apply_fsdp, fsdp_mesh
    from trainer.config import reshard_after_forward

    torch.manual_seed(cfg.seed)
    model = parallelize_tp(GPT(replace(cfg.model, vocab_size=vocab_size)), mesh.tp_group, split_experts=mesh.ep == 1)
    model = parallelize_moe(model, mesh.ep_group, mesh.tp_group, mesh.dp_group).to(device)
    if mesh.layout.dp_shard > 1:
        experts = [layer.experts for _, layer in moe_layers(model)] if mesh.ep > 1 else []
        apply_fsdp(model, model.blocks, fsdp_mesh(mesh.device_mesh), None, reshard_after_forward(cfg.parallel),
                   experts, fsdp_mesh(mesh.expert_mesh, "expert_shard") if experts else None)
    return model


def measure(path: str, model_name: str, vocab: int, dp_shard: int) -> dict:
    """One build in this process; its figures."""
    from hydra import compose, initialize_config_dir

    from model.gpt import GPT
    from parallel.mesh import destroy_mesh, init_simulated_mesh, single_process_mesh
    from trainer.build import build_model
    from trainer.config import register_configs, to_dataclass

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = to_dataclass(compose(config_name="config", overrides=[f"model={model_name}", "trainer.precision=fp32"]))
    device = torch.device("cpu")
    if dp_shard > 1:
        keys = {"tp": 1, "dp_replicate": -1, "dp_shard": dp_shard, "ep": 1}
        mesh = init_simulated_mesh(keys, dp_shard, 0, device)
    else:
        mesh = single_process_mesh()
    with torch.device("meta"):
        sizes = [p.numel() * 4 for p in GPT(replace(cfg.model, vocab_size=vocab)).parameters()]
    before = rss_bytes("VmRSS")
    start = time.perf_counter()
    model = (old_build if path == "old" else build_model)(cfg, vocab, mesh, device)
    seconds = time.perf_counter() - start
    peak = rss_bytes("VmHWM")
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    del model
    destroy_mesh()
    return dict(path=path, dp_shard=dp_shard, seconds=seconds, peak=peak, before=before, local=local,
                largest=max(sizes), whole=sum(sizes))


def run_child(path: str, model_name: str, vocab: int, dp_shard: int, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", path, "--model", model_name, "--vocab", str(vocab),
           "--dp-shard", str(dp_shard)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{path} build at dp_shard {dp_shard} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt_1b", help="a conf/model preset")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size (the tokenizer's, in a run)")
    ap.add_argument("--dp-shard", type=int, default=4, help="(b): rank 0 of this many FSDP2 ranks")
    ap.add_argument("--old", action="store_true", help="also measure the old build (whole model on the host)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per build")
    ap.add_argument("--child", choices=("new", "old"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.model, args.vocab, args.dp_shard)))
        return
    if args.dp_shard < 2:
        ap.error("--dp-shard must be at least 2 (the single process is always measured)")
    rows = []
    for dp_shard in (1, args.dp_shard):
        for path in ("new", "old") if args.old else ("new",):
            row = run_child(path, args.model, args.vocab, dp_shard, args.timeout)
            print(f"  {path} dp_shard {dp_shard}: {row['seconds']:.1f} s", file=sys.stderr, flush=True)
            rows.append(row)
    whole = rows[0]["whole"]
    print(f"{args.model}, vocab {args.vocab}: {whole / 4 / 1e9:.3f} B parameters, {whole / GB:.2f} GiB fp32; "
          f"largest parameter {rows[0]['largest'] / GB:.3f} GiB; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| build | layout | build s | peak RSS GiB | RSS before GiB | peak - before GiB | rank's params GiB "
          "| largest param GiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        layout = "single process" if r["dp_shard"] == 1 else f"rank 0 of dp_shard {r['dp_shard']}"
        print(f"| {r['path']} | {layout} | {r['seconds']:.1f} | {r['peak'] / GB:.2f} | {r['before'] / GB:.2f} | "
              f"{(r['peak'] - r['before']) / GB:.2f} | {r['local'] / GB:.2f} | {r['largest'] / GB:.3f} |")


if __name__ == "__main__":
    main()
