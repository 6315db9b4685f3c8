"""The GPU check (`make check-gpu`) and the runs it makes: its steps, logs, report and the fair study's choice rerun in bf16."""
