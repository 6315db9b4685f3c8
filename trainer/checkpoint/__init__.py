"""Checkpoints: saving and finding them across ranks (store.py), their files and digests
(files.py), the sharded layout (shards.py), what a trainer's state is (state.py), which one is
worth keeping step by step (keeper.py) and what a resume changes (resume_checks.py)."""
