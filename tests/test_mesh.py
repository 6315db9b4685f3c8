"""The device mesh: layouts from parallel.*, the groups one named DeviceMesh gives, and the
collectives outside the step's arithmetic going through the counted layer."""
from __future__ import annotations

import pytest
import torch

from parallel.mesh import MESH_DIMS, Layout, resolve_layout
from tests.distributed import run_distributed
from tests.prestarted import run_python


@pytest.mark.parametrize("world, keys, layout", [
    (1, {}, Layout(1, 1, 1)),
    (8, {}, Layout(8, 1, 1)),  # the default: ZeRO-1 over every rank
    (8, {"tp": 2}, Layout(4, 1, 2)),
    (8, {"tp": 2, "dp_replicate": 2, "dp_shard": -1}, Layout(2, 2, 2)),
    (8, {"tp": 4, "dp_replicate": 2}, Layout(2, 1, 4)),
    (6, {"dp_replicate": 1, "dp_shard": -1}, Layout(1, 6, 1)),
])
def test_minus_one_is_the_rest_of_the_world(world, keys, layout):
    got = resolve_layout(world, **keys)
    assert got == layout and got.world_size == world and got.dp == layout.dp_replicate * layout.dp_shard
    assert got.shape == (1, layout.dp_replicate, layout.dp_shard, layout.tp)  # pp 1 outermost


@pytest.mark.parametrize("world, keys, line", [
    (4, {"tp": 3}, "parallel.dp_replicate=-1 x parallel.dp_shard=1 x parallel.tp=3 does not multiply out to "
                   "4 processes (the number torchrun started)"),
    (1, {"tp": 2}, "parallel.dp_replicate=-1 x parallel.dp_shard=1 x parallel.tp=2 does not multiply out to "
                   "a single process (started without torchrun): start 2 processes (torchrun --nproc_per_node=2 "
                   "train.py ...)"),
    (8, {"tp": 2, "dp_replicate": 2}, "parallel.dp_replicate=2 x parallel.dp_shard=1 x parallel.tp=2 does not "
                                      "multiply out to 8 processes (the number torchrun started)"),
    (8, {"dp_replicate": -1, "dp_shard": -1}, "parallel.dp_replicate=-1 and parallel.dp_shard=-1: at most one "
                                              "size can be the rest of the world"),
    (4, {"tp": 0}, "parallel.tp=0 must be a positive number of ranks, or -1 for the rest of the world"),
    (4, {"dp_shard": -2}, "parallel.dp_shard=-2 must be a positive number of ranks, or -1 for the rest of the world"),
    (4, {"tp": -1}, "parallel.tp=-1: TP needs an explicit size (-1, the rest of the world, is for the "
                    "parallel.dp_* keys)"),
    (8, {"tp": 2, "ep": 3}, "parallel.ep=3 does not divide the 4 data-parallel ranks (parallel.dp_replicate x "
                            "parallel.dp_shard on 8 processes (the number torchrun started))"),
    (8, {"dp_shard": 4, "ep": 3}, "parallel.ep=3 does not divide parallel.dp_shard=4 (under FSDP2 the experts are "
                                  "spread over the ranks that shard the parameters)"),
    (4, {"ep": 0}, "parallel.ep=0 must be a positive number of ranks"),
])
def test_a_layout_that_does_not_fit_is_one_line_naming_the_keys(world, keys, line):
    with pytest.raises(ValueError) as err:
        resolve_layout(world, **keys)
    assert str(err.value) == line


