"""Benchmarks: ``python -m benchmarks <name> [--json]``. Each compares against a baseline in the same run."""
