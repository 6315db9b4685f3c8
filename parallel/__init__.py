"""Everything that knows about parallelism: the device mesh (mesh.py), the counted collectives
(comm.py), tensor-parallel autograd functions and layers (tp_ops.py, tp_layers.py), FSDP2
(fsdp.py) and SLURM ranks (slurm.py).

It sits at the bottom of the import graph: it imports torch and the standard library, never
another package of this project (tests/test_imports.py checks that). Models decide how they are
split (model/parallelize.py), optimizers how they step shards (optim/), on top of it.
"""
