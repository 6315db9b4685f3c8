"""A run's plumbing around the training loop: the checks before it starts (preflight.py), its
dir's lock and kind (lock.py, kind.py), launching ranks (launch.py), signals and preemption
(interrupts.py, preemption.py), its environment record (environment.py), metric sinks
(sinks.py) and the progress line (progress.py)."""
