"""ONNX export of segments and whole models, checked with onnxruntime against torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from split_models import build_model
from split_models.onnx_export import check_onnx, export_onnx

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("name", "shape", "start", "end"),
    [
        ("cnn", (1, 28, 28), 0, 2),
        ("cnn", (1, 28, 28), 2, 6),
        ("resnet8", (3, 16, 16), 0, 5),
        ("mlp", (1, 8, 8), 0, 4),
    ],
)
def test_exported_segment_matches_torch_at_several_batch_sizes(
    tmp_path: Path, name: str, shape: tuple[int, ...], start: int, end: int
) -> None:
    model = build_model(name, shape, 10, seed=0)
    segment = model.segment(start, end)
    input_shape = shape
    if start > 0:
        import torch

        with torch.no_grad():
            input_shape = tuple(model.segment(0, start).eval()(torch.zeros(1, *shape)).shape[1:])
    path = export_onnx(segment, input_shape, tmp_path / f"{name}-{start}-{end}.onnx")
    result = check_onnx(path, segment, input_shape, batch_sizes=(1, 4, 9))
    assert result.max_abs_diff <= 1e-4
    assert result.batch_sizes == (1, 4, 9)


def test_check_detects_a_different_model(tmp_path: Path) -> None:
    exported = build_model("mlp", (1, 8, 8), 10, seed=0).full()
    other = build_model("mlp", (1, 8, 8), 10, seed=1).full()
    path = export_onnx(exported, (1, 8, 8), tmp_path / "mlp.onnx")
    assert check_onnx(path, other, (1, 8, 8)).max_abs_diff > 1e-3
