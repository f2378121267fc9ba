"""The rollout store: rollouts, attempts and events (SQLite WAL by default)."""

from rollover.store.models import (
    Attempt,
    Event,
    EventCreate,
    ModelEndpoint,
    Rollout,
    RolloutCreate,
    RolloutState,
    RolloutStatus,
    StatusFields,
    Triplet,
    TripletBundle,
)
from rollover.store.sqlite import (
    AttemptNotFound,
    IllegalTransition,
    RolloutNotFound,
    RolloutStore,
    StoreError,
)

__all__ = [
    "Attempt",
    "AttemptNotFound",
    "Event",
    "EventCreate",
    "IllegalTransition",
    "ModelEndpoint",
    "Rollout",
    "RolloutCreate",
    "RolloutNotFound",
    "RolloutState",
    "RolloutStatus",
    "RolloutStore",
    "StatusFields",
    "StoreError",
    "Triplet",
    "TripletBundle",
]
