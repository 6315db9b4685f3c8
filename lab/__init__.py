"""The lab notebook: dated measurements and study records (the .md pages and results/), and the
lab's tooling (tools/: benchmarks and the GPU check harness). Tooling may import anything, the
test harness included; no product package imports lab/."""
