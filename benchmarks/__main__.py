"""``python -m benchmarks <name> [options]``; ``--json`` makes the last stdout line one JSON object."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("overhead", "relay", "latency", "scheduler", "queues", "priority", "soak", "dashboard", "idempotency")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m benchmarks {{{','.join(BENCHMARKS)}}} [--json] [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{argv[0]}")
    return int(module.main(argv[1:]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
