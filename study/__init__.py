"""The fair Muon-vs-AdamW study (scripts/fair_compare.py is its command), in the order a study
runs: checks.py and plan.py (what it will run, checked before anything trains), runs.py (one
run's overrides and steps), driver.py (the process that lives for the study: --out, the lock,
stopping and resuming), runner.py (the stages, through a launch callable that Hydra's launchers
fill: hydra_plugins/fair_sweeper), coordinate_descent.py over search_space.py and
space_config.py (the tuner), records.py (what is committed, checked as it is read), progress.py
(run k of N and the time left), speedup.py (the statistics), report.py and ladder.py (one
study's report; a ladder of them), rerun.py (a study's choice run again), estimate.py (the dry
run's time).

It sits above trainer/ (it composes and checks runs as train.py does) and below hydra_plugins/
and scripts/; it imports neither, nor tests/.
"""
