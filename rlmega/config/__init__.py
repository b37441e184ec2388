"""Typed RL configs: dataclass schema, YAML + dotlist loading, validation at load time."""
from rlmega.config.load import dump_config, load_config
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

__all__ = [
    "RLConfig", "ActorConfig", "ClusterConfig", "ParallelismConfig", "ModelConfig", "OptimizerConfig",
    "RolloutConfig", "AlgorithmConfig", "RewardConfig", "DataConfig", "TrainerConfig", "LoggingConfig",
    "ConfigError", "load_config", "dump_config", "validate", "VLLM_CPU_HEAD_SIZES",
]
