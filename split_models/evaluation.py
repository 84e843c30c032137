"""Evaluation of an assembled model: the coordinator's held-out set and the edges' federated
evaluation use the same function."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from split_models.activations import primary
from split_models.config import ModelConfig
from split_models.data import Dataset
from split_models.heads import task_cross_entropy
from split_models.segment import Segment
from split_models.weights import load_segment_state

__all__ = ["evaluate_weights"]


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
