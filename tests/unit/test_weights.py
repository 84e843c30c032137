"""Global tensor names: the same layer has the same key on every device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from split_models import ModelError, Segment, build_model
from split_models.weights import load_segment_state, segment_state
from storage.checkpoints import CheckpointFiles

pytestmark = pytest.mark.unit


def test_replicas_of_a_block_share_keys_and_heads_are_keyed_by_cut() -> None:
    model = build_model("resnet8", (3, 8, 8), 10, seed=0)
    shallow = segment_state(Segment.from_model(model, 0, 1, "linear"))
    deep = segment_state(Segment.from_model(model, 0, 3, "mlp"))
    back = segment_state(Segment.from_model(model, 1, model.num_blocks))
    assert {k for k in shallow if k.startswith("block0.")} <= set(deep)
    assert any(k.startswith("head1.") for k in shallow) and any(
        k.startswith("head3.") for k in deep
    )
    assert not any(k.startswith("head") for k in back), "the last segment has the task loss"
    assert {k for k in deep if k.startswith("block1.")} <= set(back)
    assert "block0.1.running_mean" in shallow, "buffers (BatchNorm statistics) travel too"


def test_load_round_trips_and_touches_only_the_segment() -> None:
    source = Segment.from_model(build_model("cnn", (1, 8, 8), 10, seed=1), 0, 2, "linear")
    target_model = build_model("cnn", (1, 8, 8), 10, seed=2)
    target = Segment.from_model(target_model, 0, 2, "linear")
    untouched = target_model.blocks[3][0].weight.detach().clone()
    arrays = segment_state(source) | {"block5.0.weight": np.zeros((10, 128), np.float32)}
    load_segment_state(target, arrays)
    for key, value in segment_state(target).items():
        assert np.array_equal(value, arrays[key])
    assert torch.equal(target_model.blocks[3][0].weight, untouched)
    x = torch.randn(4, 1, 8, 8)
    assert torch.equal(source.forward(x), target.forward(x))


def test_load_takes_read_only_and_strided_arrays_and_keeps_no_view_of_them() -> None:
    """Weights decoded from a message may be read-only buffers or strided views: loaded as
    values, and changing the arrays afterwards does not change the segment."""
    source = Segment.from_model(build_model("cnn", (1, 8, 8), 10, seed=1), 0, 2, "linear")
    target = Segment.from_model(build_model("cnn", (1, 8, 8), 10, seed=2), 0, 2, "linear")
    state = segment_state(source)
    arrays = {}
    for index, (key, value) in enumerate(state.items()):
        if index % 2:  # read-only, as np.frombuffer over a message's bytes
            arrays[key] = np.frombuffer(value.tobytes(), value.dtype).reshape(value.shape)
        else:  # a strided view of a larger buffer
            wide = np.zeros((*value.shape, 2), value.dtype)
            wide[..., 0] = value
            arrays[key] = wide[..., 0]
    load_segment_state(target, arrays)
    for index, key in enumerate(arrays):
        if not index % 2:
            arrays[key][...] = 7  # the writable views change after the load
    for key, value in segment_state(target).items():
        assert np.array_equal(value, state[key]), key


def test_missing_or_misshaped_tensors_are_refused() -> None:
    segment = Segment.from_model(build_model("mlp", (1, 8, 8), 10, seed=0), 0, 2, "linear")
    state = segment_state(segment)
    with pytest.raises(ModelError, match="lack"):
        load_segment_state(segment, {k: v for k, v in state.items() if not k.startswith("head")})
    wrong = dict(state)
    wrong["block0.1.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ModelError, match=r"block0\.1\.weight: shape"):
        load_segment_state(segment, wrong)


def test_batchnorm_state_round_trips_through_a_checkpoint_file_with_its_scalar_shapes(
    tmp_path: Path,
) -> None:
    model = build_model("resnet8", (3, 8, 8), 10, seed=0)
    segment = Segment.from_model(model, 0, 2, "linear")
    segment.train_step(torch.randn(4, 3, 8, 8), torch.zeros(4, dtype=torch.long))
    state = segment_state(segment)
    assert state["block0.1.num_batches_tracked"].shape == ()  # a 0-d tensor
    files = CheckpointFiles(tmp_path)
    digest, size = files.put(state)
    stored = files.get(digest, size)
    assert {k: v.shape for k, v in stored.items()} == {k: v.shape for k, v in state.items()}
    fresh = Segment.from_model(build_model("resnet8", (3, 8, 8), 10, seed=1), 0, 2, "linear")
    load_segment_state(fresh, stored)
    assert int(fresh.module[0][1].num_batches_tracked) == 1


def test_checkpoints_written_with_scalars_as_shape_1_still_load() -> None:
    segment = Segment.from_model(build_model("resnet8", (3, 8, 8), 10, seed=0), 0, 1, "linear")
    legacy = segment_state(segment)
    legacy["block0.1.num_batches_tracked"] = np.array([7], dtype=np.int64)
    load_segment_state(segment, legacy)
    assert int(segment.module[0][1].num_batches_tracked) == 7


def test_stored_weights_are_brought_to_the_models_dtypes() -> None:
    """A run a robust rule committed before it kept dtypes holds an int64 batch count as
    float64: resumed as stored, every device's int64 reply would be refused."""
    from split_models.weights import in_dtypes_of

    model = {"bn.num_batches_tracked": np.array(4), "bn.weight": np.ones(2, np.float32)}
    stored = {
        "bn.num_batches_tracked": np.array(9.0),
        "bn.weight": np.full(2, 0.5, np.float32),
        "head5.w": np.zeros(1, np.float64),  # not in the model: as it is
    }
    brought = in_dtypes_of(model, stored)
    assert {k: v.dtype for k, v in brought.items()} == {
        "bn.num_batches_tracked": np.int64,
        "bn.weight": np.float32,
        "head5.w": np.float64,
    }
    assert int(brought["bn.num_batches_tracked"]) == 9
