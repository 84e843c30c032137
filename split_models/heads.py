"""Local-loss heads: turn a segment's output into a loss without any later layer.

``linear`` pools and classifies (decoupled greedy learning, Belilovsky et al. 2020), ``mlp`` adds a
hidden layer (InfoPro/DGL variants), ``supcon`` projects and applies the supervised contrastive
loss (SCPL, Wang et al. 2023). The last segment of a model uses :class:`TaskLoss` instead.

For language modelling (``per_position``) the heads predict a token at every position of the
cut's ``[length, width]`` features, as the model's own output layer does, and the loss is the
mean over positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from split_models.errors import ConfigError
from split_models.options import LOCAL_LOSSES as LOCAL_LOSSES

__all__ = ["LOCAL_LOSSES", "LocalHead", "TaskLoss", "make_head", "task_cross_entropy"]

_HIDDEN = 128
_PROJECTION = 64
_TEMPERATURE = 0.1


def _pooling(feature_shape: Sequence[int]) -> tuple[nn.Module, int]:
    """Pool image features to at most 2x2 and flatten; return the module and the width."""
    if len(feature_shape) == 3:
        channels, height, width = feature_shape
        pooled = (min(height, 2), min(width, 2))
        pool = nn.Sequential(nn.AdaptiveAvgPool2d(pooled), nn.Flatten())
        return pool, channels * pooled[0] * pooled[1]
    return nn.Flatten(), math.prod(feature_shape)


class LocalHead(nn.Module):
    """An auxiliary head with its own loss, trained together with the segment below it."""

    def __init__(
        self,
        kind: str,
        feature_shape: Sequence[int],
        num_classes: int,
        per_position: bool = False,
    ) -> None:
        super().__init__()
        if kind not in LOCAL_LOSSES:
            raise ConfigError(f"local_loss: unknown kind {kind!r}; use one of {LOCAL_LOSSES}")
        self.kind, self.per_position = kind, per_position
        pool: nn.Module
        if per_position:
            if kind == "supcon" or len(feature_shape) != 2:
                raise ConfigError(
                    f"local_loss: a language model's heads predict a token per position from "
                    f"[length, width] features with kind linear or mlp; got {kind!r} on "
                    f"features {list(feature_shape)}"
                )
            pool, width = nn.Identity(), int(feature_shape[-1])
        else:
            pool, width = _pooling(feature_shape)
        layers: list[nn.Module] = [pool]
        if kind == "linear":
            layers.append(nn.Linear(width, num_classes))
        elif kind == "mlp":
            layers += [nn.Linear(width, _HIDDEN), nn.ReLU(), nn.Linear(_HIDDEN, num_classes)]
        else:
            layers += [nn.Linear(width, _HIDDEN), nn.ReLU(), nn.Linear(_HIDDEN, _PROJECTION)]
        self.net = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)  # type: ignore[no-any-return]

    def loss(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self(features)
        if self.kind == "supcon":
            return supervised_contrastive_loss(F.normalize(out, dim=1), labels)
        return task_cross_entropy(out, labels)


class TaskLoss(nn.Module):
    """The model's own loss for the last segment: cross-entropy on its logits."""

    kind = "task"

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return task_cross_entropy(logits, labels)


def task_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of logits ``[batch, classes]`` against labels ``[batch]``, or of
    ``[batch, positions, classes]`` against ``[batch, positions]`` (a token per position)."""
    if logits.dim() > 2:
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction=reduction
        )
    return F.cross_entropy(logits, labels, reduction=reduction)


def supervised_contrastive_loss(
    embeddings: torch.Tensor, labels: torch.Tensor, temperature: float = _TEMPERATURE
) -> torch.Tensor:
    """Supervised contrastive loss (Khosla et al. 2020) over L2-normalised embeddings."""
    batch = embeddings.shape[0]
    similarity = embeddings @ embeddings.T / temperature
    not_self = ~torch.eye(batch, dtype=torch.bool, device=embeddings.device)
    similarity = similarity.masked_fill(~not_self, float("-inf"))
    log_prob = similarity - torch.logsumexp(similarity, dim=1, keepdim=True)
    positives = (labels[:, None] == labels[None, :]) & not_self
    counts = positives.sum(dim=1)
    has_positive = counts > 0
    if not bool(has_positive.any()):
        return embeddings.sum() * 0.0
    summed = log_prob.masked_fill(~positives, 0.0).sum(dim=1)
    return -(summed[has_positive] / counts[has_positive]).mean()


def make_head(
    kind: str, feature_shape: Sequence[int], num_classes: int, per_position: bool = False
) -> LocalHead:
    """Build the local-loss head of ``kind`` for features of ``feature_shape`` (no batch dim);
    ``per_position``: a token prediction at every position (language modelling)."""
    return LocalHead(kind, tuple(feature_shape), num_classes, per_position)
