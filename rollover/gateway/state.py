"""What one gateway holds: its store, settings, pause state, engine registry and forwarder."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollover.config import GatewaySettings
from rollover.gateway.pause import ProxyPauseState
from rollover.gateway.proxy import Forwarder
from rollover.gateway.registry import ModelRegistry
from rollover.store.models import ModelEndpoint
from rollover.store.sqlite import RolloutStore

PAUSE_STATE_KEY, MODELS_STATE_KEY = "pause", "models"  # rows of the store's gateway_state
log = logging.getLogger("rollover.gateway")


@dataclass
class GatewayState:
    """Everything the gateway holds; owned by the app (no module-level state)."""

    store: RolloutStore
    settings: GatewaySettings
    pause: ProxyPauseState = field(init=False)
    registry: ModelRegistry = field(default_factory=ModelRegistry)
    forwarder: Forwarder = field(init=False)
    # Per "api.field": calls whose request carried a field the engine cannot honour (accepted,
    # not passed on: `gateway.apis`), since the gateway started.
    unhonoured: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if not self.settings.gateway.admin_key:
            raise ValueError("gateway.admin_key must be set to serve (generate one with keys.new_admin_key())")
        self.pause = ProxyPauseState(self.settings.gateway.retry_after_seconds)
        self.forwarder = Forwarder(self.store, self.registry, self.settings, self.save_models)
        # A gateway started on an existing store (a restart after a crash) comes back as the
        # last one left it: paused if it was, with the engines it knew.
        saved_pause = self.store.gateway_state(PAUSE_STATE_KEY)
        if isinstance(saved_pause, dict):
            self.pause.restore(saved_pause)
        saved_models = self.store.gateway_state(MODELS_STATE_KEY)
        if isinstance(saved_models, list):
            # An engine left frozen for a weight load is still: calls to it wait for its thaw.
            self.forwarder.registered(self.registry.upsert([ModelEndpoint.model_validate(m) for m in saved_models]))

    def note_unhonoured(self, api: str, fields: Iterable[str]) -> None:
        """Count a call's unhonoured fields; each is logged the first time it is seen."""
        for name in fields:
            key = f"{api}.{name}"
            if key not in self.unhonoured:
                log.warning("%s: accepted but not honoured (the engine cannot), never passed on", key)
            self.unhonoured[key] += 1

    async def save_pause(self) -> None:
        await self.store.save_gateway_state(PAUSE_STATE_KEY, self.pause.record())

    async def save_models(self) -> None:
        await self.store.save_gateway_state(MODELS_STATE_KEY, [e.model_dump() for e in self.registry.endpoints])

    @property
    def admin_key(self) -> str:
        key = self.settings.gateway.admin_key
        assert key is not None  # checked at construction
        return key

    @property
    def retry_after_seconds(self) -> float:
        return self.settings.gateway.retry_after_seconds
