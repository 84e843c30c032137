"""ONNX export of a segment or a whole model (local heads removed), checked with onnxruntime.

Export uses torch's default (dynamo) exporter with a dynamic batch dimension. onnxruntime runs
with one thread and spinning disabled, so it does not fight torch's threads for the cores.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from split_models.activations import Activation, primary, side, wire_names
from split_models.errors import ModelError
from split_models.zoo import example_input

__all__ = ["OnnxCheck", "check_onnx", "export_onnx", "onnx_session"]

_MIN_BATCH = 2  # example batch for tracing; batch 1 would be specialised away


@dataclass(frozen=True)
class OnnxCheck:
    """The result of running an exported file against its torch module."""

    path: Path
    batch_sizes: tuple[int, ...]
    max_abs_diff: float


class _Wrapped(nn.Module):
    """Gives the exported graph one input named ``x`` and one output named ``y`` (a segment
    ending at a cut that carries side tensors has outputs ``y``, ``y.1``, ...)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> Activation:
        return self.module(x)  # type: ignore[no-any-return]


def _output_names(value: Activation) -> list[str]:
    return wire_names(1 + len(side(value)), "y")


def export_onnx(
    module: nn.Module,
    input_shape: tuple[int, ...],
    path: str | Path,
    input_range: tuple[int, int] | None = None,
) -> Path:
    """Export ``module`` (in eval mode) for inputs ``[batch, *input_shape]`` to ``path``
    (int64 token ids in ``input_range`` = [low, high) when given, else floats)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    wrapped = _Wrapped(module).eval()
    example = example_input(
        input_shape, input_range, _MIN_BATCH + 1, torch.Generator().manual_seed(0)
    )
    batch = torch.export.Dim("batch", min=1)
    with torch.no_grad():
        names = _output_names(wrapped(example))
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                wrapped,
                (example,),
                dynamic_shapes={"x": {0: batch}},
                input_names=["x"],
                output_names=names,
                verbose=False,
            )
            if program is None:
                raise ModelError("torch.onnx.export returned no program")
            program.save(str(target))
    except ModelError:
        raise
    except Exception as error:  # the exporter raises many unrelated types
        raise ModelError(f"ONNX export to {target} failed: {error}") from error
    finally:
        exporter_log.setLevel(level)
    return target


def onnx_session(path: str | Path) -> object:
    """An onnxruntime CPU session with one thread and no spin-waiting."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_onnx(
    path: str | Path,
    module: nn.Module,
    input_shape: tuple[int, ...],
    batch_sizes: tuple[int, ...] = (1, 5),
    seed: int = 0,
    input_range: tuple[int, int] | None = None,
) -> OnnxCheck:
    """Run the exported file and ``module`` on the same random batches; report max |diff|."""
    session = onnx_session(path)
    module.eval()
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    for batch in batch_sizes:
        sample = example_input(input_shape, input_range, batch, generator)
        with torch.no_grad():
            value = module(sample)
        expected = [t.numpy() for t in (primary(value), *side(value))]
        outputs = session.run(_output_names(value), {"x": sample.numpy()})  # type: ignore[attr-defined]
        for want, got in zip(expected, outputs, strict=True):
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ModelError(
                    f"{path}: onnxruntime output {got.dtype} {got.shape} != torch "
                    f"{want.dtype} {want.shape}"
                )
            if want.dtype.kind != "f":  # a mask or ids: exactly equal, or the check fails
                worst = max(worst, 0.0 if np.array_equal(got, want) else float("inf"))
            else:
                worst = max(worst, float(np.max(np.abs(got - want))))
    return OnnxCheck(Path(path), tuple(batch_sizes), worst)
