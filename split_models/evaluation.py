"""Evaluation of an assembled model: the coordinator's held-out set and the edges' federated
evaluation use the same function. Also the BatchNorm statistics an edge measures of an
assembled model on its own data (``norm: recalibrate``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from split_models.activations import primary
from split_models.config import ModelConfig
from split_models.data import Dataset
from split_models.errors import ConfigError
from split_models.heads import TaskLoss, task_cross_entropy
from split_models.options import OptimizerConfig
from split_models.segment import Segment
from split_models.weights import load_segment_state, segment_state

__all__ = [
    "MAX_STATISTIC_SAMPLES",
    "STATISTICS",
    "STATISTIC_BLOCKS",
    "STATISTIC_SUFFIXES",
    "batch_statistics",
    "evaluate_weights",
    "statistic_keys",
    "statistic_layers",
]

STATISTICS = "bn-statistics"  # an evaluate message's config entry: measure, do not evaluate
STATISTIC_BLOCKS = "bn-blocks"  # ... over the model's blocks [0, this)
STATISTIC_SUFFIXES = (".running_mean", ".running_var")
MAX_STATISTIC_SAMPLES = 65_536  # what a device forwards for them at most


def evaluate_weights(
    spec: ModelConfig,
    weights: Mapping[str, np.ndarray],
    data: Dataset,
    batch: int = 512,
) -> dict[str, float]:
    """Accuracy and mean cross-entropy of the assembled model (``weights`` of every block;
    local heads are ignored) on ``data``, in batches of ``batch`` without autograd. For a
    language model both are per predicted token."""
    model = spec.build(seed=0)
    whole = Segment.from_model(model, 0, model.num_blocks)
    load_segment_state(whole, weights)
    correct, loss = 0, 0.0
    for begin in range(0, len(data), batch):
        x = torch.from_numpy(data.x[begin : begin + batch])
        y = torch.from_numpy(data.y[begin : begin + batch])
        logits = primary(whole.forward(x))  # the last block returns the logits alone
        correct += int((logits.argmax(-1) == y).sum())
        loss += float(task_cross_entropy(logits, y, reduction="sum"))
    count = max(1, data.y.size)
    return {"accuracy": correct / count, "loss": loss / count}


def statistic_layers(weights: Mapping[str, np.ndarray]) -> list[str]:
    """The BatchNorm layers among ``weights`` that hold both a running mean and variance."""
    mean, var = STATISTIC_SUFFIXES
    return sorted(
        k[: -len(mean)] for k in weights if k.endswith(mean) and k[: -len(mean)] + var in weights
    )


def statistic_keys(weights: Mapping[str, np.ndarray]) -> list[str]:
    """The BatchNorm running means and variances among ``weights`` (each with its pair)."""
    return [f"{p}{suffix}" for p in statistic_layers(weights) for suffix in STATISTIC_SUFFIXES]


def batch_statistics(
    spec: ModelConfig,
    weights: Mapping[str, np.ndarray],
    data: Dataset,
    samples: int,
    seed: int,
    end: int | None = None,
) -> tuple[dict[str, np.ndarray], int]:
    """The running mean and variance every BatchNorm layer of blocks ``[0, end)`` (all:
    None) of the assembled model (``weights``, which must hold those blocks) measures over
    ``samples`` rows of ``data`` (drawn with ``seed``), in batches of 64 without autograd,
    each batch weighing the same (``momentum=None``, as ``torch.optim.swa_utils.update_bn``
    does); and how many rows that was. Averaged from devices trained apart, those statistics
    describe none of their models, only the average's own (docs/benchmarks.md, "BatchNorm
    after aggregation")."""
    model = spec.build(seed=0)
    end = model.num_blocks if end is None else end
    if not 1 <= end <= model.num_blocks:
        raise ConfigError(
            f"BatchNorm statistics of blocks [0, {end}) asked for; the model has {model.num_blocks}"
        )
    # the blocks alone, under their global names: a task-loss "head" holds no tensors
    front = Segment(model.segment(0, end), TaskLoss(), OptimizerConfig(), 0, end)
    load_segment_state(front, weights)
    front.module.eval()  # only the BatchNorm layers in training mode (no dropout)
    for norm in (
        m for m in front.module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ):
        norm.reset_running_stats()
        norm.momentum = None
        norm.train()
    rows = np.random.default_rng(seed).permutation(len(data))[:samples]
    rows.sort()  # reads in order: a memory-mapped source stays sequential
    with torch.no_grad():
        for begin in range(0, len(rows), 64):
            chosen = rows[begin : begin + 64]
            if len(chosen) > 1:  # one row has no variance (BatchNorm refuses it in training)
                front.module(torch.from_numpy(data.x[chosen]))
    state = segment_state(front)
    return {k: state[k].astype(np.float32) for k in statistic_keys(state)}, len(rows)
