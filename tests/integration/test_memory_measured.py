"""The memory estimate against the real peak of a training step in a fresh process."""

from __future__ import annotations

import json

import pytest

from split_models import estimate_segment_memory
from split_models.config import ModelConfig, config_to_dict
from split_models.errors import ConfigError
from split_models.isolated import profile_in_fresh_process
from split_models.measure import peak_supported, run_measuring_child

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not peak_supported(), reason="needs Linux /proc/self/clear_refs"),
]


# (model, start, end, batch, FedProx's proximal_mu: > 0 keeps the round's weights as an
# anchor, mode: backprop is splitfed's edge, no head, the next segment's gradient received)
@pytest.mark.parametrize(
    ("model", "start", "end", "batch", "mu", "mode"),
    [
        ("cnn", 0, 2, 32, 0.0, "local-loss"),
        ("cnn", 2, 6, 64, 0.0, "local-loss"),
        ("cnn", 2, 6, 16, 0.1, "local-loss"),
        ("resnet8", 0, 1, 16, 0.0, "backprop"),  # -11.5% before the received gradient counted
    ],
)
def test_estimate_is_within_15_percent_of_measured_peak(
    model: str, start: int, end: int, batch: int, mu: float, mode: str
) -> None:
    # profiled in a fresh process: this one's heap holds whatever earlier tests freed
    shape = (1, 28, 28) if model == "cnn" else (3, 32, 32)
    spec = ModelConfig(model, shape, 10)
    profile = profile_in_fresh_process(spec, ("linear",), batch)
    anchor, head = mu > 0, None if mode == "backprop" else "linear"
    estimate = estimate_segment_memory(
        profile, start, end, batch, "sgd-momentum", head, anchor=anchor
    ).total
    # measured as benchmarks/memory.py does: a fresh process with the measurement allocator
    done = run_measuring_child(
        [
            "split_models.measure",
            "--model",
            json.dumps(config_to_dict(spec)),
            "--start",
            str(start),
            "--end",
            str(end),
            "--batch-size",
            str(batch),
            f"--proximal-mu={mu}",
            f"--mode={mode}",
        ],
        timeout=300,
    )
    done.check_returncode()
    measured = json.loads(done.stdout)["peak_bytes"]
    error = (estimate - measured) / measured
    assert -0.10 <= error <= 0.15, f"estimate {estimate} vs measured {measured}: {error:+.1%}"


def test_fresh_process_profile_reports_a_bad_model_as_a_config_error() -> None:
    with pytest.raises(ConfigError, match="nonexistent"):
        profile_in_fresh_process(ModelConfig("nonexistent", (1, 28, 28), 10))
