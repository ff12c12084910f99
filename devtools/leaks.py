"""A pytest plugin that finds psycopg connections left open: where each was opened, and which test left it.

Such a connection is closed by the garbage collector, in whichever test happens to be
running then (pytest reports it there, as ``PytestUnraisableExceptionWarning``). This
collects after every test, so a leak shows at the teardown of the test that left
it, and prints the stack that opened it:

    python -m devtools.services run -- python -m pytest -q -s -p devtools.leaks tests/
"""

from __future__ import annotations

import gc
import traceback
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

_opened_at: dict[int, str] = {}
_connect = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]
_delete = psycopg.Connection.__del__


def _recording_connect(cls: type[psycopg.Connection[Any]], *args: Any, **kwargs: Any) -> psycopg.Connection[Any]:
    connection = _connect(cls, *args, **kwargs)
    _opened_at[id(connection)] = "".join(traceback.format_stack(limit=30)[:-1])
    return connection  # type: ignore[no-any-return]


def _reporting_del(self: psycopg.Connection[Any], *args: Any) -> None:
    if hasattr(self, "pgconn") and not self.closed:
        print(f"\npsycopg connection left open, opened at:\n{_opened_at.get(id(self), '(not recorded)')}", flush=True)
    _opened_at.pop(id(self), None)
    _delete(self, *args)


psycopg.Connection.connect = classmethod(_recording_connect)  # type: ignore[assignment, method-assign]
psycopg.Connection.__del__ = _reporting_del  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def _collect_after_each_test() -> Iterator[None]:
    yield
    gc.collect()
