"""Lua scripts kept in ``.lua`` files beside the module that runs them, as Dramatiq keeps ``dispatch.lua``."""

from __future__ import annotations

from pathlib import Path


def scripts(module_file: str) -> dict[str, str]:
    """The scripts of a module: ``<dir>/<module>/<name>.lua`` for ``<dir>/<module>.py``, by name."""
    folder = Path(module_file).with_suffix("")
    return {path.stem: path.read_text() for path in sorted(folder.glob("*.lua"))}
