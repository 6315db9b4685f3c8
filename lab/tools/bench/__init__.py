"""Benchmarks: each prints a table to paste into lab/BENCHMARKS.md, with its command, machine and date."""
