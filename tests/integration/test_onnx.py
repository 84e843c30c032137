"""ONNX export of segments and whole models, checked with onnxruntime against torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from split_models import build_model
from split_models.onnx_export import check_onnx, export_checked, export_onnx

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


@pytest.mark.parametrize(
    ("name", "shape", "ids", "end"),
    [
        ("cnn", (1, 28, 28), False, None),
        ("resnet8", (3, 16, 16), False, None),
        ("tests.fixtures.gallery:lstm_classifier", (12,), True, None),
        ("tests.fixtures.gallery:masked_transformer", (12,), True, 1),  # a mask crosses
    ],
)
def test_a_checked_export_takes_the_fast_exporter_when_its_file_matches_torch(
    tmp_path: Path, name: str, shape: tuple[int, ...], ids: bool, end: int | None
) -> None:
    from split_models.zoo import ModelOptions
    from tests.fixtures import gallery

    tokens = (0, gallery.VOCAB) if ids else None
    options = ModelOptions("int64", tokens) if ids else None
    model = build_model(name, shape, 10, seed=0, options=options)
    module = model.full() if end is None else model.segment(0, end)
    result = export_checked(module, shape, tmp_path / "m.onnx", tokens)
    assert result.exporter == "torchscript" and result.max_abs_diff <= 1e-4
    check = check_onnx(result.path, module, shape, (2, 7), input_range=tokens)
    assert check.max_abs_diff <= 1e-4


@pytest.mark.parametrize("fault", ["raises", "wrong file"])
def test_a_checked_export_falls_back_to_dynamo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    import split_models.onnx_export as onnx_export

    module = build_model("mlp", (1, 8, 8), 10, seed=0).full()
    other = build_model("mlp", (1, 8, 8), 10, seed=1).full()
    fast = onnx_export._torchscript

    def broken(wrapped: object, example: object, names: list[str], path: Path) -> None:
        if fault == "raises":
            raise RuntimeError("the TorchScript exporter is gone")
        fast(onnx_export._Wrapped(other).eval(), example, names, path)  # type: ignore[arg-type]

    monkeypatch.setattr(onnx_export, "_torchscript", broken)
    result = export_checked(module, (1, 8, 8), tmp_path / "m.onnx")
    assert result.exporter == "dynamo" and result.max_abs_diff <= 1e-4


def test_a_failing_torchscript_export_prints_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A transformer's TorchScript export fails and printed its whole IR graph (about 100
    long lines, from native code) before the dynamo exporter succeeded."""
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
            self.head = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.layer(x).mean(1))

    result = export_checked(Encoder().eval(), (5, 16), tmp_path / "t.onnx")

    assert result.exporter == "dynamo" and result.max_abs_diff <= 1e-4
    printed = capfd.readouterr()
    assert "Torch IR graph" not in printed.out + printed.err
