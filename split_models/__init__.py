"""The split core: splittable models, profiling, memory estimates, local-loss segments, ONNX."""

from split_models.errors import ConfigError, InfeasiblePlanError, ModelError, SplitError
from split_models.heads import LOCAL_LOSSES, LocalHead, TaskLoss, make_head
from split_models.memory import MemoryEstimate, estimate_segment_memory, segment_memory_table
from split_models.profiler import BlockProfile, ModelProfile, profile_model, profile_module
from split_models.segment import OPTIMIZERS, OptimizerConfig, Segment, StepResult
from split_models.units import format_bytes, parse_bandwidth, parse_flops, parse_memory
from split_models.zoo import ZOO_NAMES, SplittableModel, build_model

__all__ = [
    "LOCAL_LOSSES",
    "OPTIMIZERS",
    "ZOO_NAMES",
    "BlockProfile",
    "ConfigError",
    "InfeasiblePlanError",
    "LocalHead",
    "MemoryEstimate",
    "ModelError",
    "ModelProfile",
    "OptimizerConfig",
    "Segment",
    "SplitError",
    "SplittableModel",
    "StepResult",
    "TaskLoss",
    "build_model",
    "estimate_segment_memory",
    "format_bytes",
    "make_head",
    "parse_bandwidth",
    "parse_flops",
    "parse_memory",
    "profile_model",
    "profile_module",
    "segment_memory_table",
]
