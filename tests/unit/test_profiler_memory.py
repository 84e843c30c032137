"""Profile numbers on known layers against hand-computed values; estimator arithmetic."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch import nn

from split_models import (
    ConfigError,
    build_model,
    estimate_segment_memory,
    profile_model,
    profile_module,
    segment_memory_table,
)
from split_models.profiler import BlockProfile, ModelProfile

pytestmark = pytest.mark.unit


def test_linear_layer() -> None:
    profile = profile_module(nn.Linear(10, 20), (10,))
    assert profile.param_bytes == (10 * 20 + 20) * 4
    assert profile.largest_param_bytes == 10 * 20 * 4
    assert profile.output_shape == (20,) and profile.output_bytes == 80
    assert profile.flops == 2 * 10 * 20
    assert profile.saves_input and not profile.saves_output
    assert profile.saved_bytes == 0  # only its input (counted as the input) and its weight


def test_conv_relu_maxpool_counts_shared_storage_once_and_int64_indices() -> None:
    block = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    profile = profile_module(block, (1, 8, 8))
    assert profile.param_bytes == (8 * 9 + 8) * 4
    assert profile.output_shape == (8, 4, 4) and profile.output_bytes == 8 * 4 * 4 * 4
    assert profile.flops == 2 * 8 * 9 * 8 * 8
    relu_output = 8 * 8 * 8 * 4  # saved by ReLU and by MaxPool as its input: counted once
    indices = 8 * 4 * 4 * 8  # MaxPool's int64 indices
    assert profile.saved_bytes == relu_output + indices
    assert profile.saves_input and not profile.saves_output


def test_relu_saves_its_output_and_batchnorm_has_fixed_saved_bytes() -> None:
    relu = profile_module(nn.ReLU(), (16,))
    assert relu.saves_output and relu.saved_bytes == 64 and relu.flops == 0
    norm = profile_module(nn.BatchNorm2d(4), (4, 3, 3))
    assert norm.saved_bytes == 4 * 3 * 3 * 4 - 0 or norm.saves_input
    assert norm.saved_fixed_bytes == 2 * 4 * 4  # saved mean and inverse std per channel
    assert norm.buffer_bytes == 4 * 4 * 2 + 8  # running mean, var and the batch counter


@pytest.fixture(scope="module")
def cnn_profile() -> ModelProfile:
    return profile_model(build_model("cnn", (1, 28, 28), 10, seed=0))


def test_profile_json_round_trip(cnn_profile: ModelProfile) -> None:
    assert ModelProfile.from_dict(cnn_profile.to_dict()) == cnn_profile
    assert set(cnn_profile.heads) == {"linear", "mlp", "supcon"}
    assert len(cnn_profile.heads["linear"]) == cnn_profile.num_blocks + 1


def test_estimate_components(cnn_profile: ModelProfile) -> None:
    blocks = cnn_profile.blocks[0:2]
    head = cnn_profile.heads["linear"][2]
    params = sum(b.param_bytes for b in blocks) + head.param_bytes
    sgd = estimate_segment_memory(cnn_profile, 0, 2, 32, "sgd")
    momentum = estimate_segment_memory(cnn_profile, 0, 2, 32, "sgd-momentum")
    adam = estimate_segment_memory(cnn_profile, 0, 2, 32, "adam")
    assert sgd.weights == params and sgd.gradients == params and sgd.optimizer_state == 0
    assert sgd.step_peak >= max(sgd.activations, sgd.gradients)
    assert momentum.optimizer_state == params
    largest = max(b.largest_param_bytes for b in (*blocks, head))
    assert adam.optimizer_state == 2 * params + 2 * largest
    assert sgd.input == 32 * (1 * 28 * 28 * 4 + 8)
    assert sgd.total == (
        sgd.weights
        + sgd.optimizer_state
        + sgd.input
        + sgd.kernel_setup
        + sgd.bookkeeping
        + sgd.step_peak
    )


def test_estimate_grows_with_batch_and_last_segment_has_no_head(cnn_profile: ModelProfile) -> None:
    small = estimate_segment_memory(cnn_profile, 0, 3, 16, "sgd")
    large = estimate_segment_memory(cnn_profile, 0, 3, 64, "sgd")
    assert large.activations > 3 * small.activations and large.weights == small.weights
    assert large.step_peak > 3 * small.step_peak
    last = estimate_segment_memory(cnn_profile, 4, 6, 16, "sgd")
    assert last.weights == sum(b.param_bytes for b in cnn_profile.blocks[4:6])


def test_table_equals_single_estimates(cnn_profile: ModelProfile) -> None:
    for optimizer, head in (("sgd", "mlp"), ("adam", "mlp"), ("sgd-momentum", None)):
        table = segment_memory_table(cnn_profile, 24, optimizer, head)
        for start in range(cnn_profile.num_blocks):
            for end in range(start + 1, cnn_profile.num_blocks + 1):
                single = estimate_segment_memory(cnn_profile, start, end, 24, optimizer, head)
                assert table[start][end] == single.total


def test_a_backprop_segment_keeps_the_gradient_it_receives(cnn_profile: ModelProfile) -> None:
    # splitfed: no head; the next segment's gradient of the output (as large as the output)
    # is alive through the whole backward pass, on top of the saved activations
    backprop = estimate_segment_memory(cnn_profile, 0, 2, 32, "sgd", None)
    received = 32 * cnn_profile.blocks[1].output_bytes
    assert backprop.step_peak >= 1.06 * (backprop.activations + received)
    last = estimate_segment_memory(cnn_profile, 4, 6, 32, "sgd", None)  # the task loss's own
    assert last == estimate_segment_memory(cnn_profile, 4, 6, 32, "sgd", "linear")


def test_estimate_rejects_bad_input(cnn_profile: ModelProfile) -> None:
    with pytest.raises(ConfigError, match="outside"):
        estimate_segment_memory(cnn_profile, 3, 3, 8, "sgd")
    with pytest.raises(ConfigError, match="optimizer"):
        estimate_segment_memory(cnn_profile, 0, 1, 8, "rmsprop")
    with pytest.raises(ConfigError, match="batch_size"):
        estimate_segment_memory(cnn_profile, 0, 1, 0, "sgd")
    only_linear = profile_model(build_model("mlp", (1, 8, 8), 10), local_losses=("linear",))
    with pytest.raises(ConfigError, match="not profiled"):
        estimate_segment_memory(only_linear, 0, 1, 8, "sgd", "supcon")


def test_a_segment_start_counts_the_kernels_of_a_pass_without_an_input_gradient(
    cnn_profile: ModelProfile,
) -> None:
    # A segment's first block gets no input gradient, so it never makes the kernels for one:
    # its setup is the one measured without an input gradient; later blocks and the head add
    # their whole setup.
    def with_setups(block: BlockProfile, first: int, full: int) -> BlockProfile:
        return replace(block, first_kernel_setup_bytes=first, kernel_setup_bytes=full)

    blocks = tuple(
        with_setups(block, 1000 * (index + 1), 100_000 * (index + 1))
        for index, block in enumerate(cnn_profile.blocks)
    )
    heads = {
        kind: tuple(with_setups(head, 7, 700_000) for head in profiles)
        for kind, profiles in cnn_profile.heads.items()
    }
    profile = replace(cnn_profile, blocks=blocks, heads=heads)
    assert (
        estimate_segment_memory(profile, 1, 3, 16, "sgd").kernel_setup == 2000 + 300_000 + 700_000
    )
    assert estimate_segment_memory(profile, 4, 6, 16, "sgd").kernel_setup == 5000 + 600_000


def test_a_segment_pays_the_cold_setup_that_blocks_before_it_hid(
    cnn_profile: ModelProfile,
) -> None:
    # In order, a block's setup leaves out what earlier blocks of the model made; cold (a fresh
    # process) it counts what it shares with the segment's other blocks. The segment's setup is
    # the largest cold setup of a block plus what each later block added in order.
    def with_setups(block: BlockProfile, in_order: int, cold: int) -> BlockProfile:
        return replace(
            block,
            first_kernel_setup_bytes=in_order,
            kernel_setup_bytes=in_order,
            first_cold_kernel_setup_bytes=cold,
            cold_kernel_setup_bytes=cold,
        )

    setups = [(100, 100), (10, 900), (20, 300), (30, 40), (0, 0), (0, 0)]
    blocks = tuple(with_setups(b, *s) for b, s in zip(cnn_profile.blocks, setups, strict=True))
    heads = {
        kind: tuple(replace(head, kernel_setup_bytes=0) for head in profiles)
        for kind, profiles in cnn_profile.heads.items()
    }
    profile = replace(cnn_profile, blocks=blocks, heads=heads)
    assert estimate_segment_memory(profile, 0, 4, 16, "sgd").kernel_setup == 900 + 20 + 30
    assert estimate_segment_memory(profile, 2, 4, 16, "sgd").kernel_setup == 300 + 30
    assert estimate_segment_memory(profile, 3, 4, 16, "sgd").kernel_setup == 40
    unmeasured = replace(profile, blocks=tuple(with_setups(b, 100, 0) for b in blocks))
    assert estimate_segment_memory(unmeasured, 0, 3, 16, "sgd").kernel_setup == 300


def test_the_last_segment_needs_no_profile_of_the_configured_local_head() -> None:
    # the back ends in the task loss: a model profiled only for mlp heads still estimates it
    profile = profile_model(build_model("mlp", (1, 8, 8), 10), local_losses=("mlp",))
    whole = estimate_segment_memory(profile, 1, profile.num_blocks, 16, "sgd")
    assert whole.total > 0
    with pytest.raises(ConfigError, match="'linear' was not profiled"):
        estimate_segment_memory(profile, 0, 1, 16, "sgd")  # a front does need its head


def test_a_batch_of_one_for_a_model_with_batch_norm_is_refused_by_name() -> None:
    """It failed as an 'unexpected ValueError' from BatchNorm, in plan and simulate."""
    model = build_model("resnet8", (3, 16, 16), 10, seed=0)
    with pytest.raises(ConfigError, match=r"batch_size: 1, but the model's BatchNorm layers"):
        profile_model(model, local_losses=("linear",), batch_size=1)
    assert profile_model(build_model("mlp", (1, 8, 8), 10, seed=0), ("linear",), batch_size=1)
