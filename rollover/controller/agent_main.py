"""Entry point of one agent process: `python -m rollover.controller.agent_main pkg.mod:Class`
(or Agent Lightning's `pkg.mod.Class`).

The local runner starts this in a fresh process group with the agent env contract set; a
Kubernetes Job template can use it as the container command too. The class is instantiated
with no arguments and its `run()` is called (with the rollout's input when `run` takes a
parameter); `async def run` is driven by `asyncio.run`. Returning normally exits 0, which
the controller reports as SUCCEEDED; an exception prints its traceback and exits 1.

Keep the imports light: every agent start pays for them (asyncio alone is ~30 ms).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Awaitable
from typing import Any

CLASS_ENV = "AGL_AGENT_CLASS"
# Set by the local runner's spawn path: the agent dies with the controller that started it.
PARENT_PID_ENV = "ROLLOVER_PARENT_PID"


class AgentClassError(ValueError):
    """The agent class spec does not name an importable class with a `run()` method."""


def _import_dotted(spec: str) -> tuple[Any, str, str]:
    """Agent Lightning's `pkg.module.Class`: the longest importable module prefix, then attributes."""
    parts = spec.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            return importlib.import_module(module_name), module_name, ".".join(parts[cut:])
        except ModuleNotFoundError as exc:
            # Only "this prefix is not a module" moves on; a module that imports something
            # missing is the agent's error and is reported as such.
            if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise
    raise ModuleNotFoundError(f"no module named {parts[0]!r}", name=parts[0])


def load_agent_class(spec: str) -> type:
    """`pkg.module:Class` (Rollover) or `pkg.module.Class` (Agent Lightning) -> the class."""
    module_name, sep, attr_path = spec.partition(":")
    if sep and not (module_name and attr_path):
        raise AgentClassError(f"{spec!r} must look like 'pkg.module:Class' or 'pkg.module.Class'")
    if not sep and "." not in spec.strip("."):
        raise AgentClassError(f"{spec!r} must look like 'pkg.module:Class' or 'pkg.module.Class'")
    try:
        if sep:
            target: Any = importlib.import_module(module_name)
        else:
            target, module_name, attr_path = _import_dotted(spec)
    except Exception as exc:  # an agent module may fail to import in any way
        raise AgentClassError(f"cannot import module {module_name!r} of {spec!r}: {exc!r}") from exc
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise AgentClassError(f"module {module_name!r} has no attribute {attr_path!r}") from None
    if not inspect.isclass(target):
        raise AgentClassError(f"{spec!r} is a {type(target).__name__}, not a class")
    if not callable(getattr(target, "run", None)):
        raise AgentClassError(f"{spec!r} has no run() method")
    return target


def _takes_argument(method: Any) -> bool:
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    )
    return any(p.kind in positional for p in parameters)


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def run_agent(spec: str) -> None:
    agent = load_agent_class(spec)()
    args: tuple[Any, ...] = ()
    if _takes_argument(agent.run):
        args = (json.loads(os.environ.get("AGL_ROLLOUT_INPUT") or "null"),)
    result = agent.run(*args)
    if inspect.isawaitable(result):
        import asyncio  # only async agents pay for it

        asyncio.run(_await(result))


def main(argv: list[str] | None = None) -> int:
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent:
        from rollover.processes import exit_if_orphaned

        exit_if_orphaned(int(parent))
    argv = sys.argv[1:] if argv is None else argv
    spec = argv[0] if argv else os.environ.get(CLASS_ENV, "")
    if not spec:
        print(
            f"usage: python -m rollover.controller.agent_main pkg.module:Class|pkg.module.Class (or set {CLASS_ENV})",
            file=sys.stderr,
        )
        return 2
    run_agent(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
