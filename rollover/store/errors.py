"""What the store refuses, each with the HTTP status the gateway answers it with."""

from __future__ import annotations


class StoreError(Exception):
    status_code = 400


class RolloutNotFound(StoreError):
    status_code = 404


class AttemptNotFound(StoreError):
    status_code = 404


class IllegalTransition(StoreError):
    status_code = 409


class InvalidValue(StoreError):
    """A value that cannot be stored as standard JSON (see `rollover.codec`)."""

    status_code = 422
