"""Simulating a large layout on one machine: one rank of it for real (one_rank.py), or a whole
step under FakeTensor (memory_estimate.py, with the GPU stand-ins of gpu_stand_ins.py)."""
