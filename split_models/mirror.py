"""Local heads that start each round as the model's own back: ``training.head_from_back``.

An edge cut just before the model's classifier (the cnn's block 5 is ``Linear(128, 10)``, and
so is its ``linear`` head at cut 5) trains its blocks with a head that begins every round as
the back's current classifier: the coordinator sends the back's weights under the head's
names. A head of the edge's own would begin from the average of the deep edges' heads, fitted
to those edges' classes under label skew; the back's classifier is trained by the GPU servers
on every edge's batches, so the features the edge learns stay readable by it (FedBABU, Oh et
al. 2022, keeps a shared classifier for federated clients for the same reason; frozen, it was
as good with Adam and worse with SGD momentum here). What such an edge trained of its head
is a replica of the classifier: the coordinator averages it into the back's (the strategy's
``mirrors``). Measured in docs/benchmarks.md, "A head from the back" and "The trained heads
as replicas of the classifier".

:func:`mirrored_head` decides by running both: the head, given the back's weights, must
compute what blocks ``[cut, n)`` compute, on the features the front produces.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Collection, Mapping

import numpy as np
import torch

from split_models.activations import primary
from split_models.config import ModelConfig, TrainingConfig
from split_models.randomness import apart
from split_models.segment import Segment
from split_models.zoo import SplittableModel

__all__ = ["head_mirrors", "mirrored_head", "with_mirrored_heads"]

log = logging.getLogger(__name__)
_FOUND: dict[tuple[ModelConfig, str, int], dict[str, str]] = {}  # (model, loss, cut) -> names


def mirrored_head(model: SplittableModel, cut: int, local_loss: str) -> dict[str, str]:
    """The global name of each tensor of the head at ``cut`` mapped to the back's tensor it
    is, when the head with the back's weights computes exactly what blocks ``[cut, n)``
    compute; empty otherwise (the last block, a head of another shape or kind, buffers such
    as BatchNorm's, tensors crossing the cut beside the activation)."""
    if not 0 < cut < model.num_blocks or local_loss == "supcon":
        return {}
    with apart():  # apart from a simulation's training threads
        torch.manual_seed(0)
        return _mirrored(model, cut, local_loss)


def _mirrored(model: SplittableModel, cut: int, local_loss: str) -> dict[str, str]:
    front = Segment.from_model(model, 0, cut, local_loss)
    back = Segment.from_model(model, cut, model.num_blocks)
    if front.side_outputs or any(True for _ in (*front.head.buffers(), *back.module.buffers())):
        return {}
    head, rest = front.head.state_dict(), back.module.state_dict()
    pairs = list(zip(head.items(), rest.items(), strict=False))
    if len(head) != len(rest) or any(
        h.shape != r.shape or h.dtype != r.dtype for (_, h), (_, r) in pairs
    ):
        return {}
    probe = copy.deepcopy(front.head).eval()
    probe.load_state_dict({name: tensor for (name, _), (_, tensor) in pairs})
    with torch.no_grad():
        features = primary(front.forward(model.example_input(4)))
        expected = primary(back.forward(features))
        if not torch.allclose(probe(features), expected, rtol=1e-5, atol=1e-6):
            return {}
    return {
        f"head{cut}.{name}": f"block{cut + int(index)}.{rest_name}"
        for (name, _), (key, _) in pairs
        for index, _, rest_name in [key.partition(".")]
    }


def with_mirrored_heads(
    chosen: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray], mirror: Mapping[str, str]
) -> dict[str, np.ndarray]:
    """``chosen`` (a device's tensors) with each mirrored head tensor replaced by the back's
    tensor in ``weights`` that it mirrors (the head's own, if the back's is missing)."""
    return {k: weights.get(mirror[k], v) if k in mirror else v for k, v in chosen.items()}


def head_mirrors(
    model: ModelConfig, training: TrainingConfig, cuts: Collection[int]
) -> dict[int, dict[str, str]]:
    """The edges' ``cuts`` whose local head is the model's back (``training.head_from_back``,
    local-loss mode only), each with :func:`mirrored_head`'s names; decided once per model,
    local loss and cut in a process (building the model for it takes a coordinator
    milliseconds to seconds)."""
    if not training.head_from_back or training.mode != "local-loss":
        return {}
    keys = {cut: (model, training.local_loss, cut) for cut in cuts}
    if any(key not in _FOUND for key in keys.values()):
        built = model.build(seed=training.seed)
        for cut, key in keys.items():
            if key not in _FOUND:
                _FOUND[key] = _mirrored_or_none(built, cut, training.local_loss)
    return {cut: _FOUND[key] for cut, key in keys.items() if _FOUND[key]}


def _mirrored_or_none(model: SplittableModel, cut: int, local_loss: str) -> dict[str, str]:
    """:func:`mirrored_head`, or none (logged) when probing the model fails: the head of the
    edge's own is what the run would train without the option, not a reason to stop it."""
    try:
        return mirrored_head(model, cut, local_loss)
    except Exception as error:  # a model's own code may raise anything
        log.warning(
            "head_from_back: cut %d keeps a head of its own (probing failed: %s)", cut, error
        )
        return {}
