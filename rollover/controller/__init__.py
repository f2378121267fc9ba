"""Controller: turns queued rollouts into running agents (local processes or Kubernetes Jobs).

`Controller` is imported lazily: agent processes start through
`rollover.controller.agent_main`, and should not pay for the controller's imports.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Controller", "ControllerConfigError"]


def __getattr__(name: str) -> Any:
    if name == "Controller":
        from rollover.controller.controller import Controller

        return Controller
    if name == "ControllerConfigError":
        from rollover.controller.runner import ControllerConfigError

        return ControllerConfigError
    raise AttributeError(f"module 'rollover.controller' has no attribute {name!r}")
