"""The split core: splittable models, profiling, memory estimates, local-loss segments, ONNX,
and datasets with their client partitions."""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from split_models.autosplit import split_point
    from split_models.data import PARTITIONS, Dataset, load_dataset, partition
    from split_models.errors import ConfigError, InfeasiblePlanError, ModelError, SplitError
    from split_models.heads import LocalHead, TaskLoss, make_head
    from split_models.memory import MemoryEstimate, estimate_segment_memory, segment_memory_table
    from split_models.options import LOCAL_LOSSES, OPTIMIZERS, ZOO_NAMES, OptimizerConfig
    from split_models.profiler import BlockProfile, ModelProfile, profile_model, profile_module
    from split_models.segment import Segment, StepResult
    from split_models.units import format_bytes, parse_bandwidth, parse_flops, parse_memory
    from split_models.zoo import SplittableModel, build_model

# Imported on first use (PEP 562): most of these load torch (1-2 s), which commands that only
# read a store or a config (``edgesplit status``, ``runs``) never need; names with a torch-free
# home (split_models.options) come from there.
_WHERE = {
    "BlockProfile": "split_models.profiler",
    "ConfigError": "split_models.errors",
    "Dataset": "split_models.data",
    "InfeasiblePlanError": "split_models.errors",
    "LOCAL_LOSSES": "split_models.options",
    "LocalHead": "split_models.heads",
    "MemoryEstimate": "split_models.memory",
    "ModelError": "split_models.errors",
    "ModelProfile": "split_models.profiler",
    "OPTIMIZERS": "split_models.options",
    "OptimizerConfig": "split_models.options",
    "PARTITIONS": "split_models.data",
    "Segment": "split_models.segment",
    "SplitError": "split_models.errors",
    "SplittableModel": "split_models.zoo",
    "StepResult": "split_models.segment",
    "TaskLoss": "split_models.heads",
    "ZOO_NAMES": "split_models.options",
    "build_model": "split_models.zoo",
    "estimate_segment_memory": "split_models.memory",
    "format_bytes": "split_models.units",
    "load_dataset": "split_models.data",
    "make_head": "split_models.heads",
    "parse_bandwidth": "split_models.units",
    "parse_flops": "split_models.units",
    "parse_memory": "split_models.units",
    "partition": "split_models.data",
    "profile_model": "split_models.profiler",
    "profile_module": "split_models.profiler",
    "segment_memory_table": "split_models.memory",
    "split_point": "split_models.autosplit",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'split_models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
