"""ONNX export of a segment or a whole model (local heads removed), checked with onnxruntime.

Both of torch's exporters are used, with a dynamic batch dimension: :func:`export_checked`
tries the TorchScript exporter first (about 0.5 s for mobilenet_v3_small, where the dynamo
exporter takes 10-13 s) and keeps its file only when onnxruntime reproduces the module at
several batch sizes; otherwise (a trace that specialised a shape, an exporter that refuses the
model or is gone from torch) it exports with the dynamo exporter, torch's default. onnxruntime
runs with one thread and spinning disabled, so it does not fight torch's threads for the cores.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from split_models.activations import Activation, primary, side, wire_names
from split_models.errors import ModelError
from split_models.trace_modes import kept_buffers
from split_models.zoo import example_input

__all__ = ["EXPORTERS", "OnnxCheck", "check_onnx", "export_checked", "export_onnx", "onnx_session"]

log = logging.getLogger(__name__)
_MIN_BATCH = 2  # example batch for tracing; batch 1 would be specialised away
EXPORTERS = ("dynamo", "torchscript")


@dataclass(frozen=True)
class OnnxCheck:
    """The result of running an exported file against its torch module."""

    path: Path
    batch_sizes: tuple[int, ...]
    max_abs_diff: float
    exporter: str = ""  # which of EXPORTERS wrote the file, where export_checked knows


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
    exporter: str = "dynamo",
) -> Path:
    """Export ``module`` (in eval mode) for inputs ``[batch, *input_shape]`` to ``path``
    (int64 token ids in ``input_range`` = [low, high) when given, else floats) with one of
    :data:`EXPORTERS`. Prefer :func:`export_checked`, which picks the exporter."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter: expected one of {EXPORTERS}, got {exporter!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    wrapped = _Wrapped(module).eval()
    example = example_input(
        input_shape, input_range, _MIN_BATCH + 1, torch.Generator().manual_seed(0)
    )
    with kept_buffers(module), torch.no_grad():  # a forward may update its buffers
        names = _output_names(wrapped(example))
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad(), kept_buffers(module):
            warnings.simplefilter("ignore")
            if exporter == "torchscript":
                _torchscript(wrapped, example, names, target)
            else:
                program = torch.onnx.export(
                    wrapped,
                    (example,),
                    dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1)}},
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


def _torchscript(module: nn.Module, example: torch.Tensor, names: list[str], path: Path) -> None:
    """The TorchScript exporter: traces ``module`` once on ``example``."""
    torch.onnx.export(
        module,
        (example,),
        str(path),
        input_names=["x"],
        output_names=names,
        dynamic_axes={name: {0: "batch"} for name in ["x", *names]},
        dynamo=False,
    )


@contextlib.contextmanager
def _native_stdout_quiet() -> Iterator[None]:
    """Within the block, what native code writes to the process's stdout goes to a file that
    is logged at debug level: torch's TorchScript exporter prints a model's whole IR graph
    when it fails (torch 2.13's setup_onnx_logging turns its log on and never off), a page
    of text before the dynamo exporter succeeds. Python's own prints are left alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 1)
        try:
            yield
        finally:
            with contextlib.suppress(OSError, TypeError, AttributeError):  # no libc here
                ctypes.CDLL(None).fflush(None)  # C stdio's buffer, before fd 1 goes back
            os.dup2(saved, 1)
            os.close(saved)
            caught.seek(0)
            if text := caught.read(1 << 20):
                log.debug("the TorchScript exporter printed: %s", text.decode(errors="replace"))


def export_checked(
    module: nn.Module,
    input_shape: tuple[int, ...],
    path: str | Path,
    input_range: tuple[int, int] | None = None,
    tolerance: float = 1e-4,
) -> OnnxCheck:
    """Export ``module`` to ``path`` and check it against torch (see the module's notes):
    the TorchScript exporter's file when onnxruntime matches torch within ``tolerance`` at
    batch sizes 1, 3 and 5, else the dynamo exporter's, whatever its check says (the
    caller judges it)."""
    try:
        with _native_stdout_quiet():  # a failing TorchScript export prints its whole IR
            export_onnx(module, input_shape, path, input_range, exporter="torchscript")
        check = check_onnx(path, module, input_shape, (1, 3, 5), input_range=input_range)
        if check.max_abs_diff <= tolerance:
            return dataclasses.replace(check, exporter="torchscript")
        log.info(
            "%s: the TorchScript export differs by %.3g; exporting with dynamo",
            path,
            check.max_abs_diff,
        )
    except Exception as error:  # the exporter and onnxruntime raise many unrelated types
        log.info("%s: the TorchScript export failed (%s); exporting with dynamo", path, error)
    export_onnx(module, input_shape, path, input_range, exporter="dynamo")
    check = check_onnx(path, module, input_shape, (1, 3, 5), input_range=input_range)
    return dataclasses.replace(check, exporter="dynamo")


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
        with torch.no_grad(), kept_buffers(module):  # each batch at the buffers the file holds
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
