"""Typed RL configs: dataclass schema, YAML + dotlist loading, validation at load time.

``load_config`` and ``dump_config`` (omegaconf, YAML) are imported when first asked for: the driver reads the
config, but the trainer ranks and engines only use its dataclasses and rules, and each would otherwise
import omegaconf and its grammar for nothing (issue 55: workers import only what their role uses).
"""

from rlmega.config.schema import (
    ActorConfig,
    ClusterConfig,
    AlgorithmConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    RewardConfig,
    RLConfig,
    RolloutConfig,
    TrainerConfig,
)
from rlmega.config.validate import VLLM_CPU_HEAD_SIZES, ConfigError, validate


def __getattr__(name: str):
    if name in ("load_config", "dump_config"):
        from rlmega.config import load

        return getattr(load, name)
    raise AttributeError(f"module 'rlmega.config' has no attribute {name!r}")


__all__ = [
    "RLConfig",
    "ActorConfig",
    "ClusterConfig",
    "ParallelismConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RolloutConfig",
    "AlgorithmConfig",
    "RewardConfig",
    "DataConfig",
    "TrainerConfig",
    "LoggingConfig",
    "ConfigError",
    "load_config",
    "dump_config",
    "validate",
    "VLLM_CPU_HEAD_SIZES",
]
