"""The fair study's Hydra sweeper (hydra/sweeper=fair): a thin adapter that hands study/runner.py
Hydra's launcher; scripts/fair_compare.py starts it."""
