"""Typed configuration: one module per top-level section (the file name is the key's first
part), the rules across them in `root`, loading in `load`, and the verl / Agent Lightning
keys that load but cannot apply here, declared once, in `no_effect`.

The pydantic models are the one place a key, its default and its one-line description live;
`rollover/configs/default.yaml` is generated from them (`rollover.config_yaml`, `rollover
config defaults`; a test fails when the shipped file is stale). Keys follow the seed document,
and verl where verl has a name.
"""

from rollover.config.actor_rollout_ref import (
    ActorConfig,
    ActorRolloutRefConfig,
    KLType,
    LossAggMode,
    ModelConfig,
    RolloutConfig,
    ScheduleKind,
)
from rollover.config.agentlightning import (
    AgentLightningConfig,
    AsyncRolloutConfig,
    K8sRunnerConfig,
    LocalRunnerConfig,
    is_class_spec,
)
from rollover.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from rollover.config.base import ConfigError
from rollover.config.data import DataConfig
from rollover.config.gateway import GatewayConfig
from rollover.config.load import dump_config, load_config, redacted, validate_config
from rollover.config.no_effect import NO_EFFECT, no_effect_notes
from rollover.config.root import RolloverConfig
from rollover.config.settings import GatewaySettings
from rollover.config.trainer import TrainerConfig

__all__ = [
    "NO_EFFECT",
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AgentLightningConfig",
    "AlgorithmConfig",
    "AsyncRolloutConfig",
    "ConfigError",
    "DataConfig",
    "GatewayConfig",
    "GatewaySettings",
    "K8sRunnerConfig",
    "KLType",
    "LocalRunnerConfig",
    "LossAggMode",
    "ModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RolloverConfig",
    "ScheduleKind",
    "TrainerConfig",
    "dump_config",
    "redacted",
    "is_class_spec",
    "load_config",
    "no_effect_notes",
    "validate_config",
]
