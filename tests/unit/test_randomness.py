"""Each trainer's dropout masks come from a stream of its own: the same whatever other threads
draw, seed or build meanwhile (split_models.randomness)."""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

from split_models.randomness import RandomStream, apart, stream_seed
from split_models.zoo import build_model


def _masks(stream: RandomStream, steps: int, between: threading.Barrier | None = None) -> list:
    drop, ones, drawn = nn.Dropout(0.5).train(), torch.ones(256), []
    for _ in range(steps):
        with stream.drawing():
            drawn.append(drop(ones))
        if between is not None:
            between.wait()  # the other thread draws here, between two of this one's
    return drawn


def test_a_stream_draws_the_same_masks_alone_and_beside_another_thread() -> None:
    alone = _masks(RandomStream(stream_seed(3, "client-000", 1, 1)), 20)
    turns = threading.Barrier(2)
    results: dict[str, list] = {}

    def train(name: str) -> None:
        results[name] = _masks(RandomStream(stream_seed(3, name, 1, 1)), 20, turns)

    threads = [threading.Thread(target=train, args=(n,)) for n in ("client-000", "client-001")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(a, b) for a, b in zip(alone, results["client-000"], strict=True))
    assert not torch.equal(results["client-000"][0], results["client-001"][0])


def test_seeding_and_building_apart_leave_a_stream_and_the_generator_alone() -> None:
    stream = RandomStream(stream_seed(0, "server", 2, 1))
    expected = _masks(RandomStream(stream_seed(0, "server", 2, 1)), 3)
    outside = torch.get_rng_state()
    drop, ones = nn.Dropout(0.5).train(), torch.ones(256)
    with stream.drawing():
        first = drop(ones)
        build_model("cnn", (1, 8, 8), 10, seed=7)  # seeds torch and draws its weights, apart
        with apart():
            torch.manual_seed(1)
            torch.rand(5)
        second = drop(ones)
    third = _masks(stream, 1)[0]
    drawn = [first, second, third]
    assert [torch.equal(a, b) for a, b in zip(expected, drawn, strict=True)] == [True] * 3
    assert torch.equal(torch.get_rng_state(), outside), "the generator is as it was"


def test_a_forward_that_draws_nothing_is_not_swapped_in_again() -> None:
    stream, linear = RandomStream(5), nn.Linear(4, 4)
    with stream.drawing("block 0"):
        linear(torch.ones(1, 4))
    outside = torch.get_rng_state()
    with stream.drawing("block 0"):
        torch.rand(1)  # no longer the stream's: it draws from the generator as it stands
    assert not torch.equal(torch.get_rng_state(), outside)
    before = torch.get_rng_state()
    with stream.drawing("block 2"):  # another way in is probed afresh: the stream's draw
        torch.rand(1)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_pass_that_failed_is_probed_again() -> None:
    # it may have failed before its dropout: not remembered as drawing nothing
    stream = RandomStream(5)
    with contextlib.suppress(ValueError), stream.drawing("block 3"):
        raise ValueError("a malformed batch")
    before = torch.get_rng_state()
    with stream.drawing("block 3"):
        torch.rand(1)  # still the stream's draw
    assert torch.equal(torch.get_rng_state(), before)


def test_seeds_differ_by_every_part_and_fit_a_generator() -> None:
    seeds = {stream_seed(0, "a", 1, 1), stream_seed(1, "a", 1, 1), stream_seed(0, "b", 1, 1)}
    seeds |= {stream_seed(0, "a", 2, 1), stream_seed(0, "a", 1, 2)}
    assert len(seeds) == 5 and all(0 <= s < 2**63 for s in seeds)
    assert stream_seed(0, "a", 1, 1) == stream_seed(0, "a", 1, 1)
