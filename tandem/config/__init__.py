"""The typed run configuration: one pydantic model per section, validated once at load.

A YAML file plus ``key.sub=value`` overrides becomes a :class:`Config`. Anything wrong (a missing file,
bad YAML, an unknown key, a wrong type, an out-of-range value) raises :class:`ConfigError` naming the
field path and the reason, before any process starts (docs/design.md §7, after prime-rl's config package).
Every field carries a one-line description; ``python -m tandem config-doc`` prints them all. The sections
live by role: ``run`` (identity, Redis, checkpoints, data, logging, supervision, prepare steps),
``rollout`` (servers, HTTP, environments, agents, rewards, evaluation), ``algorithm`` (the recipes),
``learner`` (learner, LoRA, weight sync), ``placement`` (placement, Ray cluster); ``root`` joins them
into :class:`Config`, ``checks`` holds its checks across sections, ``loading`` reads and validates a
file, ``redaction`` writes one out, ``doc`` describes every field. Import every name from here.
"""

from tandem.config.algorithm import (
    OFFLINE_RECIPES,
    Algorithm,
    AlgorithmConfig,
    DPOConfig,
    OfflineConfig,
    PPOConfig,
    RMConfig,
    SFTConfig,
)
from tandem.config.algorithm import RECIPES as RECIPE_CONFIGS
from tandem.config.base import ConfigError, Section, SectionCheckError
from tandem.config.doc import describe_fields, markdown_table
from tandem.config.learner import AdapterRun, LearnerConfig, LoRAConfig, WeightSyncConfig
from tandem.config.loading import apply_overrides, format_validation_error, load_config
from tandem.config.placement import RUNNABLE_PLACEMENT, ClusterConfig, PlacementConfig
from tandem.config.redaction import (
    REDACTED,
    dump_config,
    dump_public_config,
    public_dict,
    redact,
    write_private,
)
from tandem.config.rollout import (
    AgentConfig,
    EnvConfig,
    EvalConfig,
    HTTPConfig,
    RewardConfig,
    RewardFunction,
    RolloutConfig,
    ServerConfig,
    SGLangConfig,
    VLLMConfig,
)
from tandem.config.root import Config, adapter_run_dir
from tandem.config.run import (
    DataConfig,
    LoggingConfig,
    ModelConfig,
    PrepareStep,
    RedisConfig,
    RunConfig,
    SupervisionConfig,
)

__all__ = [
    "OFFLINE_RECIPES",
    "RECIPE_CONFIGS",
    "REDACTED",
    "RUNNABLE_PLACEMENT",
    "AdapterRun",
    "AgentConfig",
    "Algorithm",
    "AlgorithmConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "DPOConfig",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "HTTPConfig",
    "LearnerConfig",
    "LoRAConfig",
    "LoggingConfig",
    "ModelConfig",
    "OfflineConfig",
    "PPOConfig",
    "PlacementConfig",
    "PrepareStep",
    "RMConfig",
    "RedisConfig",
    "RewardConfig",
    "RewardFunction",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "SGLangConfig",
    "Section",
    "SectionCheckError",
    "ServerConfig",
    "SupervisionConfig",
    "VLLMConfig",
    "WeightSyncConfig",
    "adapter_run_dir",
    "apply_overrides",
    "describe_fields",
    "dump_config",
    "dump_public_config",
    "format_validation_error",
    "load_config",
    "markdown_table",
    "public_dict",
    "redact",
    "write_private",
]
