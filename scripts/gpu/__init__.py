"""The GPU check (`make check-gpu`) and the runs it makes: its steps, logs, report and the bf16 reference comparison."""