@pytest.mark.parametrize("args, line", [
    (["parallel.tp=2"], "error: parallel.dp_replicate=-1 x parallel.dp_shard=1 x parallel.tp=2 does not multiply "
                        "out to a single process (started without torchrun): start 2 processes (torchrun "
                        "--nproc_per_node=2 train.py ...)"),
    (["parallel.dp_shard=0"], "error: parallel.dp_shard must be >= 1, got 0"),
    (["parallel.dp_shard=-1"], "error: parallel.dp_replicate=-1 and parallel.dp_shard=-1: at most one size can be "
                               "the rest of the world"),
    (["parallel.ep=2"], "error: parallel.ep=2 does not divide the 1 data-parallel ranks (parallel.dp_replicate x "
                        "parallel.dp_shard on a single process (started without torchrun))"),
])
def test_train_py_stops_a_bad_layout_at_start_up(tmp_path, args, line):
    proc = run_python(["train.py", f"hydra.run.dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}",
                       "logger.wandb.mode=disabled", "trainer.device=cpu", *args], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [line]
    assert not (tmp_path / "cache").exists()  # before any data work


def _mesh_worker(rank: int, world_size: int, tp: int) -> dict:
    import torch.distributed as dist

    from parallel import comm
    from parallel.mesh import build_mesh, mesh_groups, release_subgroups

    mesh = build_mesh(tp)
    out = {
        "dims": mesh.device_mesh.mesh_dim_names,
        "shape": tuple(mesh.device_mesh.shape),
        "tp_ranks": dist.get_process_group_ranks(mesh.tp_group),
        "dp_ranks": dist.get_process_group_ranks(mesh.dp_group),
        "labels": (comm.group_label(mesh.tp_group), comm.group_label(mesh.dp_group)),
        "coords": (mesh.dp_rank, mesh.tp_rank),
    }
    # The collectives outside the step's arithmetic, counted under their purpose.
    comm.COUNTER.reset()
    gathered = comm.all_gather_object({"rank": rank}, comm.world(), "setup")
    chosen = comm.broadcast_object("rank 0's" if rank == 0 else None, 0, comm.world(), "checkpoint")
    flag = comm.broadcast(torch.tensor([float(rank + 7)]), 0, comm.world(), "setup")
    comm.barrier(comm.world(), "checkpoint")
    out["objects"] = (gathered, chosen, flag.item())
    out["counted"] = {k: v for k, v in comm.COUNTER.metrics().items() if k.endswith("_calls")}
    out["flag_bytes"] = comm.COUNTER.bytes[("setup", "broadcast")]
    groups = mesh_groups(mesh)
    release_subgroups(mesh)
    # Every group the mesh made is gone; the default group stays for the next job of a sweep.
    out["released"] = all(g not in dist.distributed_c10d._world.pg_map for g in groups)
    out["world_alive"] = dist.is_initialized()
    return out


def test_one_named_mesh_gives_contiguous_tp_and_strided_dp_groups():
    results = run_distributed(_mesh_worker, 4, 2)
    for rank, r in enumerate(results):
        assert r["dims"] == MESH_DIMS == ("pp", "dp_replicate", "dp_shard", "tp")
        assert r["shape"] == (1, 2, 1, 2)  # pp 1 outermost
        assert r["tp_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]  # contiguous: one node
        assert r["dp_ranks"] == [rank % 2, rank % 2 + 2]  # strided across nodes
        assert r["labels"] == ("tp", "dp")
        assert r["coords"] == (rank // 2, rank % 2)
        assert r["objects"] == ([{"rank": i} for i in range(4)], "rank 0's", 7.0)
        assert r["counted"] == {
            "comm/setup/all_gather_object_calls": 1.0, "comm/checkpoint/broadcast_object_calls": 1.0,
            "comm/setup/broadcast_calls": 1.0, "comm/checkpoint/barrier_calls": 1.0,
        }
        assert r["flag_bytes"] == 4
        assert r["released"] and r["world_alive"]


def _ep_mesh(rank: int, world_size: int) -> dict:
    """Rank `rank`'s EP groups of an 8-rank dp 4 (ep 2 x edp 2) x tp 2 mesh, built by build_mesh
    over fake process groups: the groups and their ranks are the real ones (what init_mesh
    builds over gloo or NCCL is the same DeviceMesh code over another backend), without eight
    processes on two cores to show it."""
    import torch.distributed as dist

    from parallel import comm
    from parallel.mesh import destroy_mesh, init_simulated_mesh

    mesh = init_simulated_mesh({"tp": 2, "ep": 2}, world_size, rank, torch.device("cpu"))
    try:
        return {"ep_ranks": dist.get_process_group_ranks(mesh.ep_group),
                "edp_ranks": dist.get_process_group_ranks(mesh.edp_group),
                "labels": (comm.group_label(mesh.ep_group), comm.group_label(mesh.edp_group)),
                "ep_rank": mesh.ep_rank, "describe": mesh.layout.describe()}
    finally:
        destroy_mesh()


def test_expert_parallel_groups_are_consecutive_data_parallel_ranks():
    """parallel.ep unflattens the data-parallel ranks into (edp, ep), EP innermost: an EP group
    is ep consecutive DP ranks at one TP rank (neighbours, so the all-to-all stays close), and
    an edp group the ranks that hold the same experts."""
    results = [_ep_mesh(rank, 8) for rank in range(8)]
    for rank, r in enumerate(results):
        dp_rank, tp_rank = rank // 2, rank % 2
        first = dp_rank // 2 * 2  # the EP group's first DP rank
        assert r["ep_ranks"] == [first * 2 + tp_rank, (first + 1) * 2 + tp_rank]
        assert r["edp_ranks"] == [(dp_rank % 2) * 2 + tp_rank, (dp_rank % 2 + 2) * 2 + tp_rank]
        assert r["ep_rank"] == dp_rank % 2
        assert r["labels"] == ("ep", "edp")
        assert r["describe"] == "dp_replicate 4 x dp_shard 1 x tp 2, ep 2 over the data-parallel ranks"


def _label_worker(rank: int, world_size: int) -> tuple[str, str, int]:
    import gc

    import torch.distributed as dist

    from parallel import comm

    group = dist.new_group(list(range(world_size)))
    comm.label_group(group, "tp")
    said = comm.group_label(group)
    dist.barrier(group)  # both ranks have the group whole before one frees it (tests/distributed.py)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    fresh = dist.new_group(list(range(world_size)))
    return said, comm.group_label(fresh), len(comm._labels)


def test_a_freed_group_takes_its_label_with_it():
    """Labels were keyed by id(group): a group made after another was freed could sit at its
    address and be counted under its label (a reused rank counted a world all-to-all as "tp")."""
    said, fresh, left = run_distributed(_label_worker, 2)[0]
    assert (said, fresh, left) == ("tp", "world", 0)
