"""The house drawn from the package's imports: ``python -m devtools.imports`` fails on a circle or an upward arrow.

Every ``import`` of a ``dramatiq_gp`` module counts, wherever it is written: at the
top, inside a function, or under ``TYPE_CHECKING``. A module may import one in its
own layer or below (:data:`LAYERS`, bottom first), never one above, and no chain
of imports may come back to where it started. ``make test`` runs it (``make lint``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "dramatiq_gp"

#: The layers, bottom first: each a name and the modules in it (a package stands for everything under it).
LAYERS: list[tuple[str, list[str]]] = [
    (
        "foundation",
        [
            "errors",
            "names",
            "keys",
            "durations",
            "lua",
            "records",
            "tracecontext",
            "metrics",
            "groupdir",
            "endpoint",
            "health",
            "prometheus",
            "settings",
            "aio",
            "errortext",
            "telemetry",
        ],
    ),
    ("brokers", ["brokers"]),
    ("events and the outbox", ["events", "outbox", "exactly_once"]),
    ("fan-out", ["subscriptions", "registry"]),
    ("scheduler", ["scheduler"]),
    ("middleware", ["middleware"]),
    ("kit", ["kit", ""]),
    ("operator tools", ["status", "actions", "dashboard", "exporter", "generate", "cli", "__main__"]),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path) -> dict[str, set[str]]:
    """Each module of the package, and the package's modules it imports."""
    modules = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # ``from . import keys`` imports the module keys; ``from .keys import x`` the module too.
                found.update(f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {target for target in found if target in modules and target != name}
    return graph


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``: the layer of its longest listed prefix."""
    relative = module.removeprefix(PACKAGE).removeprefix(".")
    best, best_length = -1, -1
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            matches = relative == member or (member and relative.startswith(member + "."))
            if matches and len(member) > best_length:
                best, best_length = index, len(member)
    if best < 0:
        raise SystemExit(f"devtools.imports: {module} is in no layer: add it to LAYERS")
    return best


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def problems(root: Path) -> list[str]:
    graph = imports(root)
    lines = [f"circle: {' <-> '.join(group)}" for group in circles(graph)]
    for source in sorted(graph):
        for target in sorted(graph[source]):
            if layer(target) > layer(source):
                lines.append(
                    f"upward: {source} ({LAYERS[layer(source)][0]}) imports {target} ({LAYERS[layer(target)][0]})"
                )
    return lines


def main() -> int:
    root = Path(__file__).resolve().parent.parent / PACKAGE
    found = problems(root)
    for line in found:
        print(f"devtools.imports: {line}", file=sys.stderr)
    if not found:
        print(f"devtools.imports: {len(imports(root))} modules, 0 circles, 0 upward imports")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
