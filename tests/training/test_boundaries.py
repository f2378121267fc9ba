"""`rollover/training/` depends on protocols and wire types, never on the parts that carry
them out: those are wired together in `rollover/launch.py` only. The gateway's clients import
no web server."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import rollover

TRAINING = Path(rollover.__file__).parent / "training"
FORBIDDEN = (
    "rollover.engine",
    "rollover.controller",
    "rollover.launch",
    "rollover.gateway.server",
    "rollover.gateway.app",
    "rollover.gateway.proxy",
    "rollover.gateway.streamed",
    "rollover.gateway.calls",
    "rollover.gateway.apis",
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


# The gateway's clients, and what each part that talks to it imports: none needs the server.
GATEWAY_CLIENTS = (
    "rollover.gateway.client",
    "rollover.training.trainer",
    "rollover.controller.controller",
    "rollover.controller.agent_env",
    "rollover.engine.vllm_engine",
    "rollover.engine.watchdog",
    "rollover.agent",
)


@pytest.mark.parametrize("module", GATEWAY_CLIENTS)
def test_gateway_clients_import_no_web_server(module: str) -> None:
    """Importing `gateway.client` (or a part that uses it) loads neither FastAPI nor uvicorn:
    `rollover.gateway` re-exports nothing of the server."""
    probe = f"import sys, {module}; print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]", f"importing {module} loads {loaded}"
