"""Lab tooling: the benchmarks (bench/, each a command recording into lab/BENCHMARKS.md) and the
GPU check harness (gpu/: `make check-gpu`, `make bench-gpu`, `make compare-gpu`). Not part of the
product: scripts/ holds the commands users run."""
