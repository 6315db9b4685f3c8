"""The fair comparison's parts (scripts/fair_compare.py is its command): plan, rerun, report, ladder."""
