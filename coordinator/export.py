"""``edgesplit export``: a run's trained model, and each device's segment, as checked ONNX,
and the model's weights as a PyTorch state dict.

The weights come from a committed round of the run store: every segment of its checkpoint
carries tensors under their global names (``block<k>.*``, ``head<cut>.*``), which are merged and
loaded into the model built from the run's configuration. Local-loss heads are not exported.
Each file is run through onnxruntime against torch on a sample batch. Beside the model's file,
``<name>.safetensors`` holds its state dict under the model's own names, for
``model.load_state_dict`` (:func:`state_dict_of`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import fx

from coordinator.planner import stored_plan
from coordinator.recorder import LOCAL_PREFIX
from coordinator.resumption import code_change, stored_code
from split_models.config import ModelConfig, stored_section
from split_models.errors import ConfigError
from split_models.fingerprint import model_fingerprint
from split_models.onnx_export import export_checked
from split_models.segment import Segment
from split_models.weights import load_segment_state
from split_models.zoo import SplittableModel
from storage.base import RunStore
from storage.errors import NotFoundError
from storage.records import RoundRecord

__all__ = ["TOLERANCE", "ExportResult", "export_run", "state_dict_of"]

TOLERANCE = 1e-4
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExportResult:
    name: str
    blocks: tuple[int, int]
    path: Path
    max_abs_diff: float
    exporter: str = ""  # split_models.onnx_export.EXPORTERS

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= TOLERANCE


def _export(segment: Segment, name: str, spec: ModelConfig, out: Path) -> ExportResult:
    shape, ids = spec.input_shape, spec.input_range
    check = export_checked(segment.module, shape, out / f"{name}.onnx", ids, TOLERANCE)
    return ExportResult(
        name, (segment.start, segment.end), check.path, check.max_abs_diff, check.exporter
    )


def _check_code(
    store: RunStore, trained: RoundRecord, model: SplittableModel, allow_change: bool
) -> None:
    """Refuse (unless ``allow_change``) a model whose code changed since ``trained``."""
    stored = stored_code(store, trained.run_id, trained.committed_at)
    if (what := code_change(stored, model_fingerprint(model.blocks))) is None:
        return
    round_of = f"round {trained.number} of run {trained.run_id!r}"
    if not allow_change:
        raise ConfigError(
            f"{round_of} was trained with other model code: {what}; export with the code it "
            "was trained with, or pass --allow-model-change to export this code with its weights"
        )
    log.warning("%s: %s; exporting this code", round_of, what)


def _split_local(
    segments: dict[str, dict[str, np.ndarray]],
) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """A checkpoint's shared tensors, merged, and each device's own (FedBN's BatchNorm)."""
    weights: dict[str, np.ndarray] = {}
    local: dict[str, dict[str, np.ndarray]] = {}
    for name, tensors in segments.items():
        if name.startswith(LOCAL_PREFIX):
            local[name.removeprefix(LOCAL_PREFIX)] = tensors
        else:
            weights.update(tensors)
    return weights, local


def export_run(
    store: RunStore,
    run_id: str,
    out: Path,
    round_number: int | None = None,
    per_device: bool = False,
    allow_model_change: bool = False,
) -> list[ExportResult]:
    """Export the model of ``round_number`` (default: the last committed) into ``out``; with
    ``per_device``, each edge's segment too (with ``norm: local``, with its own BatchNorm
    layers; the whole model holds their average). ``allow_model_change``: see _check_code."""
    run = store.get_run(run_id)
    number = run.current_round if round_number is None else round_number
    if number is None:
        raise ConfigError(f"run {run_id!r} has no committed round to export")
    try:
        state = store.checkpoint(run_id, number)
    except NotFoundError as error:
        held = [r.number for r in store.list_rounds(run_id) if r.state == "committed"]
        raise NotFoundError(f"{error}; its committed rounds: {_rounds(held)}") from None
    weights, local = _split_local(state.weights)
    spec = stored_section(ModelConfig, run.config, f"run {run_id!r}'s stored config")
    model = spec.build(seed=run.seed)  # the layers nobody trained as the run built them
    _check_code(store, state.round, model, allow_model_change)
    whole = Segment.from_model(model, 0, model.num_blocks)
    load_segment_state(whole, weights)
    plan = stored_plan(run) if per_device else None
    if per_device and (plan is None or not plan.edges):  # before any file is written
        raise ConfigError(
            f"--per-device: run {run_id!r} has no stored plan, so no device segments (a "
            "fedavg or centralized run trains the whole model); export without it"
        )
    _say_if_replanned_since(store, run_id, number, per_device)
    results = [_export(whole, f"{run_id}-round{number}-model", spec, out)]  # makes ``out``
    save_file(state_dict_of(model), str(results[0].path.with_suffix(".safetensors")))
    if plan is not None:
        done: dict[int, ExportResult] = {}  # by end block: devices of one cut share a file
        for edge in plan.edges:
            name, end = f"{run_id}-round{number}-{edge.name}", edge.blocks[1]
            if not local and end in done:  # the same segment, the same weights: a copy
                path = shutil.copyfile(done[end].path, out / f"{name}.onnx")
                results.append(dataclasses.replace(done[end], name=name, path=path))
                continue
            segment = Segment.from_model(model, 0, end)  # shares the weights
            if local:  # the device's model: with norm: local, its own normalization layers
                load_segment_state(whole, weights | local.get(edge.name, {}))
            result = _export(segment, name, spec, out)  # its own, checked on its own
            done.setdefault(end, result)
            results.append(result)
    return results


def state_dict_of(model: SplittableModel) -> dict[str, torch.Tensor]:
    """The trained model's state dict under its own names: a traced model's blocks hold its
    modules under their names in it (``features.0.weight``), so ``MyNet().load_state_dict``
    takes it as it is; a model given in blocks (the zoo's, an ``nn.Sequential``, a list) is
    keyed as an ``nn.Sequential`` of them (``0.weight``). Parameters and buffers that forward
    never uses belong to no block: they come as the model was built (with the run's seed),
    so a strict load takes the file. Buffers the model does not save (``persistent=False``)
    are left out, as its own state dict leaves them."""
    traced = all(isinstance(block, fx.GraphModule) for block in model.blocks)
    state: dict[str, torch.Tensor] = {}
    for index, block in enumerate(model.blocks):
        for name, value in block.state_dict().items():
            state[name if traced else f"{index}.{name}"] = value.detach().clone().contiguous()
    for name, value in model.unused.items() if traced else ():
        state.setdefault(name, value.detach().clone().contiguous())
    if traced and model.saved:
        state = {name: value for name, value in state.items() if name in model.saved}
    return state


def _rounds(numbers: list[int]) -> str:
    """``1-3, 5`` of the round numbers (none: "none")."""
    spans: list[list[int]] = []
    for n in sorted(numbers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans) or "none"


def _say_if_replanned_since(store: RunStore, run_id: str, number: int, per_device: bool) -> None:
    """The device segments (``per_device``) follow the stored plan, the run's latest: a warning
    when a re-plan came after round ``number``, whose devices were cut otherwise (only the
    latest plan is stored)."""
    if not per_device:
        return
    replans = [e.round for e in store.events(run_id) if e.kind == "replanned" and e.round]
    if replans and number <= max(replans):
        log.warning(
            "the device segments follow the run's latest plan, made after round %d; round %d "
            "trained with an earlier one, whose cuts 'edgesplit runs events %s' lists "
            "(replanned): a segment may hold blocks its device did not train then",
            max(replans),
            number,
            run_id,
        )
