"""The shop under load and faults (see ``benchmarks/soak.py``): nothing lost, nothing applied twice.

Run with ``make chaos`` (``CHAOS_MINUTES``, default 2); not part of the default test run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.soak import Soak

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(0)
def test_the_shop_keeps_every_promise_through_faults(tmp_path: Path) -> None:
    minutes = float(os.environ.get("CHAOS_MINUTES", "2"))
    result = Soak(minutes, rate=10, work=tmp_path).run()
    assert result["faults_injected"] >= 7, result
    assert result["orders"] > 0, result
    assert (result["lost"], result["duplicate_effects"]) == (0, 0), result
    # Workers killed between an inbox commit and the ack: each left a copy that the inbox skipped.
    assert result["kills_after_commit"] >= 1, result
    assert result["inbox_duplicates_prevented"] >= result["kills_after_commit"], result
    assert set(result["ticks"]) == {"soak.tick", "soak.beat"}, result  # the job and the event entry both ran
    assert (result["ticks_missed"], result["ticks_duplicated"]) == (0, 0), result
    assert (result["stuck_messages"], result["outbox_pending"], result["dead_letters"]) == (0, 0, 0), result
    assert result["dead_letters_missing"] == 0, result  # every garbage and unknown-type message set aside
    assert result["set_aside"] == result["poison_events"], result
    assert result["unknown_task_skipped"] == result["unknown_task_messages"], result  # dead-lettered, counted
