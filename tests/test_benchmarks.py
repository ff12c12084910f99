"""The benchmark modules still import: they are run by hand, so the suite is what notices an API they lost."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.__main__ import BENCHMARKS


@pytest.mark.parametrize(
    "name", [*BENCHMARKS, "outbox_child", "outbox_common", "overhead_worker", "soak_tables", "stored_schedules"]
)
def test_the_benchmark_module_imports(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__doc__
