"""What the controller and its runners share: one attempt to launch, how it ended, and the
protocols a runner (local processes, Kubernetes Jobs) implements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from rollover.config import ConfigError
from rollover.store.models import Rollout


class ControllerConfigError(ConfigError):
    """A controller setting that cannot work; the message names the config key."""


class LaunchError(Exception):
    """An attempt that cannot start. `permanent` ones fail the rollout without a retry,
    because another attempt would fail the same way (a missing input path, a bad class)."""

    def __init__(self, reason: str, *, permanent: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent


@dataclass(frozen=True)
class Outcome:
    succeeded: bool
    reason: str | None = None
    permanent: bool = False


@dataclass(frozen=True)
class LaunchSpec:
    """One attempt to launch. `env` is the agent env contract (it wins over everything);
    `defaults` are the standard variables unchanged harnesses read (`harness_env`), below the
    user's own variables (`local.env`, a Job template's container env)."""

    rollout: Rollout
    attempt_id: str
    env: dict[str, str]
    timeout_seconds: float
    defaults: dict[str, str] = field(default_factory=dict)

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id


class Execution(Protocol):
    """One running attempt on a runner."""

    @property
    def job_name(self) -> str | None:
        """The Kubernetes Job that runs it, if any."""
        ...

    async def wait(self) -> Outcome:
        """Until the agent ends on its own."""
        ...

    async def kill(self) -> None:
        """Stop the agent and everything it started; idempotent."""
        ...


class Runner(Protocol):
    @property
    def agent_gateway_url(self) -> str | None:
        """The gateway's URL as agents reach it (a pod's route, the sandbox's bridge); None:
        the controller's own."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def claim_budget(self, horizon_seconds: float) -> int:
        """How many new attempts could start within `horizon_seconds`."""
        ...

    async def launch(self, spec: LaunchSpec) -> Execution: ...

    async def extend_deadline(self, execution: Execution, seconds: float) -> None:
        """Push a runner-side deadline (a Job's activeDeadlineSeconds) out by paused time."""
        ...
