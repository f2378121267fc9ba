"""The Agent Lightning peer: agentlightning==1.0.2 in its own Python 3.12 venv, made by
`scripts/setup.sh --dev` (or `--agl`) at `.venv-agl`; ROLLOVER_AGL_VENV names another one.

It is used as a black box: its programs are run, its pydantic schemas validate what Rollover
answers, its package data (the default YAML) is read where a user would read it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
AGL_VERSION = "1.0.2"


def agl_venv() -> Path | None:
    for candidate in (os.environ.get("ROLLOVER_AGL_VENV"), REPO / ".venv-agl"):
        if candidate and (Path(candidate) / "bin" / "python").exists():
            return Path(candidate)
    return None


@pytest.fixture(scope="session")
def agl_python() -> Path:
    venv = agl_venv()
    if venv is None:
        pytest.skip("the Agent Lightning peer venv is missing: run scripts/setup.sh --agl (or set ROLLOVER_AGL_VENV)")
    python = venv / "bin" / "python"
    version = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('agentlightning'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert version == AGL_VERSION, f"{venv} has agentlightning {version}, the peer tests need {AGL_VERSION}"
    return python


@pytest.fixture(scope="session")
def agl_package_dir(agl_python: Path) -> Path:
    out = subprocess.run(
        [str(agl_python), "-c", "import agentlightning, os; print(os.path.dirname(agentlightning.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def agl_validate(agl_python: Path, schema: str, payload: object, many: bool = False) -> None:
    """Validate `payload` with Agent Lightning's own `agentlightning.schemas.<schema>`."""
    script = (
        "import json, sys\n"
        "from pydantic import TypeAdapter\n"
        "import agentlightning.schemas as s\n"
        f"model = getattr(s, {schema!r})\n"
        f"TypeAdapter(list[model] if {many!r} else model).validate_python(json.load(sys.stdin))\n"
    )
    result = subprocess.run(
        [str(agl_python), "-c", script], input=json.dumps(payload), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"not a valid agentlightning.schemas.{schema}: {result.stderr[-3000:]}"


def agl_run(agl_python: Path, script: str, payload: object = None, *args: str) -> Any:
    """Run `script` with the peer's Python, `payload` as JSON on its stdin and `args` as its
    arguments; the JSON it prints last (it fails the test if the script fails)."""
    result = subprocess.run(
        [str(agl_python), "-c", script, *args], input=json.dumps(payload), capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"the Agent Lightning peer refused it: {result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])
