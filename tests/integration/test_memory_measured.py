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


# (start, end, batch, FedProx's proximal_mu: > 0 keeps the round's weights as an anchor)
@pytest.mark.parametrize(
    ("start", "end", "batch", "mu"), [(0, 2, 32, 0.0), (2, 6, 64, 0.0), (2, 6, 16, 0.1)]
)
def test_estimate_is_within_15_percent_of_measured_peak(
    start: int, end: int, batch: int, mu: float
) -> None:
    # profiled in a fresh process: this one's heap holds whatever earlier tests freed
    spec = ModelConfig("cnn", (1, 28, 28), 10)
    profile = profile_in_fresh_process(spec, ("linear",), batch)
    anchor = mu > 0
    estimate = estimate_segment_memory(
        profile, start, end, batch, "sgd-momentum", anchor=anchor
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
