"""Front ends of the planners (planning/): scale designs, pipeline layouts, memory estimates, one-rank dry runs, link calibration."""
