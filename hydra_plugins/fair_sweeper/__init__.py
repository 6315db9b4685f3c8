"""The fair study's Hydra sweeper (hydra/sweeper=fair), run by scripts/fair_compare.py."""
