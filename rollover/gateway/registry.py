"""The inference endpoints the proxy sends calls to, and which one a rollout sticks to."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

from rollover.store.models import ModelEndpoint

_MASK64 = (1 << 64) - 1


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big")


@functools.lru_cache(maxsize=4096)
def _endpoint_seed(endpoint: str) -> int:
    return _hash64(endpoint)


def _weight(rollout_hash: int, endpoint: str) -> int:
    """An endpoint's weight for a rollout: splitmix64's finaliser over the two hashes (every
    input bit reaches every output bit), one sha1 per call instead of one per endpoint."""
    x = rollout_hash ^ _endpoint_seed(endpoint)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass
class ModelRegistry:
    """The inference endpoints, by URL. Entries are replaced, never changed in place: a caller
    holding one can tell whether it is still the registered one (`take_out`)."""

    endpoints: list[ModelEndpoint] = field(default_factory=list)

    def upsert(self, items: list[ModelEndpoint]) -> list[tuple[ModelEndpoint | None, ModelEndpoint]]:
        """Register or replace endpoints; each new entry with the one it replaced (None: new)."""
        by_endpoint = {e.endpoint: e for e in self.endpoints}
        changes = []
        for item in items:
            changes.append((by_endpoint.get(item.endpoint), item))
            by_endpoint[item.endpoint] = item
        self.endpoints = list(by_endpoint.values())
        return changes

    def version_of(self, endpoint: str, default: int) -> int:
        """The policy version `endpoint` serves now (`default` if it is no longer registered)."""
        return next((e.policy_version for e in self.endpoints if e.endpoint == endpoint), default)

    def remove(self, endpoint: str) -> None:
        self.endpoints = [e for e in self.endpoints if e.endpoint != endpoint]

    def clear(self) -> None:
        self.endpoints = []

    def set_live(self, endpoint: str, live: bool) -> ModelEndpoint | None:
        """Put an endpoint in rotation or take it out; None if it is not registered."""
        for i, entry in enumerate(self.endpoints):
            if entry.endpoint == endpoint:
                if entry.live != live:
                    self.endpoints[i] = entry = entry.model_copy(update={"live": live})
                return entry
        return None

    def take_out(self, target: ModelEndpoint) -> bool:
        """Take `target` out of rotation if it is still the registered entry for its URL (an
        engine that registered again since is left alone) and another endpoint is live; True
        if it was."""
        if not target.live or not any(e.live and e is not target for e in self.endpoints):
            return False
        for i, entry in enumerate(self.endpoints):
            if entry is target:
                self.endpoints[i] = entry.model_copy(update={"live": False})
                return True
        return False

    def pick(self, rollout_id: str) -> ModelEndpoint | None:
        """Sticky per rollout (a multi-turn agent keeps hitting the same engine's prefix cache),
        by rendezvous hashing over the live endpoints: the one of highest weight for the rollout.
        An endpoint leaving moves only the rollouts it had; one joining takes ~1/N of them."""
        live = [e for e in self.endpoints if e.live]
        if len(live) <= 1:
            return live[0] if live else None
        rollout_hash = _hash64(rollout_id)
        return max(live, key=lambda e: _weight(rollout_hash, e.endpoint))
