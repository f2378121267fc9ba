"""What one gateway process runs with: its section plus the few keys of others it needs."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollover.config.base import ConfigError, Temperature
from rollover.config.gateway import GatewayConfig
from rollover.config.root import RolloverConfig


class GatewaySettings(BaseModel):
    """What one gateway process runs with, handed to it whole: the `gateway` section, the two
    temperatures the proxy forces (under `actor_rollout_ref.rollout`) and the response cap."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gateway: GatewayConfig = Field(description="the `gateway` section")
    train_temperature: Temperature = Field(description="actor_rollout_ref.rollout.temperature")
    val_temperature: Temperature = Field(
        description="actor_rollout_ref.rollout.val_kwargs.temperature (0 when its do_sample is false: greedy)"
    )
    max_response_tokens: int | None = Field(
        default=None, gt=0, description="data.max_response_length: a call's response is capped here (null = no cap)"
    )
    max_n: int = Field(default=1, gt=0, description="gateway.max_n, or actor_rollout_ref.rollout.n where that is null")
    partial_rollout: bool = Field(
        default=False,
        description="agentlightning.async_rollout.partial_rollout: calls are streamed from the engine and each token's version recorded",
    )
    instance: str | None = Field(
        default=None,
        description="a token /healthz answers with: whoever started this gateway knows the server on the port is it",
    )

    @classmethod
    def from_config(cls, config: RolloverConfig | None = None, **gateway: Any) -> GatewaySettings:
        """The settings of `config` (default: the defaults); `gateway` replaces keys of its
        `gateway` section (e.g. `admin_key="k", max_body_bytes=1000`); raises `ConfigError`."""
        config = config or RolloverConfig()
        rollout = config.actor_rollout_ref.rollout
        settings = cls(
            gateway=config.gateway.model_copy(),
            train_temperature=rollout.temperature,
            val_temperature=rollout.val_kwargs.effective_temperature,
            max_response_tokens=config.data.max_response_length,
            max_n=config.gateway.max_n or rollout.n,
            partial_rollout=config.agentlightning.async_rollout.partial_rollout,
        )
        return settings.with_gateway(**gateway)

    def with_gateway(self, **gateway: Any) -> GatewaySettings:
        """A copy with keys of the `gateway` section replaced, validated; raises `ConfigError`."""
        if not gateway:
            return self
        try:
            section = GatewayConfig.model_validate(self.gateway.model_dump() | gateway)
        except ValidationError as exc:
            raise ConfigError.from_validation(exc, "gateway") from None
        update: dict[str, Any] = {"gateway": section}
        if section.max_n is not None:
            update["max_n"] = section.max_n
        return self.model_copy(update=update)
