"""SLURM tasks as torch ranks: the env:// variables parallel/slurm.py derives from SLURM's."""
from __future__ import annotations

import os

import pytest

from parallel.mesh import world_size_from_env
from parallel.slurm import adopt_slurm_env, first_host, tasks_on_node, torch_env_from_slurm

# Task 5 of an 8-task step over two nodes, as srun (and so the submitit launcher) sets it.
SRUN_TASK = {
    "SLURM_JOB_ID": "123456", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NODELIST": "gpu[007-008]", "SLURM_JOB_NODELIST": "gpu[007-008]",
}


def test_an_srun_task_becomes_a_rank():
    assert torch_env_from_slurm(SRUN_TASK) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
        "MASTER_ADDR": "gpu007", "MASTER_PORT": str(15000 + 123456 % 10000),
    }


def test_tasks_on_this_node_become_the_local_world_size():
    # 4 tasks on each of two nodes; task 5 runs on the second
    task = {**SRUN_TASK, "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1"}
    assert torch_env_from_slurm(task)["LOCAL_WORLD_SIZE"] == "4"
    assert tasks_on_node("4(x2),3", 2) == 3 and tasks_on_node("2,6", 1) == 6
    with pytest.raises(ValueError, match="not a list"):
        tasks_on_node("4(y2)", 0)


def test_every_task_of_a_job_agrees_on_the_rendezvous():
    peers = [torch_env_from_slurm({**SRUN_TASK, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 4)})
             for r in range(8)]
    assert {(p["MASTER_ADDR"], p["MASTER_PORT"], p["WORLD_SIZE"]) for p in peers} == {("gpu007", "18456", "8")}
    assert sorted(int(p["RANK"]) for p in peers) == list(range(8))


def test_torchrun_or_the_user_take_precedence():
    assert torch_env_from_slurm({**SRUN_TASK, "RANK": "0", "WORLD_SIZE": "2"}) == {}
    mine = torch_env_from_slurm({**SRUN_TASK, "MASTER_ADDR": "head", "MASTER_PORT": "29400"})
    assert (mine["MASTER_ADDR"], mine["MASTER_PORT"]) == ("head", "29400")


def test_no_multi_task_step_means_no_group():
    assert torch_env_from_slurm({}) == {}
    assert torch_env_from_slurm({**SRUN_TASK, "SLURM_STEP_NUM_TASKS": "1"}) == {}
    assert torch_env_from_slurm({k: v for k, v in SRUN_TASK.items() if k != "SLURM_PROCID"}) == {}
    # Without a step count, the allocation's task count is used.
    no_step = {k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert torch_env_from_slurm(no_step)["WORLD_SIZE"] == "8"


def test_bad_slurm_values_name_the_variable():
    with pytest.raises(ValueError, match="^SLURM_PROCID='x' is not an integer"):
        torch_env_from_slurm({**SRUN_TASK, "SLURM_PROCID": "x"})
    no_nodes = {k: v for k, v in SRUN_TASK.items() if "NODELIST" not in k}
    with pytest.raises(ValueError, match="^SLURM_JOB_NODELIST is not set"):
        torch_env_from_slurm(no_nodes)


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"), ("a1,b2", "a1"), ("gpu[003-005,9],cpu1", "gpu003"),
    ("gpu[10,2-3]", "gpu10"), ("rack[1-2]-n[07-08]", "rack1-n07"), ("n[0012]", "n0012"),
])
def test_first_host_of_a_slurm_host_list(nodelist, host):
    assert first_host(nodelist) == host


def test_adopt_exports_the_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        # setenv first, so monkeypatch restores even a variable that was absent.
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in SRUN_TASK.items():
        monkeypatch.setenv(key, value)
    adopt_slurm_env()
    assert world_size_from_env() == 8 and os.environ["RANK"] == "5" and os.environ["LOCAL_RANK"] == "1"


@pytest.mark.parametrize("nodelist", ["gpu[003-005,9]", "node1,node2,node3,node4", "a[1-2],b[07-08]"])
@pytest.mark.parametrize("procid, localid, nodeid", [(0, 0, 0), (5, 1, 2), (7, 1, 3)])
def test_agrees_with_submitits_helper_where_both_apply(monkeypatch, nodelist, procid, localid, nodeid):
    """Inside a job that submitit launched with equal tasks per node, submitit's
    TorchDistributedEnvironment and ours give the same rank, world, local rank, local world
    and rendezvous host. Ours is kept because submitit's only works inside submitit-launched
    jobs (not a plain `srun python train.py`), reads the allocation's task count rather than
    the step's, and assumes the same task count on every node."""
    helpers = pytest.importorskip("submitit.helpers")
    env = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "1234", "SLURM_NTASKS": "8",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_NODEID": str(nodeid), "SLURM_JOB_NODELIST": nodelist,
           "SLURM_PROCID": str(procid), "SLURM_LOCALID": str(localid), "SLURM_TASKS_PER_NODE": "2(x4)"}
    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_")) or key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                              "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    theirs = helpers.TorchDistributedEnvironment()
    ours = torch_env_from_slurm(env)
    assert (int(ours["RANK"]), int(ours["WORLD_SIZE"]), int(ours["LOCAL_RANK"]), int(ours["LOCAL_WORLD_SIZE"])) == (
        theirs.rank, theirs.world_size, theirs.local_rank, theirs.local_world_size)
    assert ours["MASTER_ADDR"] == theirs.master_addr
