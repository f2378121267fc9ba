"""The rollout store: rollouts, attempts and events (SQLite WAL by default)."""

from rollover.store.errors import AttemptNotFound, IllegalTransition, RolloutNotFound, StoreError
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
from rollover.store.sqlite import RolloutStore

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
