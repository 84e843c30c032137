"""The split core: splittable models, profiling, memory estimates, local-loss segments, ONNX,
and datasets with their client partitions."""

from split_models.autosplit import split_point
from split_models.data import PARTITIONS, Dataset, load_dataset, partition
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
    "PARTITIONS",
    "ZOO_NAMES",
    "BlockProfile",
    "ConfigError",
    "Dataset",
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
    "load_dataset",
    "make_head",
    "parse_bandwidth",
    "parse_flops",
    "parse_memory",
    "partition",
    "profile_model",
    "profile_module",
    "segment_memory_table",
    "split_point",
]
