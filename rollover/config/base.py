"""What every config section shares: the error type, the strict base model, key naming."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails


class ConfigError(ValueError):
    """A bad configuration value; the message names the dotted key."""

    @classmethod
    def from_validation(cls, exc: ValidationError, section: str = "") -> ConfigError:
        """One line naming each bad key; `section` prefixes the keys of a section's model."""
        return cls("; ".join(describe(error, section) for error in exc.errors()))


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated, and no number
    is infinite or NaN (an `inf` learning rate or temperature would break the run later)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


Temperature = Annotated[float, Field(ge=0.0)]


def describe(error: ErrorDetails, section: str = "") -> str:
    """One pydantic error as a line naming the dotted key."""
    key = ".".join(str(part) for part in ((section,) if section else ()) + tuple(error["loc"]))
    if not error["loc"]:  # a rule across sections: its message names the keys itself
        return str(error.get("ctx", {}).get("error", error["msg"]))
    if error["type"] == "extra_forbidden":
        return f"unknown config key '{key}'"
    got = error.get("input")
    return f"config key '{key}': {error['msg']} (got {got!r})"
