"""`rollover/training/` depends on protocols and wire types, never on the parts that carry
them out: those are wired together in `rollover/launch.py` only."""

from __future__ import annotations

import ast
from pathlib import Path

import rollover

TRAINING = Path(rollover.__file__).parent / "training"
FORBIDDEN = (
    "rollover.engine",
    "rollover.controller",
    "rollover.launch",
    "rollover.gateway.server",
    "rollover.gateway.app",
    "rollover.gateway.proxy",
)


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_training_imports_no_engine_gateway_server_or_controller() -> None:
    files = sorted(TRAINING.rglob("*.py"))
    assert files
    found = {
        f"{path.relative_to(TRAINING.parent)}: {name}"
        for path in files
        for name in imported_modules(path)
        if any(name == bad or name.startswith(bad + ".") for bad in FORBIDDEN)
    }
    assert not found, sorted(found)
