"""Controller: turns queued rollouts into running agents (local processes or Kubernetes Jobs).

`Controller` is imported lazily: agent processes start through
`rollover.controller.agent_main`, and should not pay for the controller's imports.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Controller", "ControllerConfigError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rollover.controller import controller

        return getattr(controller, name)
    raise AttributeError(f"module 'rollover.controller' has no attribute {name!r}")
