"""Record finished runs for committing: what compare_runs.py reads, in a few tens of KB a run.

    python scripts/record_runs.py outputs/reference/adamw outputs/reference/muon --into lab/results/runs/dense
    python scripts/compare_runs.py lab/results/runs/dense/adamw lab/results/runs/dense/muon

Each SOURCE is a run dir or a sweep dir; every run below it goes to INTO/<SOURCE's name>/<its
path below SOURCE>, with its metrics.jsonl gzipped (the same bytes once decompressed), its
Hydra config and overrides, resolved_config.yaml and environment.json. compare_runs.py reads a
record as it reads the run dir, so the published figures can be made again after the run dirs
are gone. Unfinished runs, runs without a config, and records already there with other contents
(without --replace) are refused in one line before anything is written; runs already recorded
byte for byte are skipped, so a sweep can be recorded again as it finishes; --skip-unfinished
leaves out its runs still going instead of refusing them (eval/run_records.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from eval.run_records import RecordError, plan_records, write_record
from scripts.refuse import refuse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", type=Path, help="run dirs or sweep dirs")
    parser.add_argument("--into", type=Path, required=True, help="the folder the records go to")
    parser.add_argument("--replace", action="store_true", help="overwrite records that already exist")
    parser.add_argument("--skip-unfinished", action="store_true",
                        help="leave out runs still going (record the sweep again when they finish)")
    args = parser.parse_args()
    try:
        planned = plan_records(args.sources, args.into, args.replace, args.skip_unfinished)
    except (RecordError, FileNotFoundError) as err:
        refuse(str(err))
    for p in planned:
        record = write_record(p.run_dir, p.record_dir)
        size = sum(f.stat().st_size for f in record.rglob("*") if f.is_file())
        print(f"recorded {p.run_dir} -> {record} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
