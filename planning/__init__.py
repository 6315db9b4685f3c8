"""Planners: what a layout will cost before it runs. Per-rank memory (memory_plan.py), the
layouts too large to plan (layout_limits.py), designs for a cluster (scale_plan.py, with the
collective cost model of collectives.py) and pipeline schedules (pipeline_plan.py). Arithmetic
on model configs and layouts: nothing here builds a model to train it."""
